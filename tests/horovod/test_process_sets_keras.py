"""Process sets under mgpu_launch.keras on a real 4-process job of the backend under test:
sets added after init() (HOROVOD_DYNAMIC_PROCESS_SETS=1), the host collectives within them,
and DistributedOptimizer(process_set=) in `fit`, replayed here by hand: SGD on the average of
the set's members' gradients from the set's first rank's weights; a rank outside the set
trains on its own gradients from its own weights. The JAX engine refuses a set, saying why."""

import json
import os

import numpy as np
import pytest

from conftest import SCRIPTS, launch_ok, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job, pytest.mark.backend, pytest.mark.slow]

EVEN, ODD, FIRST_THREE = [0, 2], [1, 3], [0, 1, 2]


def batches(r):
    state = np.random.RandomState(r)
    return state.randn(10, 3).astype("float32"), state.randn(10, 1).astype("float32")


def replay_fit(ranks):
    """Two SGD(0.1) steps of batches of 5 on mse, gradients averaged over `ranks`, from the
    kernel of `ranks[0]` (rank + 1 everywhere)."""
    w = np.full((3, 1), ranks[0] + 1.0)
    for step in range(2):
        grads = []
        for r in ranks:
            x, y = (a[5 * step:5 * step + 5].astype(np.float64) for a in batches(r))
            grads.append(2.0 / 5 * x.T @ (x @ w - y))
        w = w - 0.1 * np.mean(grads, axis=0)
    return w


def test_sets_added_later_host_collectives_and_optimizer_within_a_set(tmp_path, backend):
    launch_ok("-np", "4", os.path.join(SCRIPTS, "hvd_keras_process_sets.py"), str(tmp_path),
              timeout=500, KERAS_BACKEND=backend, HOROVOD_DYNAMIC_PROCESS_SETS="1",
              TF_CPP_MIN_LOG_LEVEL="2")
    for rank in range(4):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        mine = EVEN if rank % 2 == 0 else ODD
        assert report["ids"] == [1, 2, 3]
        assert report["allreduce"] == [sum(r + 1.0 for r in mine), -float(sum(mine))]
        assert report["average"] == [np.mean([r + 1.0 for r in mine])]
        assert report["allgather"] == [r for r in mine for _ in range(2)]
        assert report["broadcast"] == [mine[-1] * 10.0]
        assert report["reducescatter"] == [[sum(r + 1.0 for r in mine)]] * 2
        assert report["broadcast_object"] == mine[-1]
        if backend == "jax":
            assert report["fit_error"].startswith(
                "DistributedOptimizer(process_set=...): the jax engine cannot reduce within "
                f"process set {1 if mine == EVEN else 2} (every process runs one program")
            continue
        np.testing.assert_allclose(report["fit_mine"], replay_fit(mine), rtol=1e-5)
        np.testing.assert_allclose(report["fit_first_three"], replay_fit(
            FIRST_THREE if rank in FIRST_THREE else [rank]), rtol=1e-5)
        assert report["removed"] is True
