"""Helpers of the stall, restart and fault-injection tests: run a job and watch it end.

A job runs ``tests/scripts/faults.py`` under the real ``mgpu-train`` (see that script for the
faults). The helpers time-stamp every console line, read the times the ranks wrote, and list
the processes of the job still alive afterwards (``ps``), so a test can check "gone within N
seconds of the failure, nothing left".
"""

import dataclasses
import glob
import os
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

from conftest import ROOT, SCRIPTS, job_env

FAULTS = os.path.join(SCRIPTS, "faults.py")


@dataclasses.dataclass
class Run:
    returncode: Optional[int]  # None: it hung (killed after the timeout)
    lines: List[Tuple[float, str, str]]  # (time.time(), "stdout" | "stderr", line)
    ended: float  # time.time() when mgpu-train exited (or was killed)
    out: str

    @property
    def stdout(self) -> str:
        return "\n".join(text for _, stream, text in self.lines if stream == "stdout")

    @property
    def stderr(self) -> str:
        return "\n".join(text for _, stream, text in self.lines if stream == "stderr")

    def first(self, needle: str) -> Optional[Tuple[float, str]]:
        """(time, line) of the first console line containing `needle`."""
        for when, _, text in self.lines:
            if needle in text:
                return when, text
        return None

    def written(self, name: str) -> Optional[float]:
        """The time.time() value a rank wrote into OUT/name, if it did."""
        path = os.path.join(self.out, name)
        return float(open(path).read()) if os.path.exists(path) else None

    def explain(self) -> str:
        return (f"exit {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n"
                f"--- stderr\n{self.stderr[-8000:]}")


def start(out: str, fault: str, step: int, *launcher_args: str, **env) -> subprocess.Popen:
    """Start ``mgpu-train -np 2 [launcher_args] faults.py out fault step``."""
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return subprocess.Popen(
        [sys.executable, "-m", "mgpu_launcher", "-np", "2", *launcher_args, FAULTS, out, fault,
         str(step)], cwd=ROOT, env=job_env(**env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, out: str, timeout: float,
           while_running=None) -> Run:
    """Collect a started job's output until it exits (or `timeout` s: then it is killed).

    Args:
        while_running: called every 0.1 s with the Run so far (e.g. to send a signal).
    """
    lines: List[Tuple[float, str, str]] = []

    def pump(pipe, name):
        for line in iter(pipe.readline, ""):
            lines.append((time.time(), name, line.rstrip("\n")))

    pumps = [threading.Thread(target=pump, args=(p, n), daemon=True)
             for p, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for thread in pumps:
        thread.start()
    deadline = time.monotonic() + timeout
    run = Run(None, lines, 0.0, out)
    while proc.poll() is None and time.monotonic() < deadline:
        if while_running is not None:
            while_running(run, proc)
        time.sleep(0.1)
    run.ended = time.time()
    if proc.poll() is None:  # a hang: clean up so later tests are not disturbed
        proc.kill()
        for pid in rank_pids(out):
            _kill(pid)
        proc.wait()
    else:
        run.returncode = proc.returncode
    for thread in pumps:
        thread.join(5)
    return run


def rank_pids(out: str) -> List[int]:
    """The pids every rank of every attempt wrote at its start."""
    return [int(open(path).read()) for path in glob.glob(os.path.join(out, "pid.*"))
            if ".tmp" not in os.path.basename(path)]  # faults.py writes pid.R.A.tmp<pid> first


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return False


def leftovers(out: str, wait: float = 0.0) -> List[str]:
    """``ps`` lines of processes still alive that belong to the job in `out` (after `wait` s)."""
    deadline = time.monotonic() + wait
    while True:
        listing = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True,
                                 text=True).stdout.splitlines()
        found = [line for line in listing if out in line and " Z" not in line
                 and "ps -eo" not in line]
        found += [f"{pid} (rank pid)" for pid in rank_pids(out) if alive(pid)
                  and not any(line.split()[0] == str(pid) for line in found)]
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def gone_at(run: Run, out: str, limit: float = 30.0) -> float:
    """When the job was entirely gone (time.time()): mgpu-train exited and no process of the
    job is left; infinity when something is still alive `limit` s after the exit."""
    if not leftovers(out):
        return run.ended
    return float("inf") if leftovers(out, wait=limit) else time.time()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except OSError:
        pass


def require_backend(backend: str) -> None:
    """Skip unless `backend` is installed — without importing it into the pytest process."""
    import importlib.util

    import pytest
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"KERAS_BACKEND={backend} is not installed")
