#!/usr/bin/env bash
# The project's one test command (README "Quick start"; .ci/run calls exactly this).
# Installs the package with its test and backend extras into the current Python, then runs
# the suite for each Keras backend in MGPU_TEST_BACKENDS (default: every backend with an
# engine): everything under the first, then only the tests marked `backend` under the others.
# The tests marked `cluster` (root, namespaces, Slurm) are left out: scripts/test_cluster.sh
# runs them. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
backends=${MGPU_TEST_BACKENDS:-tensorflow jax torch}

extras=test
for backend in $backends; do
  case $backend in
    tensorflow) extras+=",tensorflow-cpu" ;;
    jax|torch) extras+=",$backend" ;;
    *) echo "scripts/test.sh: unknown backend '$backend' in MGPU_TEST_BACKENDS" \
            "(expected tensorflow, jax or torch)" >&2; exit 2 ;;
  esac
done
PYTHON=$python scripts/install.sh "$extras" || exit 1

status=0
select=(-m "not cluster")
for backend in $backends; do
  echo "=== KERAS_BACKEND=$backend ${select[*]}"
  KERAS_BACKEND=$backend "$python" -m pytest -q "${select[@]}" "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "(pytest collected no tests for $backend)"
  elif [ "$rc" -ne 0 ]; then
    status=$rc
  fi
  select=(-m "backend and not cluster")
done
exit $status
