"""What ``optimizer.iterations`` counts with ``backward_passes_per_step > 1`` (issue 39, item 1).

Under Horovod's names (``mgpu_launch.keras`` / ``mgpu_launch.tensorflow``) it counts backward
passes, as Horovod's does (``iterations == step + 1`` after every pass);
``mgpu.DistributedOptimizer`` keeps Keras's ``gradient_accumulation_steps`` convention (it
counts updates). Either way the updates, the schedule's rate, the LR warm-up and a resume from
a backup are the same.
"""

import json
import os

import numpy as np
import pytest

from conftest import SCRIPTS, launch_ok, requires_mpirun


def _apply_passes(optimizer, passes):
    """`passes` gradients of ones applied one by one; (iterations, value) after each."""
    import keras

    variable = keras.Variable(np.ones(2, "float32"))
    seen = []
    for _ in range(passes):
        optimizer.apply([keras.ops.ones(2)], [variable])
        seen.append((int(keras.ops.convert_to_numpy(optimizer.iterations)),
                     float(keras.ops.convert_to_numpy(variable)[0])))
    return seen


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("namespace", ["mgpu_launch.keras", "mgpu_launch.tensorflow"])
def test_horovods_names_count_every_backward_pass(namespace):
    import importlib

    import keras

    if namespace == "mgpu_launch.tensorflow" and keras.backend.backend() != "tensorflow":
        pytest.skip("mgpu_launch.tensorflow is the TensorFlow backend's")
    hvd = importlib.import_module(namespace)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    # Horovod: iterations == step + 1 after every pass; the update (0.1 x the sum of 2 ones)
    # at every second pass.
    assert _apply_passes(optimizer, 4) == [(1, 1.0), (2, pytest.approx(0.8)),
                                           (3, pytest.approx(0.8)), (4, pytest.approx(0.6))]


@pytest.mark.usefixtures("backend")
def test_mgpu_distributed_optimizer_counts_updates_as_keras():
    import keras

    import mgpu_launch as mgpu

    optimizer = mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                          average_aggregated_gradients=False)
    assert _apply_passes(optimizer, 4) == [(0, 1.0), (1, pytest.approx(0.8)),
                                           (1, pytest.approx(0.8)), (2, pytest.approx(0.6))]
    with pytest.raises(ValueError, match=r"iterations_count='steps': expected 'updates'"):
        mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1), iterations_count="steps")


@pytest.mark.usefixtures("backend")
def test_horovod_counting_keeps_the_windows_where_iterations_has_them():
    # A backup holds iterations but not a partial window: restored at 3 passes, the next pass
    # is a window's last (as in the uninterrupted run), so it updates.
    import keras

    import mgpu_launch.keras as hvd

    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer.build([variable])
    optimizer.iterations.assign(3)
    optimizer.apply([keras.ops.ones(2)], [variable])
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 4
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), [0.9, 0.9], rtol=1e-6)


@requires_mpirun
@pytest.mark.job
def test_both_conventions_on_two_processes_with_a_schedule_warmup_and_resume(tmp_path, backend):
    launch_ok("-np", "2", os.path.join(SCRIPTS, "hvd_iterations.py"), str(tmp_path),
              timeout=300, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    for rank in range(2):
        report = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        horovod, ours = report["horovod"], report["mgpu"]
        assert horovod["iterations"] == list(range(1, 9)), horovod["iterations"]
        assert ours["iterations"] == [0, 1, 1, 2, 2, 3, 3, 4], ours["iterations"]
        # The same updates at the same rates: the schedule saw the passes in both.
        for a, b in zip(horovod["weights"], ours["weights"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert horovod["lr"] == pytest.approx(ours["lr"], rel=1e-6)
        assert horovod["lr"] == pytest.approx(0.1 * 0.9 ** 8, rel=1e-5)   # warm-up over
        # Resumed from the epoch-1 backup: counting goes on from 4 passes, weights as if
        # uninterrupted.
        assert report["first"]["iterations"] == [1, 2, 3, 4]
        resumed = report["resumed"]
        assert resumed["iterations"] == [5, 6, 7, 8], resumed["iterations"]
        for a, b in zip(resumed["weights"], horovod["weights"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert resumed["lr"] == pytest.approx(horovod["lr"], rel=1e-6)
