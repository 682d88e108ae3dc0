#!/bin/bash
# Issue 63's one-H200 invocations, one stage per device call (each planned for < 9 minutes),
# from the project root on the GPU machine, with .whl (keras, keras-hub and their wheels) and
# TensorFlow's pack set up as ../shared/gpu/README.md says:
#     bash benchmarks/transformers/session.sh gpt2|bert|resnet50 [more mgpu-bench options]
# Each stage is ONE mgpu-bench invocation (rows compared only inside it), under `timeout 540`
# so the device call returns what was measured; a stage cut short is finished by the same
# stage with --resume in the next call while /tmp/<stage> is still there (the machine stays
# warm between calls); a job killed at --timeout 300 gets more with `--resume --timeout 520`
# (--timeout is not compared by --resume). Results land in $OUT as <stage>.md / <stage>.json
# with every job's log.
set -u
stage=$1
shift
more=("$@")
bash /tmp/tfgpu/setup.sh && . benchmarks/gpu_setup.sh && . /tmp/tfgpu/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, keras, keras_hub, jax, tensorflow as tf; print('torch', torch.__version__, 'keras', keras.__version__, 'keras-hub', keras_hub.__version__, 'jax', jax.__version__, 'tf', tf.__version__)"
run() {  # name, then mgpu-bench arguments
  local name=$1; shift
  echo "=== $name: mgpu-bench $* ${more[*]}"
  timeout 540 mgpu-bench --gpus 1 --precision mixed_bfloat16 --timeout 300 --out "/tmp/$name" \
    "$@" "${more[@]}" 2>&1 | grep -v "^\[[0-9]\]" | tail -40
  cp "/tmp/$name/results.md" "$OUT/$name.md" 2>/dev/null
  cp "/tmp/$name/results.json" "$OUT/$name.json" 2>/dev/null
  mkdir -p "$OUT/${name}_logs" && cp /tmp/$name/logs/*.log "$OUT/${name}_logs/" 2>/dev/null
}
case $stage in
  gpt2)
    run gpt2 --model gpt2-small-lm --data device,recipe \
      --backend native,native+compile,jax,tensorflow,torch,torch+compile
    ;;
  bert)
    run bert --model bert-base-classifier --data device,recipe \
      --backend native,native+compile,jax,tensorflow,torch,torch+compile
    ;;
  resnet50)
    run resnet50 --model resnet50 --data device \
      --backend native,native+compile,torch+cudagraph,torch,jax,tensorflow
    ;;
  *)
    echo "usage: session.sh gpt2|bert|resnet50 [--resume] [--timeout SECONDS]" >&2; exit 2
    ;;
esac
