"""Process sets in the runtime: the host collectives within subsets of a real 4-rank MPI job
(exact against the same numbers computed here by hand), the errors of ranks outside a set,
dynamic add / remove; and the one-process checks (no job)."""

import json
import os

import numpy as np
import pytest

import mgpu_launch as mgpu
from conftest import SCRIPTS, launch_ok, requires_mpirun

SCRIPT = os.path.join(SCRIPTS, "process_sets.py")
EVEN, ODD, FIRST_THREE = [0, 2], [1, 3], [0, 1, 2]


def value(rank):  # the script's contribution of `rank`
    return np.array([rank + 1.0, 10.0 * (rank + 1), -float(rank)])


def expected_within(ranks, rank):
    """What the script's within(set) must report on member `rank`: numpy on the members'
    values, nothing else."""
    values = np.stack([value(r) for r in ranks])
    root = ranks[-1]
    return {
        "sum": values.sum(axis=0).tolist(), "average": values.mean(axis=0).tolist(),
        "max": max(ranks),
        "gather": [[r, r] for r in ranks for _ in range(r + 1)],
        "broadcast": value(root).tolist(), "object": {"from": root},
        "objects": [r * 100 for r in ranks], "barrier": None,
        "size_rank": [len(ranks), ranks.index(rank), True],
    }


def run_job(tmp_path, **env):
    launch_ok("-np", "4", SCRIPT, str(tmp_path), MGPU_ENGINE="none", timeout=180, **env)
    return [json.loads((tmp_path / f"rank.{r}.json").read_text()) for r in range(4)]


@requires_mpirun
@pytest.mark.job
def test_host_collectives_within_static_sets_equal_numpy_on_the_members(tmp_path):
    check_static_sets(run_job(tmp_path))


def check_static_sets(reports):
    """The script's reports of a job with the static sets (MPI's here, torchrun's in
    test_transport_torch.py): each rank's results, errors included."""
    for rank, report in enumerate(reports):
        mine, other = (EVEN, ODD) if rank % 2 == 0 else (ODD, EVEN)
        assert report["before_init"] == [None, None, None, None]
        assert report["sets"] == ["ProcessSet(process_set_id=0, ranks=[0, 1, 2, 3])",
                                  "ProcessSet(process_set_id=1, ranks=[0, 2])",
                                  "ProcessSet(process_set_id=2, ranks=[1, 3])",
                                  "ProcessSet(process_set_id=3, ranks=[0, 1, 2])"]
        assert report["global"] == [4, rank, True]
        assert report["mine"] == expected_within(mine, rank), rank
        assert report["first_three"] == (expected_within(FIRST_THREE, rank)
                                         if rank in FIRST_THREE else None), rank
        assert report["global_sum"] == sum(value(r) for r in range(4)).tolist()
        errors = report["errors"]
        for call in ("allreduce", "broadcast_object", "barrier"):
            kind, message = errors[f"outside_{call.split('_')[0]}"]
            assert kind == "NotInProcessSetError", errors
            assert message.startswith(f"{call}: rank {rank} is not a member of process set "
                                      f"{1 if other == EVEN else 2} (ranks {other})")
            assert "process_set.included()" in message
        assert errors["outside_rank"][0] == "NotInProcessSetError"
        assert errors["root_outside"] == ["ValueError", (
            f"broadcast: root_rank={other[0]} is not a member of process set "
            f"{1 if mine == EVEN else 2} (ranks {mine}): root_rank is a global rank, and must "
            f"be one of the set's")]
        assert errors["mismatch"][0] == "MismatchError"
        assert f"rank {mine[0]} passed dtype=<f8, shape=({mine[0] + 1},)" in errors["mismatch"][1]
        assert "is not registered" in errors["not_registered"][1]
        assert "is not a process set" in errors["not_a_set"][1]
        assert "after the job was initialized" in errors["late_init"][1]
        assert errors["bad_ranks"][0] == "ValueError"
        for call in ("add_static", "remove_static"):   # Horovod's switch is honoured
            assert errors[call][0] == "ValueError"
            assert "MGPU_DYNAMIC_PROCESS_SETS=1" in errors[call][1]


@requires_mpirun
@pytest.mark.job
def test_dynamic_sets_are_added_used_and_removed_on_every_rank(tmp_path):
    reports = run_job(tmp_path, MGPU_DYNAMIC_PROCESS_SETS="1")
    for rank, report in enumerate(reports):
        dynamic = report["dynamic"]
        assert dynamic["added"] == "ProcessSet(process_set_id=4, ranks=[0, 1, 3])"
        assert dynamic["within"] == (expected_within([0, 1, 3], rank) if rank != 2 else None)
        assert "duplicate process set: process set 2 has the ranks [1, 3]" in \
            dynamic["duplicate"][1]
        assert "process set 0 has the ranks [0, 1, 2, 3]" in dynamic["same_as_global"][1]
        assert dynamic["mismatch"][0] == "MismatchError"  # on every rank, none left waiting
        assert dynamic["removed"] is True and dynamic["removed_twice"] is False
        assert dynamic["remove_global"] is False
        assert dynamic["after_remove"][:2] == [None, None]
        assert "is not registered (or was removed)" in dynamic["after_remove"][2][1]
        assert dynamic["again"] == [5, [0, 1, 3]]         # ids are never reused
        assert dynamic["still_even"] == sum(EVEN if rank % 2 == 0 else ODD)


# -- one process, no job ------------------------------------------------------------------------
@pytest.fixture
def fresh_runtime():
    mgpu.shutdown()
    yield
    mgpu.shutdown()


@pytest.mark.parametrize("ranks", [[], [0, 0], [-1], [0.5], "01", [True]])
def test_a_process_set_takes_distinct_ranks_only(ranks):
    with pytest.raises(ValueError, match="ProcessSet"):
        mgpu.ProcessSet(ranks)


def test_one_process_init_with_sets(fresh_runtime):
    with pytest.raises(ValueError, match="same ranks as the global process set"):
        mgpu.init(process_sets=[mgpu.ProcessSet([0])])
    mgpu.shutdown()
    with pytest.raises(ValueError, match=r"ranks \[1\] are not ranks of this job"):
        mgpu.init(process_sets=[mgpu.ProcessSet([0, 1])])
    mgpu.shutdown()
    with pytest.raises(ValueError, match="expected None, a list of mgpu.ProcessSet"):
        mgpu.init(process_sets="static")
    with pytest.raises(ValueError, match="the global process set is registered always"):
        mgpu.init(process_sets=[mgpu.global_process_set])
    mgpu.shutdown()
    with pytest.raises(ValueError, match=r"expected a list of mgpu.ProcessSet .* got \[0\]"):
        mgpu.init(process_sets=[[0]])
    mgpu.shutdown()
    mgpu.init(process_sets="dynamic")
    assert mgpu.global_process_set.ranks == [0] and mgpu.global_process_set.size() == 1
    with pytest.raises(ValueError, match="duplicate process set"):
        mgpu.add_process_set([0])
    mgpu.shutdown()
    assert mgpu.global_process_set.ranks == [] and mgpu.global_process_set.size() is None
