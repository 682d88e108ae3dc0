# Sourced by the GPU session scripts (benchmarks/tf_gpu/session.sh, benchmarks/multi_gpu/
# session.sh) on the GPU machine, from the project root: TensorFlow from /tmp/tfgpu (unpacked
# on first use), the carried wheels and the project (benchmarks/gpu_setup.sh), the machine and
# versions printed; then `run_stages STAGE...` runs each script's stage_<name> functions, each
# in a folder of its own that is tarred into $OUT/<name>.tgz.
[ -d /tmp/tfgpu/root/site/tensorflow ] || bash /tmp/tfgpu/setup.sh || return 1
. benchmarks/gpu_setup.sh || return 1
. /tmp/tfgpu/env.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import tensorflow as tf, jax, torch, keras; print('tensorflow', tf.__version__, \
'jax', jax.__version__, 'torch', torch.__version__, 'keras', keras.__version__)" 2>/dev/null

run_stages() {
  local stage work start
  for stage in "$@"; do
    work=$(mktemp -d); start=$SECONDS
    echo "=== $stage"
    "stage_$stage" "$work"
    echo "=== $stage: $((SECONDS - start)) s"
    tar -C "$work" -czf "$out/$stage.tgz" . && rm -rf "$work"
  done
  date -u
}
