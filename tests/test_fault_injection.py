"""Fault injection: 8 jobs (``MGPU_FAULT_TRIALS``; the committed figures are of 20), each hit by
one fault at a random step; none may hang or leave a process behind.

Faults, in turn: rank 1 raises, rank 1 is SIGKILLed, mgpu-train gets SIGTERM, rank 1 stalls
(sleeps in on_train_batch_end) with ``MGPU_STALL_SHUTDOWN_S`` set. Every job must be gone —
mgpu-train exited and no process of it left (``ps``) — within 15 s of the fault (a stall:
within the shutdown time + 15 s). One backend (the suite's first), a 2x4 Dense model; two jobs
run at a time to keep CI short. ``MGPU_FAULT_TRIALS`` and ``MGPU_FAULT_SEED`` change the
number of jobs and the random steps.
"""

import concurrent.futures
import os
import random
import signal
import time

import pytest

import faultkit
from conftest import BACKEND, requires_mpirun

TRIALS = int(os.environ.get("MGPU_FAULT_TRIALS", "8"))
SEED = int(os.environ.get("MGPU_FAULT_SEED", "17"))
PARALLEL = 2
KINDS = ("raise", "kill", "sigterm", "stall")
STALL_WARNING_S, STALL_SHUTDOWN_S = 2, 4
GONE_WITHIN_S = 15
#: what faults.py does for each kind (SIGTERM: steps slow down so the signal meets a live job)
FAULT_OF = {"raise": "raise", "kill": "kill", "sigterm": "slow", "stall": "sleep"}
CAUSE_OF = {"raise": "root cause: rank 1 failed first: RuntimeError: injected fault",
            "kill": "root cause: rank 1 failed first: killed by signal 9 (SIGKILL)",
            "stall": "root cause: the job stalled: rank 1 has not entered step",
            "sigterm": "mgpu-train: got SIGTERM, stopping every rank"}


def plan():
    rng = random.Random(SEED)
    return [(KINDS[index % len(KINDS)], rng.randint(2, 24)) for index in range(TRIALS)]


def trial(directory, index, kind, step):
    """Run one job with one fault; returns what the test checks, as a dict."""
    out = os.path.join(directory, f"trial{index}")
    os.makedirs(out)
    env = {"KERAS_BACKEND": BACKEND}
    if kind == "stall":
        env.update(MGPU_STALL_WARNING_S=str(STALL_WARNING_S),
                   MGPU_STALL_SHUTDOWN_S=str(STALL_SHUTDOWN_S))
    sent = []

    def sigterm_once_running(run, proc):
        if kind == "sigterm" and not sent and run.written("reached.0.0") is not None:
            sent.append(time.time())
            proc.send_signal(signal.SIGTERM)

    started = time.time()
    run = faultkit.finish(faultkit.start(out, FAULT_OF[kind], step, **env), out, timeout=240,
                          while_running=sigterm_once_running)
    failed_at = sent[0] if sent else run.written("fault.0")
    result = {"index": index, "kind": kind, "step": step, "status": run.returncode,
              "hang": run.returncode is None, "wall_s": round(run.ended - started, 1)}
    if failed_at is None:
        result["problem"] = "the fault never happened\n" + run.explain()
        return result
    result["gone_s"] = round(faultkit.gone_at(run, out) - failed_at, 2)
    result["leftovers"] = faultkit.leftovers(out)
    limit = GONE_WITHIN_S + (STALL_SHUTDOWN_S if kind == "stall" else 0)
    expected_status = 128 + signal.SIGTERM if kind == "sigterm" else None
    problems = []
    if result["hang"]:
        problems.append("hang")
    elif expected_status is not None and run.returncode != expected_status:
        problems.append(f"exit status {run.returncode}, expected {expected_status}")
    elif run.returncode == 0:
        problems.append("exit status 0 after a fault")
    if result["gone_s"] > limit:
        problems.append(f"gone {result['gone_s']} s after the fault (limit {limit} s)")
    if result["leftovers"]:
        problems.append(f"processes left: {result['leftovers']}")
    if CAUSE_OF[kind] not in run.stderr:
        problems.append(f"no {CAUSE_OF[kind]!r} in the output")
    if problems:
        result["problem"] = "; ".join(problems) + "\n" + run.explain()
    return result


@requires_mpirun
@pytest.mark.job
@pytest.mark.slow
@pytest.mark.usefixtures("backend")
def test_random_faults_no_hang_no_orphan(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(lambda args: trial(str(tmp_path), *args),
                                [(index, kind, step) for index, (kind, step)
                                 in enumerate(plan())]))
    for result in results:
        print({key: value for key, value in result.items() if key != "problem"})
    failures = [f"trial {r['index']} ({r['kind']} at step {r['step']}): {r['problem']}"
                for r in results if "problem" in r]
    assert TRIALS > 0 and len(results) == TRIALS, f"MGPU_FAULT_TRIALS={TRIALS}: nothing was tried"
    assert not failures, "\n\n".join(failures)
