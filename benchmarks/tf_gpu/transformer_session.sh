#!/bin/bash
# Issue 63's first "must hold": does the packed TF stack (../shared/gpu/pack-tf.sh: CUDA 12 TF on
# the CUDA 13 image) train a keras-hub GPT-2 as TF does on the CPU? Prerequisites as for
# benchmarks/tf_gpu/session.sh (.whl carried, with keras-hub, kagglehub and kagglesdk added to
# fetch-wheels.sh's list; .tfgpu copied to /tmp/tfgpu). From the project root:
#   bash benchmarks/tf_gpu/transformer_session.sh STAGE...    (logs tarred into $OUT/STAGE.tgz)
# Stages:
#   steps    transformer_check.py, GPT-2-small-shaped, float32 with TF32 off: TF on the CPU
#            writes the reference (initial weights, batches, every layer's output, every
#            gradient, 20 AdamW losses); TF, JAX and torch on the GPU compare with it; then
#            mixed_bfloat16 (TF CPU reference, TF and JAX on the GPU: losses)
#   example  examples/keras_hub_causal_lm.py --size small, 2 epochs, under mgpu-train -np 1:
#            TF on the GPU, TF on the CPU, JAX on the GPU (the run that first showed TF at 2.21)
set -u
export PYTHONUNBUFFERED=1 NVIDIA_TF32_OVERRIDE=0 JAX_DEFAULT_MATMUL_PRECISION=highest
. benchmarks/gpu_stages.sh || exit 1

check() {  # check LOG BACKEND DEVICES ARGS...
  local log=$1 backend=$2 devices=$3; shift 3
  CUDA_VISIBLE_DEVICES=$devices KERAS_BACKEND=$backend timeout 280 \
    python3 benchmarks/tf_gpu/transformer_check.py "$@" > "$log" 2>&1
  echo "$(basename "$log" .log): exit $?"; grep -a '^{' "$log" | tail -1
}

stage_steps() {
  check "$1/tf_cpu_fp32.log" tensorflow -1 --save "$1/ref_fp32.npz"
  check "$1/tf_gpu_fp32.log" tensorflow 0 --compare "$1/ref_fp32.npz"
  check "$1/jax_gpu_fp32.log" jax 0 --compare "$1/ref_fp32.npz"
  check "$1/torch_gpu_fp32.log" torch 0 --compare "$1/ref_fp32.npz"
  check "$1/tf_cpu_bf16.log" tensorflow -1 --precision mixed_bfloat16 --steps 10 --save "$1/ref_bf16.npz"
  check "$1/tf_gpu_bf16.log" tensorflow 0 --precision mixed_bfloat16 --steps 10 --compare "$1/ref_bf16.npz"
  check "$1/jax_gpu_bf16.log" jax 0 --precision mixed_bfloat16 --steps 10 --compare "$1/ref_bf16.npz"
  rm -f "$1"/*.npz
}

stage_example() {
  local name backend devices
  for name in tf_gpu:tensorflow:0 jax_gpu:jax:0 tf_cpu:tensorflow:-1; do
    IFS=: read -r name backend devices <<< "$name"
    CUDA_VISIBLE_DEVICES=$devices KERAS_BACKEND=$backend timeout 250 mgpu-train -np 1 \
      examples/keras_hub_causal_lm.py --size small --epochs 2 > "$1/example_$name.log" 2>&1
    echo "example $name: exit $? $(grep -aoE 'loss: [0-9.]+' "$1/example_$name.log" | tail -1)"
  done
}

run_stages "$@"
