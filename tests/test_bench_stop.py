"""A stopped ``mgpu-bench`` stops its job (issue 58, item 2): Ctrl-C and SIGTERM are forwarded to
the job, which is gone within 5 s of the signal; after a SIGKILL of the bench a watchdog ends the
job; a result file only a live bench run may have written is ever read.

Each case starts a real job (2 CPU ranks of mlp-tiny, told to run far longer than the test) and
times from the signal, not from start-up: a loaded 2-core box starts ranks slowly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import BACKEND, ROOT, job_env, processes_mentioning, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job]
#: the issue's bound, plus room for a loaded box to notice the last process gone
LIMIT = 5.0 + 2.0


def start_bench(out):
    out.mkdir(mode=0o700)
    log = open(out / "bench.stdout", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "mgpu_launch.bench", "--cpu", "--gpus", "2", "--model",
         "mlp-tiny", "--steps", "1000000", "--window", "5", "--timeout", "600", "--out",
         str(out)], cwd=ROOT, env=job_env(KERAS_BACKEND=BACKEND), stdout=log,
        stderr=subprocess.PIPE, text=True)
    job = f"{out}/logs/"  # on the job's command lines only (the bench's says --out OUT)
    deadline = time.monotonic() + 240  # launcher, prterun, 2 ranks
    while len(processes_mentioning(job)) < 4:
        assert process.poll() is None and time.monotonic() < deadline, \
            (out / "bench.stdout").read_text() + process.stderr.read()
        time.sleep(0.2)
    return process, job


def seconds_until_gone(job, since):
    while processes_mentioning(job):
        if time.monotonic() - since > 60:
            for line in processes_mentioning(job):
                os.kill(int(line.split()[0]), signal.SIGKILL)
            return None
        time.sleep(0.05)
    return time.monotonic() - since


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_reach_the_job_and_the_bench_ends_cleanly(signum, tmp_path):
    process, job = start_bench(tmp_path / "out")
    process.send_signal(signum)
    sent = time.monotonic()
    seconds = seconds_until_gone(job, sent)
    _, stderr = process.communicate(timeout=60)
    assert seconds is not None and seconds < LIMIT, \
        f"job still there {seconds} s after {signum.name}\n{stderr}"
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and f"stopped by {signum.name}" in stderr, stderr


def test_a_killed_bench_leaves_no_job_and_no_late_result(tmp_path):
    out = tmp_path / "out"
    process, job = start_bench(out)
    process.kill()
    sent = time.monotonic()
    seconds = seconds_until_gone(job, sent)
    process.wait()
    assert seconds is not None and seconds < LIMIT, f"job still there {seconds} s after SIGKILL"
    time.sleep(1)
    assert [p.name for p in (out / "logs").glob("*.json")] == []


def test_resume_reads_no_result_a_dead_run_left(tmp_path):
    """A result under a job's name that no live run of this bench recorded is never read: the
    job writes to a name of its own run, renamed only once that run has read and recorded it."""
    from mgpu_launch.bench import jobs
    path = jobs.result_path(str(tmp_path), "torch-mlp-tiny-fp32-np2", "a" * 32)
    assert os.path.basename(path).startswith(".torch-mlp-tiny-fp32-np2.")
    assert path != jobs.result_path(str(tmp_path), "torch-mlp-tiny-fp32-np2", "b" * 32)
    late = {"rows": []}
    (tmp_path / os.path.basename(path)).write_text(json.dumps(late))  # the dead run's orphan
    assert jobs.stale_results(str(tmp_path), "torch-mlp-tiny-fp32-np2") == [path]
