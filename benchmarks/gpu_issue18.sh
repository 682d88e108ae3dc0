# The GPU runs behind benchmarks/*_h200x2.* for issue 18 (2x H200; the 4- and 8-GPU kinds were
# not lent). Source from the project root on the GPU machine after `. benchmarks/gpu_setup.sh`:
#     . benchmarks/gpu_issue18.sh STAGE
# Each stage is one device call (< 10 min); results land in /tmp/bench/<name>/ and $OUT.
stage=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache  # np=1 jobs of one model share a compile
LHS=--xla_gpu_enable_latency_hiding_scheduler=true
run() {  # run NAME mgpu-bench-args...
  name=$1; shift
  mgpu-bench "$@" --out /tmp/bench/$name 2>&1 | tee /tmp/bench-$name.out
  cp /tmp/bench/$name/results.json $OUT/$name.json 2>/dev/null
  cp /tmp/bench/$name/results.md $OUT/$name.md 2>/dev/null
}
B="--model resnet50 --steps 30 --timeout 150"
case $stage in
  1) run base --backend jax,native --precision float32,mixed_bfloat16 --gpus 1,2 $B
     cp /tmp/bench/base/results.png $OUT/base.png 2>/dev/null
     XLA_FLAGS=$LHS run lhs --backend jax --precision float32,mixed_bfloat16 --gpus 1,2 $B
     run profile --backend jax --precision mixed_bfloat16 --gpus 2 --data host,host-uint8 \
         --profile $B ;;
  2) run base2 --backend jax --precision float32 --gpus 1,2 $B
     XLA_FLAGS=$LHS run lhs2 --backend jax --precision float32 --gpus 1,2 $B
     XLA_FLAGS=$LHS MGPU_FUSION_MB=16 run lhs16 --backend jax --precision float32 --gpus 1,2 $B
     run bf16wire --backend jax --precision mixed_bfloat16 --gpus 1,2 --compression bf16 $B
     run profile32 --backend jax --precision float32 --gpus 2 --profile $B ;;
esac
tar czf $OUT/logs$stage.tgz -C /tmp bench 2>/dev/null
