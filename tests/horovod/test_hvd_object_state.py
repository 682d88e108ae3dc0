"""hvd.elastic.ObjectState in a job (issue 39, item 2): run() gives every rank rank 0's values,
and a failure after a commit restarts the job from that commit's values."""

import json
import os

import pytest

import elastickit
from conftest import BACKEND, SCRIPTS, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job]


def _start(state_dir, out, *extra, restarts=()):
    return elastickit.start_state_job(os.path.join(SCRIPTS, "hvd_object_state.py"), state_dir,
                                      out, *extra, restarts=restarts, backend=BACKEND)


_finish = elastickit.finish_state_job


@pytest.mark.backend
@pytest.mark.first_backend  # plain Python values: the backend only runs the job around them
def test_a_failure_after_a_commit_resumes_from_its_values_on_every_rank(tmp_path, backend):
    reference = _start(tmp_path / "state-ref", tmp_path / "ref")
    faulty = _start(tmp_path / "state", tmp_path / "run", "4", restarts=("--max-restarts", "1"))
    (code_ref, log_ref), (code, log) = _finish(reference), _finish(faulty)
    assert code_ref == 0, log_ref
    assert code == 0, log
    assert "injected fault after step 4" in log and "restarting" in log, log
    total = float(sum((step + 1) * 3 for step in range(10)))  # ranks 0 and 1: x1 + x2
    for rank in range(2):
        want = json.loads((tmp_path / "ref" / f"rank.{rank}.json").read_text())
        got = json.loads((tmp_path / "run" / f"rank.{rank}.json").read_text())
        # Each rank declared note="rank <its rank>": run()'s sync gave both rank 0's.
        assert want["started"] == {"step": 0, "note": "rank 0", "total": 0.0}, want
        # Commits after steps 2 and 4 (1-based); the fault came after step 5.
        assert got["started"] == {"step": 4, "note": "rank 0", "total": 30.0}, got
        assert got["done"] == list(range(4, 10)), got
        for report in (want, got):
            assert report["seen"] == list(range(10)) and report["step"] == 10, report
            assert report["total"] == total and report["note"] == "rank 0", report
            assert not report["state_dir_left"], report
