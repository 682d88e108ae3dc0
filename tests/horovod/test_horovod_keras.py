"""mgpu_launch.keras: Horovod's names, meanings and keyword arguments, on a real 2-process job."""

import json
import os

import pytest

from conftest import SCRIPTS, launch_ok, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job]


def test_horovod_names_work_on_two_processes(tmp_path, backend):
    launch_ok("-np", "2", os.path.join(SCRIPTS, "hvd_api.py"), str(tmp_path), timeout=180,
              KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(ranks):
        assert report["topology"] == [rank, 2, rank, 2, 0, 1, True]
        assert report["allreduce"] == 0.5                    # average of 0 and 1, float32
        assert report["allreduce_average_false"] == 3.0       # average=False is a sum
        assert report["allreduce_scaled"] == [3.0, 3.0]       # (2*1 + 2*2) * 0.5
        assert report["allgather"] == [0, 0, 1]
        assert report["broadcast"] == 8.0 and report["broadcast_object"] == {"from": 1}
        assert report["optimizer"] == ["DistributedOptimizer", "dist", "fp16", True, 2.0, 2,
                                       False]                # Horovod's default: no averaging
        assert report["lr"] == pytest.approx([0.1, 0.05])
        assert report["loaded"] == ["DistributedOptimizer", "fp16", 8]
        errors = report["errors"]
        assert sorted(errors) == ["adasum", "comm", "groups", "local_variables",
                                  "num_groups", "op_and_average", "process_set"]
        for argument in ("num_groups", "groups", "process_set", "local_variables", "comm"):
            assert errors[argument].startswith(f"{argument}="), errors[argument]
            assert "Remove" in errors[argument] or "Leave" in errors[argument] \
                or "Call hvd.init()" in errors[argument] or "pass variables" in errors[argument] \
                or "pass hvd.global_process_set or an hvd.ProcessSet" in errors[argument]
        assert "Adasum is not implemented" in errors["adasum"]
        assert report["process_set_names"] == [True] * 4   # every Horovod Keras name exists
        assert report["reducescatter"] == ([[0.0, 3.0], [6.0, 9.0]] if rank == 0
                                           else [[12.0, 15.0]])   # 3 rows: 2 + 1
        assert report["process_set"] == [2, [0, 1]]
        cuda = report["built_with_cuda"]
        assert report["queries"] == [True, True, False, cuda, False, False]
        if backend == "tensorflow":
            assert report["in_graph"] == [[1.5, 5.0], [1.0, 2.0, 5.0], [2.0, 5.0],
                                          [[3.0, 10.0]] if rank == 0 else [[3.0, 10.0]]]
        assert report["best_checkpoint"] == "best_model.keras"
    # The Keras 2 compile argument is dropped with one warning, on rank 0 only.
    assert len(ranks[0]["warnings"]) == 1 and ranks[1]["warnings"] == []
    # Gradients were averaged: both ranks end with the same weights, before and after loading.
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["loaded_weights"] == ranks[1]["loaded_weights"]
    assert ranks[0]["loss"] == ranks[1]["loss"]             # MetricAverageCallback
    # A local layer keeps per-rank weights; the shared one is averaged and starts from rank 0's.
    assert ranks[0]["partial_shared"] == ranks[1]["partial_shared"]
    assert ranks[0]["partial_head"] != ranks[1]["partial_head"]
    assert ranks[0]["partial_head_moved"] and ranks[1]["partial_head_moved"]
    assert ranks[0]["after_global_broadcast"] == ranks[1]["partial_head"]   # rank 1's
