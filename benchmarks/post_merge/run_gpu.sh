#!/bin/bash
# One GPU call after issues 17-20 were merged into one tree (2x H200): do the merged
# mgpu-bench worker (profile + CUDA-graph loops) and the torch graph step still work?
#   . benchmarks/gpu_setup.sh && bash benchmarks/post_merge/run_gpu.sh
# 1. capture-vs-eager weights after 20 steps (issue 19's check);
# 2. Keras-torch ResNet-50 float32, captured and eager, 1 and 2 GPUs, native DDP beside;
# 3. Keras-JAX ResNet-50 float32 at 2 GPUs with --profile (issue 18's breakdown).
set -u
export PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
KERAS_BACKEND=jax python3 -c "import torch, jax, keras; print('torch', torch.__version__, 'jax', jax.__version__, 'keras', keras.__version__)"
start=$SECONDS
KERAS_BACKEND=torch timeout 150 mgpu-train -np 2 benchmarks/post_merge/exit_watch.py \
    benchmarks/torch_cuda_graph/check_same_weights.py "$OUT/correctness.json" \
    > "$OUT/correctness.log" 2>&1
echo "weight check: exit $? after $((SECONDS - start)) s"
grep -a -A12 "Timeout (0:00:30)" "$OUT/correctness.log" | head -40
python3 - "$OUT/correctness.json" <<'PY' || tail -30 "$OUT/correctness.log"
import json, sys
r = json.load(open(sys.argv[1]))
for key in ("counts", "warnings", "max_relative_difference", "allclose_rtol_1e-5", "ok"):
    print(key, json.dumps(r[key]))
PY
[ "${SKIP_TORCH_BENCH:-0}" = 1 ] || KERAS_BACKEND=torch timeout 300 mgpu-bench --model resnet50 --backend torch,native \
    --precision float32 --gpus 1,2 --data device --cuda-graph 1,0 \
    --steps 20 --warmup-steps 10 --window 5 --timeout 120 --out "$OUT/torch" > "$OUT/torch.log" 2>&1
echo "torch bench: exit $?"; tail -15 "$OUT/torch.log"
timeout 200 mgpu-bench --model resnet50 --backend jax --precision float32 --gpus 2 --profile \
    --steps 30 --timeout 150 --out "$OUT/jax" > "$OUT/jax.log" 2>&1
echo "jax profile: exit $?"; tail -15 "$OUT/jax.log"
grep -a "Error" "$OUT"/jax/logs/*.log | head -5
rm -rf "$OUT"/*/results.png
date -u
