#!/bin/bash
# Issue 19's one GPU invocation (2 GPUs): the capture-vs-eager weight check, then Keras-torch
# ResNet-50 float32 and mixed_bfloat16 at 1 and 2 GPUs with the step captured and eager, and
# native torchvision DDP beside them. Run from the project root on the GPU machine after the
# install lines of shared/gpu/README.md (mgpu-train / mgpu-bench on PATH); writes 6 files
# under $OUT. About 4-6 minutes.
#
#   bash benchmarks/torch_cuda_graph/run_gpu.sh
#
# --cuda-graph 1,0 measures the captured step first in each job: the eager fit's autograd
# nodes would otherwise be bound to the default stream when the captured fit warms up.
set -u
export KERAS_BACKEND=torch PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 mgpu-train -np 2 benchmarks/torch_cuda_graph/check_same_weights.py \
    "$OUT/correctness.json" > "$OUT/correctness.log" 2>&1
echo "weight check: exit $?"
python3 - "$OUT/correctness.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for key in ("counts", "warnings", "max_relative_difference", "allclose_rtol_1e-5", "ok"):
    print(key, json.dumps(r[key]))
PY
timeout 420 mgpu-bench --model resnet50 --backend torch,native \
    --precision float32,mixed_bfloat16 --gpus 1,2 --data device --cuda-graph 1,0 \
    --steps 20 --warmup-steps 10 --window 5 --timeout 150 --out "$OUT/bench" \
    > "$OUT/bench.log" 2>&1
echo "bench: exit $?"
rm -f "$OUT/bench/results.png" "$OUT"/bench/logs/*.json
tar -C "$OUT/bench" -czf "$OUT/bench/logs.tar.gz" logs && rm -rf "$OUT/bench/logs"
tail -40 "$OUT/bench.log"
grep -a "CudaGraphFallbackWarning" "$OUT/correctness.log" | head -3
date -u
