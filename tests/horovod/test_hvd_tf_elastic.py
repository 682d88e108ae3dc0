"""mgpu_launch.tensorflow.elastic (issue 39, item 3): a Horovod elastic custom TensorFlow loop
resumes from its last commit, its optimizer state included, and starts every rank from rank
0's variables (run()'s sync)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import BACKEND, ROOT, SCRIPTS, job_env, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job,
              pytest.mark.skipif(BACKEND != "tensorflow",
                                 reason="mgpu_launch.tensorflow is the TensorFlow backend's")]


def _start(state_dir, out, *extra, restarts=()):
    os.makedirs(out)
    argv = [sys.executable, "-m", "mgpu_launcher", *restarts, "-np", "2",
            os.path.join(SCRIPTS, "hvd_tf_elastic.py"), str(state_dir), str(out), *extra]
    return subprocess.Popen(argv, cwd=ROOT, env=job_env(KERAS_BACKEND="tensorflow",
                                                        TF_CPP_MIN_LOG_LEVEL="2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process):
    stdout, stderr = process.communicate(timeout=240)
    return process.returncode, f"exit {process.returncode}\n{stdout}\n{stderr}"


def test_a_custom_loop_resumes_from_its_last_commit_with_the_uninterrupted_weights(tmp_path):
    reference = _start(tmp_path / "state-ref", tmp_path / "ref")
    faulty = _start(tmp_path / "state", tmp_path / "run", "4", restarts=("--max-restarts", "1"))
    (code_ref, log_ref), (code, log) = _finish(reference), _finish(faulty)
    assert code_ref == 0, log_ref
    assert code == 0, log
    assert "injected fault after batch 4" in log and "restarting" in log, log
    weights = []
    for rank in range(2):
        report = json.loads((tmp_path / "run" / f"rank.{rank}.json").read_text())
        # Commits after batches 2 and 4 (1-based); the fault came after batch 5.
        assert report["started"] == {"batch": 4, "note": "tf"}, report
        assert report["trained"] == list(range(4, 12)), report
        assert report["final"] == 12 and report["iterations"] == 12, report
        assert not report["state_dir_left"], report
        want = np.load(tmp_path / "ref" / f"rank.{rank}.npz")
        got = np.load(tmp_path / "run" / f"rank.{rank}.npz")
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=0)
        weights.append([want[key] for key in want])
    # Each rank built its model from its own seed: run() gave them rank 0's.
    for a, b in zip(*weights, strict=True):
        np.testing.assert_array_equal(a, b)
