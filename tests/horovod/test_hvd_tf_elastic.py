"""mgpu_launch.tensorflow.elastic (issue 39, item 3): a Horovod elastic custom TensorFlow loop
resumes from its last commit, its optimizer state included, and starts every rank from rank
0's variables (run()'s sync)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import elastickit
from conftest import BACKEND, ROOT, SCRIPTS, job_env, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job,
              pytest.mark.skipif(BACKEND != "tensorflow",
                                 reason="mgpu_launch.tensorflow is the TensorFlow backend's")]


def _start(state_dir, out, *extra, restarts=()):
    return elastickit.start_state_job(os.path.join(SCRIPTS, "hvd_tf_elastic.py"), state_dir,
                                      out, *extra, restarts=restarts, backend="tensorflow")


_finish = elastickit.finish_state_job


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


# -- Horovod's tensorflow2_mnist_elastic.py under mgpu-train's elastic mode ---------------------
import signal  # noqa: E402
import time  # noqa: E402

import elastickit  # noqa: E402

TF2 = os.path.join(SCRIPTS, "hvd_tf2_elastic.py")
STEPS, COMMIT_EVERY = 24, 2


def _surviving_steps(out):
    """Every step whose training survived, over the attempts (rank 0's logs): an attempt's
    steps from the one the next attempt started at on were redone by it."""
    runs = elastickit.attempts(out)
    numbers = sorted(runs)
    kept = []
    for index, attempt in enumerate(numbers):
        cut = runs[numbers[index + 1]][0]["started"] if index + 1 < len(numbers) else STEPS
        kept += [step for step in runs[attempt][0]["trained"] if step < cut]
    return kept


@pytest.mark.slow
# TensorFlowState only: the same loop with a TensorFlowKerasState (kind "keras" of the script)
# resumes through the same commit code, which the test above runs; two minutes saved in CI.
@pytest.mark.parametrize("kind", ["variables"])
def test_a_tf2_loop_survives_losing_a_host_and_getting_it_back(tmp_path, kind):
    # Two "hosts" that are both this machine (tests/launcher/test_elastic.py does the same
    # with 4 processes): killing rank 1 and dropping 127.0.0.1 from discovery is losing it.
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    script = elastickit.executable(tmp_path / "discover.sh", f"cat {hosts}")
    out, reference = tmp_path / "out", tmp_path / "reference"
    out.mkdir()
    reference.mkdir()
    env = job_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", TF2_STATE=kind,
                  TF2_STEPS=str(STEPS), TF2_COMMIT_EVERY=str(COMMIT_EVERY))
    # The uninterrupted run: one process, the same global batches.
    plain = subprocess.Popen([sys.executable, "-m", "mgpu_launcher", "-np", "1", TF2,
                              str(tmp_path / "state-ref"), str(reference)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mgpu_launcher", "-np", "2", "--min-np", "1", "--max-np", "2",
         "--host-discovery-script", script, "--blacklist-cooldown", "2", TF2,
         str(tmp_path / "state"), str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(env, MGPU_DISCOVERY_INTERVAL="0.5", TF2_STEP_SECONDS="0.5"))
    with elastickit.reaped(plain), elastickit.reaped(proc):
        elastickit.wait_for_steps(out, 0, 5, proc)  # a commit after step 4 is on disk
        os.kill(elastickit.pid_of(out, 0, 1), signal.SIGKILL)
        time.sleep(1)
        hosts.write_text("localhost:1\n")
        elastickit.wait_for_steps(out, 1, 3, proc)
        hosts.write_text("localhost:1\n127.0.0.1:1\n")
        stdout, stderr = elastickit.finish(proc, timeout=400)
        plain_out, plain_err = elastickit.finish(plain, timeout=200)
    assert plain.returncode == 0, f"{plain_out}\n{plain_err}"
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    assert elastickit.sizes(out) == [2, 1, 2], stderr
    assert ("mgpu-train: elastic: restarting with 1 processes on localhost:1 (was 2 on "
            "localhost:1,127.0.0.1:1): 127.0.0.1 failed") in stderr, stderr
    assert ("mgpu-train: elastic: 127.0.0.1 (1 slots) came; restart with 2 processes (now 1): "
            "asking the job to stop at its next backup point") in stderr, stderr
    runs = elastickit.attempts(out)
    first, shrunk, grown = (runs[a][0] for a in (0, 1, 2))
    # Each attempt started at a commit the one before it wrote, after a step it trained.
    for before, after in ((first, shrunk), (shrunk, grown)):
        assert after["started"] % COMMIT_EVERY == 0, (before, after)
        assert 0 < after["started"] <= before["trained"][-1] + 1, (before, after)
    assert shrunk["started"] >= 4 and grown["started"] > shrunk["started"], runs
    # Reset callbacks ran after each restore of a commit of another size, at the new size.
    assert [first["resets"], shrunk["resets"], grown["resets"]] == [[], [1], [2]]
    # Every step's global batch trained once in what survived, and the resized job ends where
    # the uninterrupted one does (the same batches; the sums differ in rounding only).
    assert sorted(_surviving_steps(out)) == list(range(STEPS))
    want = np.load(reference / "attempt.0.rank.0.npz")
    for rank in range(2):
        log = runs[2][rank]
        assert log["final"] == STEPS and log["iterations"] == STEPS, log
        assert not log["state_dir_left"], log
        got = np.load(out / f"attempt.2.rank.{rank}.npz")
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5)
    ranks = [np.load(out / f"attempt.2.rank.{rank}.npz") for rank in range(2)]
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key])
