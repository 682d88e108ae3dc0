#!/usr/bin/env bash
# The project's one test command (README "Quick start"; .ci/run calls exactly this).
# Installs the package with its test and backend extras into the current Python, then runs
# the suite for each Keras backend in MGPU_TEST_BACKENDS (default: every backend with an
# engine): everything under the first, then only the tests marked `backend` under the others,
# less those also marked `first_backend` (slow tests whose backend path a faster test covers
# under every backend; MGPU_TEST_EVERY_BACKEND=1 runs them under each, about 15 more minutes).
# The tests marked `cluster` (root, namespaces, Slurm) are left out: scripts/test_cluster.sh
# runs them. Each pass runs MGPU_TEST_WORKERS test files at once (pytest-xdist; default 2: a
# test's ranks leave half of a 2-core box idle while they start and wait; 0 runs them one at a
# time). Times of the whole run: benchmarks/test_times.md. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
backends=${MGPU_TEST_BACKENDS:-tensorflow jax torch}
workers=${MGPU_TEST_WORKERS:-2}
case $workers in
  ''|*[!0-9]*) echo "scripts/test.sh: MGPU_TEST_WORKERS='$workers' is not a number of" \
                    "test processes (expected 0 for one at a time, or 1, 2, ...)" >&2; exit 2 ;;
esac
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers" --dist loadfile)

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
  KERAS_BACKEND=$backend "$python" -m pytest -q "${parallel[@]}" "${select[@]}" "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "(pytest collected no tests for $backend)"
  elif [ "$rc" -ne 0 ]; then
    status=$rc
  fi
  if [ "${MGPU_TEST_EVERY_BACKEND:-0}" = 1 ]; then
    select=(-m "backend and not cluster")
  else
    select=(-m "backend and not first_backend and not cluster")
  fi
done
exit $status
