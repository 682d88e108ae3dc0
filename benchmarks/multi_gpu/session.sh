#!/bin/bash
# Correctness on a machine with 2+ NVIDIA GPUs, one GPU per rank (issue 36): the exactness matrix
# for every backend through NCCL, and the TensorFlow paths that only a GPU machine shows (XLA is
# Keras's default "auto" on GPUs). Prerequisites as for benchmarks/tf_gpu/session.sh: .whl
# carried (../shared/gpu/fetch-wheels.sh), TensorFlow unpacked in /tmp/tfgpu from
# ../shared/gpu/pack-tf.sh's chunks. From the project root:
#   bash benchmarks/multi_gpu/session.sh STAGE...     (logs tarred into $OUT/STAGE.tgz)
# Stages:
#   tf_matrix     tests/test_exactness_matrix.py two-process cases (Embedding, transformer, LSTM,
#                 mixed precision, SyncBN ...) plus the forced fixed-size sparse gather, TF
#   jax_matrix    the same two-process cases, JAX
#   torch_matrix  the same two-process cases, torch
#   tf_paths      digits on 2 GPUs, the DistributedGradientTape example, SyncBatchNormalization,
#                 fp16 / bf16 wire compression (tests/test_training.py -k compression)
# Every stage turns TF32 off (EXACTNESS_FP32=1 in the worker, NVIDIA_TF32_OVERRIDE=0 for
# cuBLAS, JAX_DEFAULT_MATMUL_PRECISION=highest): with TF32 the ranks' and the reference's sums
# differ by ~1e-3 relative on Ampere/Hopper; and asks for deterministic kernels (TF's op
# determinism in the worker, XLA's --xla_gpu_deterministic_ops for JAX): atomics in XLA's GPU
# scatter-add and reductions made two ranks' weights differ in the last bit (first 2-GPU run).
set -u
export PYTHONUNBUFFERED=1 EXACTNESS_FP32=1 NVIDIA_TF32_OVERRIDE=0 \
       JAX_DEFAULT_MATMUL_PRECISION=highest TF_CPP_MIN_LOG_LEVEL=2 \
       XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"
. benchmarks/gpu_stages.sh || exit 1  # set-up, versions, run_stages
nvidia-smi topo -m | head -4

matrix() {  # backend, pytest -k expression, log folder
  KERAS_BACKEND=$1 timeout "${MATRIX_TIMEOUT:-560}" python3 -m pytest -v -p no:cacheprovider \
    tests/test_exactness_matrix.py -k "$2" > "$3/matrix_$1.log" 2>&1
  echo "matrix $1: exit $?"; grep -E "passed|failed|error" "$3/matrix_$1.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$3/matrix_$1.log" | head -20
}
stage_tf_matrix() { matrix tensorflow "${TF_K:-two_processes or xla_compatible}" "$1"; }
stage_jax_matrix() { matrix jax "two_processes" "$1"; }
stage_torch_matrix() { matrix torch "two_processes" "$1"; }

stage_tf_paths() {
  export KERAS_BACKEND=tensorflow
  timeout 200 mgpu-train -np 2 examples/keras_digits.py > "$1/digits.log" 2>&1
  echo "digits -np 2: exit $?"; grep -a "final validation accuracy" "$1/digits.log"
  timeout 200 mgpu-train -np 2 examples/tensorflow_custom_loop.py > "$1/custom_loop.log" 2>&1
  echo "tensorflow_custom_loop -np 2: exit $?"; tail -3 "$1/custom_loop.log"
  timeout 300 python3 -m pytest -v -p no:cacheprovider tests/training/test_sync_batchnorm.py \
    "tests/test_training.py" -k "sync or compression or wire" > "$1/paths.log" 2>&1
  echo "sync BN + compression tests: exit $?"; grep -E "passed|failed" "$1/paths.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$1/paths.log" | head -20
}

run_stages "$@"
