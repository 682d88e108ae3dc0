. benchmarks/gpu_setup.sh
for p in fp32 bf16; do for n in 1 2; do timeout 70 mgpu-train -np $n benchmarks/torch_native_resnet50.py --precision $p --steps 30 --out /tmp/native_${p}_$n.json > /tmp/native_${p}_$n.log 2>&1; echo "native $p np=$n rc=$?"; grep -a "native torch" /tmp/native_${p}_$n.log; done; done
python3 -c "import json,glob; print(json.dumps([json.load(open(f)) for f in sorted(glob.glob('/tmp/native_*.json'))]))" > $OUT/native.json
B="python3 benchmarks/keras_resnet50.py --backend torch --data device --steps 30 --warmup-steps 10"
timeout 250 $B --precision float32,mixed_bfloat16 --out /tmp/kt > /tmp/kt.out 2>&1; echo "== keras-torch rc=$?"; grep "^| torch\|^\[bench\]" /tmp/kt.out
cp /tmp/kt/results.json $OUT/keras_torch.json
MGPU_TORCH_OVERLAP=0 timeout 70 $B --precision mixed_bfloat16 --gpus 2 --out /tmp/kt_no > /tmp/kt_no.out 2>&1; echo "== no-overlap rc=$?"; grep "^| torch" /tmp/kt_no.out
cp /tmp/kt_no/results.json $OUT/keras_torch_nooverlap.json
tar czf $OUT/logs5.tgz -C /tmp kt kt_no kt.out native_fp32_1.log native_fp32_2.log native_bf16_1.log native_bf16_2.log 2>/dev/null
