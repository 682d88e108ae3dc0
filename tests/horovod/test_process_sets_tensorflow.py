"""Process sets under mgpu_launch.tensorflow on a real 4-process TensorFlow job: every in-graph
collective within {0, 2} / {1, 3} / {0, 1, 2} (TensorFlow collective groups of their own),
eagerly and in a tf.function, and DistributedGradientTape(process_set=), exact against the
same numbers computed here by hand on each set's members."""

import json
import os

import numpy as np
import pytest

from conftest import BACKEND, SCRIPTS, launch_ok, requires_mpirun

if BACKEND != "tensorflow":
    # Before any TensorFlow import: see test_horovod_tensorflow.py.
    pytest.skip("horovod.tensorflow's names: TensorFlow only", allow_module_level=True)
pytestmark = [requires_mpirun, pytest.mark.job, pytest.mark.slow,
              pytest.mark.usefixtures("backend")]

EVEN, ODD, FIRST_THREE = [0, 2], [1, 3], [0, 1, 2]


def value(r):
    return np.array([r + 1.0, 10.0 * (r + 1), -float(r)])


def expected_collectives(ranks, rank):
    """The script's collectives() on member `rank` of `ranks`, by hand."""
    position, root = ranks.index(rank), ranks[-1]
    rows = np.arange(12.0).reshape(4, 3) * sum(r + 1 for r in ranks)
    values = np.stack([value(r) for r in ranks])
    result = {
        "sum": values.sum(0).tolist(), "global_sum": sum(value(r) for r in range(4)).tolist(),
        "average": values.mean(0).tolist(),
        "average_int": [sum(3 * r + 1 for r in ranks) // len(ranks)],
        "min": values.min(0).tolist(), "max": values.max(0).tolist(),
        "grouped": [values.sum(0).tolist(), [sum(ranks)]],
        "allgather": [[float(r)] * 2 for r in ranks for _ in range(r + 1)],
        "broadcast": value(root).tolist(),
        "reducescatter": rows[2 * position:2 * position + 2].tolist(),
        "alltoall": [int(v) for s in ranks for v in (np.arange(4) + 10 * s)[2 * position:
                                                                            2 * position + 2]],
        "sparse_values": [[r + 1.0] * 2 for r in ranks for _ in range(r + 1)],
        "sparse_indices": [r for r in ranks for _ in range(r + 1)],
    }
    if rank in FIRST_THREE:
        result["first_three"] = sum(value(r) for r in FIRST_THREE).tolist()
    return result


def gradient(r):
    """The gradient of mean((x w - y)^2) on rank r's batch at the script's w."""
    state = np.random.RandomState(r)
    x, y = state.randn(5, 3).astype(np.float32), state.randn(5, 1).astype(np.float32)
    w = np.array([[0.5], [-1.0], [2.0]], np.float32)
    return 2.0 / 5 * x.T @ (x @ w - y)


def mean_gradient(ranks):
    return np.mean([gradient(r) for r in ranks], axis=0)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("hvd_tf_sets")
    launch_ok("-np", "4", os.path.join(SCRIPTS, "hvd_tf_process_sets.py"), str(out),
              timeout=500, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_collectives_within_a_set_equal_numpy_on_its_members(reports, mode):
    for rank, report in enumerate(reports):
        mine = EVEN if rank % 2 == 0 else ODD
        assert report[mode] == expected_collectives(mine, rank), (rank, mode)


def test_set_queries_variables_and_host_objects(reports):
    for rank, report in enumerate(reports):
        mine = EVEN if rank % 2 == 0 else ODD
        assert report["ops"] == [2, 1, 0, 3, 4]
        assert report["broadcast_variables_eager"] == [mine[-1] + 1.0, mine[-1] + 2.0]
        assert report["broadcast_variables_graph"] == [mine[0] + 1.0, mine[0] + 2.0]
        assert report["objects"] == [{"from": mine[-1]}, mine]


def test_gradient_tape_averages_within_its_set_and_outside_keeps_the_local_gradient(reports):
    for rank, report in enumerate(reports):
        mine = EVEN if rank % 2 == 0 else ODD
        np.testing.assert_allclose(report["tape_mine"], mean_gradient(mine), rtol=1e-5)
        np.testing.assert_allclose(report["tape_first_three"], mean_gradient(
            FIRST_THREE if rank in FIRST_THREE else [rank]), rtol=1e-5)
        np.testing.assert_allclose(report["tape_global"], mean_gradient(range(4)), rtol=1e-5)


def test_a_rank_outside_a_set_is_refused_eagerly_and_when_traced(reports):
    for rank, report in enumerate(reports):
        other = ODD if rank % 2 == 0 else EVEN
        errors = report["errors"]
        for mode, call in (("eager", "allreduce"), ("traced", "allgather")):
            message = (f"{call}: rank {rank} is not a member of process set "
                       f"{1 if other == EVEN else 2} (ranks {other}). Only its members may "
                       f"call collectives on it: test process_set.included() first.")
            kind, text = errors[mode]
            # AutoGraph re-raises the subclasses of ValueError it does not know as StagingError
            assert kind == ("NotInProcessSetError" if mode == "eager" else "StagingError")
            assert message in text
        assert "is not a member of process set" in errors["broadcast_root"][1]
        assert "is not a registered process set" in errors["size_op"][1]
        assert "MGPU_DYNAMIC_PROCESS_SETS=1" in errors["add_static"][1]
