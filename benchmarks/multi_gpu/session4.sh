#!/bin/bash
# Issue 48 item 6 / issue 50 item 1 / issue 49 item 4 on a machine of $NP GPUs (default: all of
# them; written for 4, run on 2 when no 4-GPU machine was lent), one GPU per rank.
# Prerequisites as for benchmarks/multi_gpu/session.sh (.whl carried, with keras-hub and its
# pure-Python dependencies; TensorFlow unpacked in /tmp/tfgpu). From the project root:
#   bash benchmarks/multi_gpu/session4.sh STAGE...     (logs tarred into $OUT/STAGE.tgz)
# Stages:
#   matrix4   tests/scripts/exactness.py at $NP processes for TF, JAX and torch AT ONCE (three
#             jobs sharing the 4 GPUs: memory growth / no preallocation), the cases in
#             $CASES4 (default: the keras-hub and unknown-batch cases plus a core set), TF32 off,
#             deterministic kernels; compared by tests/test_exactness_matrix.check_case
#   hub       examples/keras_hub_causal_lm.py (GPT-2 "small", bf16) at 1 and $NP GPUs, tokens/s,
#             tensorflow, jax and torch
#   synthetic Horovod's benchmark script (examples/keras_resnet50_synthetic.py, batch 128, fp32,
#             TF) on $NP GPUs with its timeline, then mgpu-bench TF fp32 at 1 and $NP GPUs
#   bench     mgpu-bench ResNet-50 at 1 .. $NP GPUs (1,2 or 1,2,4), tensorflow, jax and native torch, one
#             precision ($PRECISION, default mixed_bfloat16), device data
set -u
export PYTHONUNBUFFERED=1 EXACTNESS_FP32=1 NVIDIA_TF32_OVERRIDE=0 \
       JAX_DEFAULT_MATMUL_PRECISION=highest TF_CPP_MIN_LOG_LEVEL=2 \
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"
. benchmarks/gpu_stages.sh || exit 1
nvidia-smi topo -m | head -6
NP=${NP:-$(nvidia-smi -L | wc -l)}
GPUS=$([ "$NP" -ge 4 ] && echo 1,2,4 || echo 1,$NP)
CASES4=${CASES4:-'["dense_3d_shard","gpt2_lm_split","gpt2_lm_shard","gpt2_lm_tfdata","bert_classifier_split","bert_classifier_shard","bert_classifier_tfdata","bert_lora_split","bert_lora_shard","bert_lora_tfdata","transformer_adamw","embedding_adam","sgd_momentum","mixed_bfloat16","vision_sync_bn"]'}

stage_matrix4() {
  local backend
  for backend in tensorflow jax torch; do
    mkdir -p "$1/$backend"
    KERAS_BACKEND=$backend TF_FORCE_GPU_ALLOW_GROWTH=true XLA_PYTHON_CLIENT_PREALLOCATE=false \
      timeout "${MATRIX_TIMEOUT:-520}" mgpu-train -np "$NP" tests/scripts/exactness.py "$CASES4" \
      "$1/$backend" > "$1/matrix4_$backend.log" 2>&1 &
  done
  wait
  for backend in tensorflow jax torch; do
    echo "--- $backend: $(grep -c ' done' "$1/matrix4_$backend.log") case-rank lines done"
    grep -aE "Error|error:" "$1/matrix4_$backend.log" | head -5
    PYTHONPATH=tests:$PYTHONPATH KERAS_BACKEND=$backend python3 benchmarks/multi_gpu/check4.py \
      "$1/$backend" "$CASES4" "$NP" | tee "$1/check4_$backend.txt"
  done
}

stage_bench() {
  clean_env timeout 570 mgpu-bench --model resnet50 --backend tensorflow,jax,native \
    --precision "${PRECISION:-mixed_bfloat16}" --gpus "$GPUS" --data device \
    --steps ${BENCH_STEPS:-30} --timeout 200 --out "$1/bench" ${RESUME:-} > "$1/bench.log" 2>&1
  echo "bench: exit $?"; tail -30 "$1/bench.log"; rm -f "$1/bench/results.png"
  cp -r "$1/bench" "$OUT/bench_${PRECISION:-mixed_bfloat16}" 2>/dev/null
}

clean_env() {  # what users get: TF32 and XLA's usual kernels, not the matrix's settings
  env -u EXACTNESS_FP32 -u NVIDIA_TF32_OVERRIDE -u JAX_DEFAULT_MATMUL_PRECISION -u XLA_FLAGS "$@"
}

stage_hub() {
  local backend np
  for backend in tensorflow jax torch; do
    for np in 1 "$NP"; do
      KERAS_BACKEND=$backend clean_env timeout 150 mgpu-train -np "$np" \
        examples/keras_hub_causal_lm.py --size small --precision mixed_bfloat16 --seq-len 128 \
        --batch-size 32 --sequences $((4096 * np)) --epochs 3 > "$1/hub_${backend}_np$np.log" 2>&1
      echo "$backend np=$np: exit $? $(grep -a 'tokens/s' "$1/hub_${backend}_np$np.log")"
    done
  done
}

stage_synthetic() {
  KERAS_BACKEND=tensorflow clean_env timeout 200 mgpu-train -np "$NP" --timeline "$1/syn.json" \
    examples/keras_resnet50_synthetic.py --batch-size 128 --num-iters 5 \
    --num-batches-per-iter 10 > "$1/synthetic.log" 2>&1
  echo "synthetic: exit $?"; grep -a "img/sec\|Iter #" "$1/synthetic.log" | tail -8
  KERAS_BACKEND=tensorflow clean_env timeout 330 mgpu-bench --model resnet50 \
    --backend tensorflow --precision float32 --gpus 1,"$NP" --data device,host --steps 30 \
    --timeout 150 --out "$1/bench" > "$1/bench.log" 2>&1
  echo "bench: exit $?"; tail -12 "$1/bench.log"; rm -f "$1/bench/results.png"
}

run_stages "$@"
