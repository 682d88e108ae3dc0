"""mgpu scripts started by real torchrun, with no mgpu-train and no MPI: the torch.distributed
control plane (mgpu_launch.runtime.transport_torch).

Every test starts ``python -m torch.distributed.run --standalone`` on CPU (gloo) and bounds it
in time. The exactness cases under torchrun are in tests/test_training.py
(test_torchrun_two_processes_equal_one_process); the refusals that need no job in
tests/runtime/test_transport.py.
"""

import json
import os
import time

import pytest

from conftest import SCRIPTS, by_hand, explain, processes_mentioning, torchrun
from runtime.test_process_sets import check_static_sets

pytestmark = pytest.mark.job


def _no_rank_left(marker: str) -> None:
    """No process whose command line holds `marker` outlives the job (torchrun's own agent
    ends its workers; a second look after a moment, for one still exiting)."""
    left = processes_mentioning(marker)
    if left:
        time.sleep(5)
        left = processes_mentioning(marker)
    assert not left, left


def test_host_collectives_process_sets_and_the_timeline_over_torch_distributed(tmp_path):
    # 4 ranks: the static process sets (gloo groups of their own on the store), every host
    # collective within them and their refusals, exactly as over MPI; the timeline's clock
    # offsets go rank 0 <-> rank r over the store's point-to-point messages.
    trace = tmp_path / "trace.json"
    result = torchrun(4, os.path.join(SCRIPTS, "process_sets.py"), str(tmp_path), timeout=300,
                      MGPU_ENGINE="none", MGPU_TIMELINE=str(trace))
    assert result.returncode == 0, explain(result)
    check_static_sets([json.loads((tmp_path / f"rank.{r}.json").read_text())
                       for r in range(4)])
    events = json.loads(trace.read_text())["traceEvents"]
    assert {event["pid"] for event in events} == {0, 1, 2, 3}
    assert any(event.get("ph") == "X" for event in events)


def test_a_failing_rank_ends_the_job_and_leaves_no_process(tmp_path):
    # Rank 1 raises while rank 0 waits in the next collective: our excepthook ends rank 1,
    # torchrun's agent ends rank 0, nothing hangs.
    marker = str(tmp_path / "fail-marker")
    started = time.monotonic()
    result = torchrun(2, os.path.join(SCRIPTS, "fail.py"), "raise", "1", marker, timeout=240,
                      MGPU_ENGINE="none")
    assert result.returncode != 0, explain(result)
    assert "boom on purpose from rank 1" in result.stderr, explain(result)
    assert time.monotonic() - started < 240
    _no_rank_left(marker)


def test_tensorflow_under_torchrun_is_refused_with_the_launcher_to_use(tmp_path):
    result = torchrun(2, os.path.join(SCRIPTS, "fail.py"), "exit", "9", str(tmp_path / "x"),
                      timeout=240, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    assert result.returncode != 0, explain(result)
    assert ("torchrun started this TensorFlow job (its ranks meet over torch.distributed); "
            "on TensorFlow mgpu-launch runs over MPI only. Start it with mgpu-train -np N"
            in result.stderr), explain(result)


def test_the_stall_inspector_names_a_late_rank_over_torch_distributed(tmp_path):
    # Rank 1 sleeps 10 s in step 5's on_train_batch_end: the inspector (its address shared over
    # the store, its own authenticated sockets) warns once and the job finishes.
    result = torchrun(2, os.path.join(SCRIPTS, "faults.py"), str(tmp_path), "sleep", "5",
                      timeout=400, KERAS_BACKEND="torch", MGPU_STALL_WARNING_S="3",
                      FAULT_SLEEP_S="10", FAULT_EPOCHS="1")
    assert result.returncode == 0, explain(result)
    assert result.stderr.count("mgpu: stall: rank 1 has not entered step 6") == 1, \
        explain(result)


def test_elastic_state_resumes_from_its_commit_after_a_torchrun_restart(tmp_path):
    # hvd.elastic.ObjectState (commits on rank 0's disk, restored and synced over the plane):
    # rank 1 fails after step 5 of 10; torchrun's --max-restarts 1 starts both again, and
    # they resume from the commit after step 4 with rank 0's values.
    out = tmp_path / "out"
    out.mkdir()
    result = torchrun(2, os.path.join(SCRIPTS, "hvd_object_state.py"), str(tmp_path / "state"),
                      str(out), "4", timeout=400, options=("--max-restarts", "1"),
                      KERAS_BACKEND="torch")
    assert result.returncode == 0, explain(result)
    assert "injected fault after step 4" in result.stderr + result.stdout, explain(result)
    total = float(sum((step + 1) * 3 for step in range(10)))
    for rank in range(2):
        got = json.loads((out / f"rank.{rank}.json").read_text())
        assert got["started"] == {"step": 4, "note": "rank 0", "total": 30.0}, got
        assert got["done"] == list(range(4, 10)) and got["total"] == total, got
        assert not got["state_dir_left"], got


def test_ranks_started_by_hand_with_torchrun_s_variables_meet_at_rank_0_s_store(tmp_path):
    # A PyTorchJob's pods, or processes started by hand: torchrun's variables, no agent; rank
    # 0 serves the store itself on MASTER_ADDR:MASTER_PORT.
    def variables(rank, port):
        return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    result = by_hand(2, variables, os.path.join(SCRIPTS, "fail.py"), "exit", "9",
                     str(tmp_path / "x"), timeout=180, MGPU_ENGINE="none")
    assert result.returncode == 0, explain(result)
