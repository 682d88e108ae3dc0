"""mgpu_launch.keras.elastic: a Horovod elastic Keras script resumes from its last commit."""

import json
import os

import numpy as np
import pytest

import elastickit
from conftest import BACKEND, SCRIPTS, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job]


def _start(state_dir, out, *extra, restarts=()):
    return elastickit.start_state_job(os.path.join(SCRIPTS, "hvd_elastic.py"), state_dir,
                                      out, *extra, restarts=restarts, backend=BACKEND)


_finish = elastickit.finish_state_job


@pytest.mark.backend
def test_a_failure_after_a_commit_resumes_there_with_the_uninterrupted_weights(tmp_path, backend):
    # Both jobs at once: the box is small, and the reference needs no restart.
    reference = _start(tmp_path / "state-ref", tmp_path / "ref")
    faulty = _start(tmp_path / "state", tmp_path / "run", "1", "4",
                    restarts=("--max-restarts", "1"))
    (code_ref, log_ref), (code, log) = _finish(reference), _finish(faulty)
    assert code_ref == 0, log_ref
    assert code == 0, log
    assert "injected fault after batch 4 of epoch 1" in log and "restarting" in log, log
    # Commits after batches 2 and 4 of epoch 2 (1-based); the fault came after batch 5.
    assert "elastic: resuming at epoch 2, batch 5 from the commit in" in log, log
    for rank in range(2):
        report = json.loads((tmp_path / "run" / f"rank.{rank}.json").read_text())
        assert report["started"] == {"epoch": 1, "batch": 4, "note": "tiny"}, report
        # The restarted attempt trains the rest of epoch 1 and epoch 2 (0-based), once each.
        assert report["trained"] == [[1, b] for b in range(4, 8)] + [[2, b] for b in range(8)]
        assert report["final"] == [3, 0] and not report["state_dir_left"], report
        want = np.load(tmp_path / "ref" / f"rank.{rank}.npz")
        got = np.load(tmp_path / "run" / f"rank.{rank}.npz")
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=0)
