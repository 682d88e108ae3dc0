#!/usr/bin/env bash
# The multi-host and Slurm tests (`pytest -m cluster`; docs/clusters.md): installs their system
# packages (scripts/install_cluster_deps.sh; root, apt), then runs every cluster test under the
# first backend of MGPU_TEST_BACKENDS and the ones also marked `backend` (the cross-node
# exactness test) under the others. Each test builds and tears down its own 2-node namespace
# cluster / local Slurm; they fail, not skip, when that is impossible. Extra arguments go to
# pytest. scripts/test.sh leaves these tests out; .ci/run runs both.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
backends=${MGPU_TEST_BACKENDS:-tensorflow jax torch}

scripts/install_cluster_deps.sh || exit 1
status=0
select=(-m cluster)
for backend in $backends; do
  echo "=== cluster tests, KERAS_BACKEND=$backend ${select[*]}"
  KERAS_BACKEND=$backend "$python" -m pytest -q "${select[@]}" "$@"
  rc=$?
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=$rc
  select=(-m "cluster and backend")
done
exit $status
