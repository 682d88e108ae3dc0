"""Reading tests/scripts/resize_ids.py's logs: which samples survived into the final weights.

A job that is killed, or stopped to resize, loses the steps after its last backup; the next
attempt resumes from that backup (its log names it). The samples an epoch *used* are those of
the steps that were not lost, over every attempt and rank. Also: starting and collecting the
2-process jobs of the Horovod elastic-state tests (:func:`start_state_job`).
"""

import contextlib
import json
import pathlib
import re
import signal
import stat
import subprocess
from typing import Dict, List, Tuple

_BACKUP = re.compile(r"^epoch-(\d+)(?:-batch-(\d+))?\.weights\.h5$")


def attempts(out) -> Dict[int, List[dict]]:
    """attempt number -> the logs of its ranks (rank order)."""
    found: Dict[int, Dict[int, dict]] = {}
    for path in pathlib.Path(out).glob("attempt.*.rank.*.json"):
        _, attempt, _, rank, _ = path.name.split(".")
        found.setdefault(int(attempt), {})[int(rank)] = json.loads(path.read_text())
    return {a: [ranks[r] for r in sorted(ranks)] for a, ranks in sorted(found.items())}


def resumed_from(log: dict) -> Tuple[int, int]:
    """(epochs done, batches done) of the backup an attempt resumed from; (0, 0): none."""
    names = [m for m in map(_BACKUP.match, log.get("resumed_from", [])) if m]
    if not names:
        return 0, 0
    assert len(names) == 1, log["resumed_from"]  # keep=1
    return int(names[0].group(1)), int(names[0].group(2) or 0)


def used_samples(out, epoch: int) -> List[int]:
    """Every sample id `epoch` trained on in steps that survived, over attempts and ranks."""
    runs = attempts(out)
    numbers = sorted(runs)
    used = []
    for index, attempt in enumerate(numbers):
        cut = (resumed_from(runs[numbers[index + 1]][0]) if index + 1 < len(numbers)
               else (float("inf"), 0))
        for log in runs[attempt]:
            for step_epoch, batch, ids in log["trained"]:
                if step_epoch == epoch and (step_epoch, batch) < cut:
                    used += ids
    return used


def sizes(out) -> List[int]:
    """The number of processes of each attempt, in order."""
    return [ranks[0]["size"] for _, ranks in attempts(out).items()]


def steps_done(out, attempt: int) -> int:
    """Steps rank 0 of `attempt` has logged so far (0 before its log exists)."""
    try:
        log = json.loads((pathlib.Path(out) / f"attempt.{attempt}.rank.0.json").read_text())
    except (OSError, ValueError):
        return 0
    return len(log["trained"])


def wait_for_steps(out, attempt: int, count: int, proc, timeout: float = 240) -> None:
    """Wait until `attempt` logged `count` steps; fails when `proc` (mgpu-train) ended first."""
    import time

    deadline = time.monotonic() + timeout
    while steps_done(out, attempt) < count:
        if proc.poll() is not None:
            raise AssertionError(f"mgpu-train ended (status {proc.returncode}) before attempt "
                                 f"{attempt} logged {count} steps:\n{proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"attempt {attempt} did not log {count} steps in {timeout} s")
        time.sleep(0.2)


def pid_of(out, attempt: int, rank: int) -> int:
    return int((pathlib.Path(out) / f"pid.{attempt}.{rank}").read_text())


def executable(path, body: str) -> str:
    """Write a ``/bin/sh`` script (a discovery script) to `path`, executable; its path."""
    path = pathlib.Path(path)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def finish(proc, timeout: float):
    """mgpu-train's (stdout, stderr) once it ends; past `timeout`, stop it and fail."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # mgpu-train stops every rank
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"mgpu-train did not finish in {timeout} s:\n{out}\n{err}")


@contextlib.contextmanager
def reaped(proc):
    """Kill mgpu-train if the block is left while it still runs (a wait that failed)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def start_state_job(script: str, state_dir, out, *extra: str, restarts=(), backend: str):
    """Start ``mgpu-train [restarts] -np 2 SCRIPT STATE_DIR OUT EXTRA...`` (a Horovod elastic
    state test: tests/scripts/hvd_*elastic*.py, hvd_object_state.py) without waiting.

    Returns:
        The Popen (text pipes); :func:`finish_state_job` collects it.

    Example:
        >>> job = start_state_job(SCRIPT, tmp / "state", tmp / "run", "4",
        ...                       restarts=("--max-restarts", "1"), backend="tensorflow")
    """
    import os
    import sys

    from conftest import ROOT, job_env
    os.makedirs(out)
    argv = [sys.executable, "-m", "mgpu_launcher", *restarts, "-np", "2", script,
            str(state_dir), str(out), *extra]
    return subprocess.Popen(argv, cwd=ROOT, env=job_env(KERAS_BACKEND=backend,
                                                        TF_CPP_MIN_LOG_LEVEL="2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_state_job(process, timeout: float = 240) -> Tuple[int, str]:
    """Wait for a :func:`start_state_job` job; returns (exit code, its output for messages)."""
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, f"exit {process.returncode}\n{stdout}\n{stderr}"


def start_resize_job(tmp_path, hosts_file, *argv: str, samples: int = 64, **env):
    """Start ``mgpu-train ARGV --host-discovery-script S resize_ids.py ...`` in elastic mode,
    S printing `hosts_file`'s lines; returns (the Popen, the folder of its logs).

    Example:
        >>> proc, out = start_resize_job(tmp, hosts, "-np", "2", "--min-np", "1", **ENV)
    """
    import os
    import sys

    from conftest import ROOT, SCRIPTS, job_env
    script = executable(tmp_path / "discover.sh", f"cat {hosts_file}")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mgpu_launcher", *argv, "--host-discovery-script", script,
         os.path.join(SCRIPTS, "resize_ids.py"), str(tmp_path / "backup"), str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=job_env(**{"MGPU_DISCOVERY_INTERVAL": "0.5", "RESIZE_STEP_SECONDS": "0.5",
                       "RESIZE_SAMPLES": str(samples), **env}))
    return proc, out


def nothing_left(out) -> None:
    """Fail when a process of the job (its command line names `out`) is still alive."""
    from conftest import processes_mentioning
    left = processes_mentioning(str(out))
    assert not left, f"processes of the job still alive: {left}"
