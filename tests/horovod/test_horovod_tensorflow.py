"""mgpu_launch.tensorflow: horovod.tensorflow's names on a real 2-process TensorFlow job."""

import json
import os

import pytest

from conftest import BACKEND, SCRIPTS, launch_ok, requires_mpirun

if BACKEND != "tensorflow":
    # Before any TensorFlow import: TF loaded in the pytest process aborts torch's (triton's)
    # import later in the same process (seen in CI's torch phase).
    pytest.skip("horovod.tensorflow's names: TensorFlow only", allow_module_level=True)
pytestmark = [requires_mpirun, pytest.mark.job, pytest.mark.usefixtures("backend")]

EXPECTED = {  # rank -> the collectives' results, the same eagerly and inside a tf.function
    0: {"reducescatter": [[0.0, 3.0, 6.0], [9.0, 12.0, 15.0]], "reducescatter_odd": [[1.5], [1.5]],
        "alltoall": [0, 1, 10, 11], "alltoall_splits": [[0, 10, 11], [1, 2]]},
    1: {"reducescatter": [[18.0, 21.0, 24.0], [27.0, 30.0, 33.0]], "reducescatter_odd": [[1.5]],
        "alltoall": [2, 3, 12, 13], "alltoall_splits": [[1, 2, 12], [2, 1]]},
}
SAME_ON_EVERY_RANK = {
    "allreduce": [1.5, 10.0], "allreduce_sum_int": [3], "allreduce_avg_int": [2],
    "allreduce_min": [1.0], "allreduce_max": [2.0], "allreduce_scaled": [12.0],
    "allreduce_fp16": [1.0], "grouped": [[3.0], [[2.0]], [1]],
    "allgather": [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]], "allgather_int": [0, 1, 0, 1, 2],
    "broadcast": [8.0, -1.0], "sparse_values": [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]],
    "sparse_indices": [0, 1, 1],
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("hvd_tf")
    launch_ok("-np", "2", os.path.join(SCRIPTS, "hvd_tf_api.py"), str(out), timeout=300,
              KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_collectives_give_horovods_values_eagerly_and_in_a_tf_function(reports, mode):
    for rank, report in enumerate(reports):
        assert report[mode] == {**SAME_ON_EVERY_RANK, **EXPECTED[rank]}, (rank, mode)


def test_topology_queries_and_host_objects(reports):
    for rank, report in enumerate(reports):
        assert report["topology"] == [rank, 2, rank, 2, 0, 1, True, rank, 2]
        assert report["process_set"] == [2, [0, 1]]
        cuda = report["built_with_cuda"]  # tensorflow-cpu: False; tensorflow: True
        assert report["queries"] == {"mpi_built": True, "mpi_enabled": True,
                                     "gloo_built": False, "nccl_built": cuda,
                                     "cuda_built": cuda}
        assert report["broadcast_object"] == {"from": 1} and report["allgather_object"] == [0, 1]
        assert report["broadcast_variables_eager"] == [2.0, 3.0]      # rank 1's
        assert report["broadcast_variables_graph"] == [[2.0, 3.0], 0]  # rank 0's, two dtypes


def test_distributed_gradient_tape_step_equals_one_process_with_both_batches(reports):
    for report in reports:
        assert report["tape_allclose"], report["tape_max_diff"]       # rtol 1e-5


def test_local_layer_of_a_partial_tape_stays_per_rank(reports):
    kernels = [report["local_kernel"] for report in reports]
    assert kernels[0] != kernels[1]
    assert all(abs(k - 1.0) < 0.05 for k in kernels[0])   # started at 1.0 on rank 0 ...
    assert all(abs(k - 2.0) < 0.05 for k in kernels[1])   # ... and at 2.0 on rank 1


def test_unsupported_names_and_arguments_say_what_to_do(reports):
    errors = reports[0]["errors"]
    for label in ("adasum", "process_set", "groups", "sparse_min", "timeline"):
        assert errors[label][0] == "ValueError", errors[label]
    assert "Leave mark_cycles out" in errors["timeline"][1]
    assert "Adasum is not implemented" in errors["adasum"][1]
    assert errors["xla_max"][0] == "ValueError", errors["xla_max"]  # raised while tracing
    assert "a max allreduce cannot be compiled with XLA" in errors["xla_max"][1]
    assert "is not a process set: pass mgpu.global_process_set or a ProcessSet" in \
        errors["process_set"][1]
    for label in ("join",):
        kind, message = errors[label]
        assert kind == "HorovodNotSupported" and "docs/horovod-migration.md" in message
