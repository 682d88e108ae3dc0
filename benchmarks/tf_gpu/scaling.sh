#!/bin/bash
# Why Keras-TF loses 9-13 ms a step at 2 GPUs (issue 38), for a machine with 2 NVIDIA GPUs.
# Prerequisites as for benchmarks/tf_gpu/session.sh (.whl carried, TensorFlow in /tmp/tfgpu).
# From the project root:
#   bash benchmarks/tf_gpu/scaling.sh STAGE...        (logs tarred into $OUT/STAGE.tgz)
# Stages:
#   allreduce  the 102 MB gradient sum alone: TF's engine under XLA and without, torch's NCCL
#              (benchmarks/tf_gpu/allreduce_probe.py), NCCL_DEBUG=INFO: which transport
#   bench      mgpu-bench TF ResNet-50 bf16, 1 and 2 GPUs, device data, --profile (the step
#              with and without its allreduce) and --recorder off,on (issue 40's cost; the on
#              row's efficiency report and trace)
#   controls   two independent 1-GPU jobs at once (GPU 0 and GPU 1): does a second TF process
#              alone slow the first (host contention), with no collective between them?
#   variants   2 GPUs only, bf16: TF_GPU_THREAD_MODE=gpu_private; XLA without command
#              buffers; XLA's latency-hiding scheduler; collectives in command buffers; an
#              optimization barrier around the gradient buffer (experiments/sitecustomize.py);
#              all-reduces kept synchronous; 1 and 2 GPUs: steps_per_execution 1,4,8,16 (spe)
#              and the per-batch logs one step late (lag_logs: Keras then no longer waits for
#              every step) (VARIANTS= picks a subset)
#   recorder   1 and 2 GPUs: --recorder off,on,off,on (issue 40's cost, alternated against drift)
#   hostprof   1 and 2 GPUs, bf16: the train function's calls timed (the batch's next() apart
#              from the compiled step's call), where each step input lives, and 10 calls under
#              TF's profiler (host, python, CUDA API; benchmarks/tf_gpu/trace_summary.py prints
#              where each thread's time goes); as is (base: int32 inputs made int64 on the GPU
#              by mgpu's prefetch thread), with int32 inputs left int32 (int32,
#              MGPU_TF_WIDEN_INT32=0), and with TF's asynchronous eager executor (async)
#              (HOSTPROF= picks a subset; each variant ~150 s)
#   widen      1 and 2 GPUs, bf16: MGPU_TF_WIDEN_INT32=0,1,0,1 (four benches alternated against
#              drift; ~130 s each: four do not fit one 570 s call on a fresh machine)
#   final      issue 38's committed invocation (tensorflow,jax,native,mirrored x float32,bf16 x
#              1,2 GPUs x device,host data, --profile; ~16 jobs, more than one call): runs for
#              FINAL_S seconds (default 520) into /tmp/final, then copies what it has; repeat the
#              call on the same warm machine until its log ends with the table (mgpu-bench
#              --resume reuses the jobs already measured)
#   hlo        2 GPUs, bf16: XLA's optimized HLO of the train step dumped; its all-reduces,
#              command buffers and async pairs counted
set -u
export PYTHONUNBUFFERED=1
. benchmarks/gpu_stages.sh || exit 1  # set-up, versions, run_stages
nvidia-smi topo -m | head -4
BENCH=(mgpu-bench --model resnet50 --backend tensorflow --precision mixed_bfloat16 --data device
       --steps "${BENCH_STEPS:-30}" --timeout 200)

summary() {  # the bench's progress lines that carry figures
  grep -aE "img/s|profile rank|efficiency of fit|throughput:|lost:|input wait|waiting|the rest|advice|FAILED" "$1" | head -40
}

stage_allreduce() {
  for backend in tensorflow torch; do
    KERAS_BACKEND=$backend NCCL_DEBUG=INFO timeout 200 mgpu-train -np 2 \
      benchmarks/tf_gpu/allreduce_probe.py "$1/allreduce_$backend.json" > "$1/allreduce_$backend.log" 2>&1
    echo "allreduce $backend: exit $?"
    grep -a "\[allreduce" "$1/allreduce_$backend.log"
    grep -aE "NCCL INFO (Channel 00|.*via|NCCL version|comm .* nRanks)" "$1/allreduce_$backend.log" | sort -u | head -8
  done
}

stage_bench() {
  "${BENCH[@]}" --gpus 1,2 --profile --recorder off,on --out "$1/bench" > "$1/bench.log" 2>&1
  echo "bench: exit $?"; summary "$1/bench.log"; rm -f "$1/bench/results.png"
}

stage_recorder() {
  "${BENCH[@]}" --gpus 1,2 --recorder off,on,off,on --out "$1/bench" > "$1/bench.log" 2>&1
  echo "recorder: exit $?"; summary "$1/bench.log"; rm -f "$1/bench/results.png"
}

stage_controls() {
  for gpu in 0 1; do
    CUDA_VISIBLE_DEVICES=$gpu "${BENCH[@]}" --gpus 1 --out "$1/alone$gpu" > "$1/alone$gpu.log" 2>&1 &
  done
  wait
  for gpu in 0 1; do echo "GPU $gpu, beside the other:"; summary "$1/alone$gpu.log"; done
}

variant() {  # name, env assignments...
  local name=$1; shift
  env "$@" "${BENCH[@]}" --gpus "${GPUS:-2}" ${EXTRA:-} --out "$work/$name" > "$work/$name.log" 2>&1
  echo "variant $name ($*): exit $?"; summary "$work/$name.log"
}

stage_variants() {
  work=$1
  for name in ${VARIANTS:-baseline gpu_private no_command_buffer lhs}; do
    case $name in
      baseline) variant baseline X=1 ;;
      gpu_private) variant gpu_private TF_GPU_THREAD_MODE=gpu_private TF_GPU_THREAD_COUNT=2 ;;
      no_command_buffer) variant no_command_buffer XLA_FLAGS=--xla_gpu_enable_command_buffer= ;;
      lhs) variant lhs XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true ;;
      cb_collectives) variant cb_collectives \
        XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES ;;
      barrier) variant barrier TFX_BARRIER=1 \
        PYTHONPATH="$PWD/benchmarks/tf_gpu/experiments:$PYTHONPATH" ;;
      sync_allreduce) variant sync_allreduce XLA_FLAGS=--xla_gpu_disable_async_collectives=ALLREDUCE ;;
      spe) GPUS=1,2 EXTRA="--steps-per-execution 1,4,8,16" variant spe X=1 ;;
      lag_logs) GPUS=1,2 variant lag_logs TFX_LAG_LOGS=1 \
        PYTHONPATH="$PWD/benchmarks/tf_gpu/experiments:$PYTHONPATH" ;;
      *) echo "unknown variant $name" ;;
    esac
  done
}

stage_hostprof() {  # where the host waits inside TF's call of the step (1 and 2 GPUs)
  local name extra
  work=$1  # variant() writes there
  for name in ${HOSTPROF:-base int32 async}; do  # benchmarks/tf_gpu/launch_research.md: A, E9
    case $name in
      base) extra=X=1 ;;
      int32) extra=MGPU_TF_WIDEN_INT32=0 ;;
      async) extra=TFX_ASYNC=1 ;;
      *) echo "unknown hostprof variant $name"; continue ;;
    esac
    GPUS=1,2 variant "$name" "$extra" TFX_HOSTPROF="$work/$name.prof" \
      PYTHONPATH="$PWD/benchmarks/tf_gpu/experiments:${PYTHONPATH:-}"
    grep -ah "\[tfx\] rank 0" "$work/$name"/logs/*.log | grep -v profile
    for trace in "$work/$name.prof"/rank0*/trace.json.gz; do
      echo "--- $trace"; python3 benchmarks/tf_gpu/trace_summary.py "$trace" --threads 6 --top 8
    done
    find "$work/$name.prof" \( -name '*.xplane.pb' -o -name '*.SSTABLE' \) -delete
  done
}

stage_widen() {  # int32 batch tensors kept (0) or made int64 on the GPU (1), alternated
  local value round=0
  work=$1
  for value in 0 1 0 1; do
    round=$((round + 1))
    GPUS=1,2 variant "widen${value}_$round" MGPU_TF_WIDEN_INT32=$value
  done
}

stage_final() {
  timeout "${FINAL_S:-520}" mgpu-bench --model resnet50 --backend tensorflow,jax,native,mirrored \
    --precision float32,mixed_bfloat16 --gpus 1,2 --data device,host --profile --steps 30 \
    --timeout 240 --resume --out /tmp/final >> /tmp/final.log 2>&1
  echo "final: exit $? (124: cut by FINAL_S; call again to resume)"
  pkill -f "mgpu_launch.bench" 2>/dev/null; sleep 2  # a cut job's ranks, if any outlived it
  grep -aE "^\[[0-9]+/|reused|img/s|FAILED|wrote" /tmp/final.log | tail -40
  cp -r /tmp/final /tmp/final.log "$1"/ 2>/dev/null; rm -f "$1/final/results.png"
}

stage_hlo() {
  XLA_FLAGS="--xla_dump_to=$1/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*one_step_on_data.*" \
    "${BENCH[@]}" --gpus 2 --steps 10 --out "$1/bench" > "$1/bench.log" 2>&1
  echo "hlo bench: exit $?"; summary "$1/bench.log"
  for f in $(ls "$1"/dump/*after_optimizations.txt 2>/dev/null | head -4); do
    echo "$(basename "$f"): $(wc -c < "$f") bytes;" \
      "all-reduce-start $(grep -c ' all-reduce-start(' "$f")," \
      "all-reduce $(grep -c ' all-reduce(' "$f")," \
      "all-reduce-done $(grep -c ' all-reduce-done(' "$f")," \
      "command_buffer $(grep -c 'command_buffer' "$f")," \
      "fusions $(grep -c ' fusion(' "$f")," \
      "custom-calls $(grep -c ' custom-call(' "$f")"
    grep -m3 -o 'all-reduce-start([^)]*)[^,]*' "$f" | cut -c1-200
  done
  find "$1/dump" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
}

run_stages "$@"
