"""The jobs of one ``mgpu-bench`` invocation: which run and in what order, their names, and one
job run: its command line (a launcher job, or the one process of the mirrored row), its
environment, and the run itself, its output to a log, under a timeout.

A job runs in a session of its own (its output is the bench's, not the terminal's), so nothing
sent to the bench reaches it unless the bench passes it on: Ctrl-C and SIGTERM to the bench
stop the job first (:func:`run` raises :class:`Stopped` once it is gone), and a watchdog beside
each job (``mgpu_launcher.sessions.Reaper``, the one ``mgpu-train`` keeps for its caller) ends
the job's session when the bench dies without a word (SIGKILL, an OOM kill). A job writes its
result under a name of its own bench run (:func:`result_path`): what a job of a dead run writes
late is never taken for a result of this run or reused by ``--resume``.
"""

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import threading
from typing import Dict, List, Optional

from mgpu_launch.bench import names
from mgpu_launch.config import devices
from mgpu_launch.runtime import folders
from mgpu_launcher import sessions

#: seconds a stopped job's launcher gets to end its ranks before the session is killed
STOP_GRACE = 3.0


class Stopped(Exception):
    """The bench was asked to stop (SIGINT / SIGTERM) while a job ran; the job is gone."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def result_path(logs: str, label: str, run: str) -> str:
    """Where the job `label` of the bench run `run` (its random key) writes its result: a
    hidden name of that run alone, renamed to ``<label>.json`` by the bench once it has read
    it."""
    return os.path.join(logs, f".{label}.{run}.json")


def claim_traces(fresh: str, result: str) -> None:
    """Give the traces a job wrote beside its run's result file (``--recorder on``,
    ``<stem>.timeline-<data>.json``) the job's own name, as the result itself."""
    stem, into = os.path.splitext(fresh)[0], os.path.splitext(result)[0]
    for trace in glob.glob(glob.escape(stem) + ".timeline-*.json"):
        os.replace(trace, into + trace[len(stem):])


def trace_name(path: str) -> str:
    """Where :func:`claim_traces` put the trace a job's result names as `path`."""
    folder, name = os.path.split(path)
    return os.path.join(folder, re.sub(r"^\.(.+)\.[0-9a-f]{32}(\.timeline-)", r"\1\2", name))


def stale_results(logs: str, label: str) -> List[str]:
    """Result files of `label` that jobs of earlier runs left under their run's name (a job
    still writing when its bench died): removed before the job runs again."""
    return sorted(glob.glob(os.path.join(glob.escape(logs), f".{glob.escape(label)}.*.json")))


def plan(args) -> List[tuple]:
    """Every job of the invocation: (backend, model, precision, data format, gpus), in run
    order, including those :func:`skip_reason` leaves out."""
    return [(backend, model, precision, data_format, gpus) for model in args.models
            for backend in args.backends for precision in args.precisions
            for data_format in args.data_formats for gpus in args.gpu_counts]


def skip_reason(args, backend: str, gpus: int) -> Optional[str]:
    """Why a planned job cannot run here (None when it can)."""
    if backend == "mirrored" and args.cpu and gpus > 1:
        return ("MirroredStrategy on CPU has one device to mirror over (--cpu hides the GPUs), "
                "so the mirrored row runs only at 1; run without --cpu on a machine with "
                f"{gpus} GPUs")
    return None


def job_label(backend: str, model: str, precision: str, data_format: str, gpus: int) -> str:
    """The job's name in logs/ and the header (the default channels_last is not spelled out)."""
    layout = "" if data_format == "channels_last" else f"-{data_format}"
    return f"{backend}-{model}-{precision}{layout}-np{gpus}"


def command(args, backend: str, model: str, precision: str, data_format: str, gpus: int,
            result: str) -> List[str]:
    """One job's command line: the launcher starting `gpus` ranks of the worker (the native
    reference's, for native), or the one process of the mirrored row; its result goes to
    `result`."""
    worker = ["-m", "mgpu_launch.bench.worker", "--result", result, "--model", model,
              "--precision", precision, "--data-format", data_format, "--steps", str(args.steps),
              "--warmup-steps", str(args.warmup_steps), "--window", str(args.window),
              "--data", ",".join(args.data_modes)]
    if args.batch_per_gpu:
        worker += ["--batch-per-gpu", str(args.batch_per_gpu)]
    if args.profile:
        worker.append("--profile")
    if names.compiles(backend):  # torch.compile of the step (names.py)
        worker.append("--compile")
    if backend not in ("native", "native+compile", "mirrored"):  # the references have no mgpu
        graphs = {"torch+cudagraph": ["1"], "torch+compile": ["0"]}.get(backend,
                                                                        args.cuda_graphs)
        worker += ["--prefetch", ",".join(map(str, args.prefetch_depths)),
                   "--cuda-graph", ",".join(graphs),
                   "--steps-per-execution", ",".join(map(str, args.executions)),
                   "--recorder", ",".join(args.recorders)]
        if args.compression != "none":
            worker += ["--compression", args.compression]
    if names.is_native(backend):
        worker[1] = "mgpu_launch.bench.native"
    if backend == "mirrored":  # one process, not a launcher job: it replicates over N GPUs
        worker[1] = "mgpu_launch.bench.mirrored"
        return [sys.executable] + worker + ["--gpus", str(gpus)]
    return [sys.executable, "-m", "mgpu_launcher", "-np", str(gpus)] + worker


def environment(args, backend: str, gpus: int) -> Dict[str, str]:
    """One job's environment: this one, with the job's Keras backend and (--cpu) no GPU."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    if names.is_native(backend):
        env["MGPU_ENGINE"] = "none"
    else:
        env["KERAS_BACKEND"] = names.keras_backend(backend)
    if backend == "mirrored" and not args.cpu:  # the GPUs the N-process job's ranks use
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices.visible_gpus()[:gpus])
    if args.cpu:
        env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    return env


@contextlib.contextmanager
def _stop_requests():
    """SIGINT and SIGTERM raise :class:`Stopped` here (main thread only; elsewhere the
    defaults stay)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    asked = []

    def stop(signum, frame):
        if not asked:  # a second Ctrl-C must not cut the job's teardown short
            asked.append(signum)
            raise Stopped(signum)
    before = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _end(process: subprocess.Popen) -> None:
    """End the job's session: SIGTERM to its leader (mgpu-train stops its ranks, as on
    Ctrl-C), then SIGKILL to whatever is left after :data:`STOP_GRACE` seconds."""
    try:
        os.kill(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if sessions.wait_until_gone(process.pid, STOP_GRACE):
        sessions.kill(process.pid)
        sessions.wait_until_gone(process.pid, STOP_GRACE)
    process.wait()


def run(command, env, log_path: str, timeout: float) -> int:
    """Run one job; its output goes to the log, its progress lines to the console. A job still
    running after `timeout` seconds is killed (also one that prints nothing: a hung first step
    of a GPU job wrote no line for 570 s); returns 124 then.

    Raises:
        Stopped: SIGINT or SIGTERM reached the bench (on the main thread); the job was ended
            first (within :data:`STOP_GRACE` seconds twice at most).
    """
    if os.path.lexists(log_path):  # a log of an earlier call: replaced, never written through
        os.unlink(log_path)
    with folders.open_new(log_path, text=True) as log, _stop_requests():
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace",
                                   start_new_session=True)
        reaper = sessions.Reaper(process.pid)  # ends the job if this process dies first
        expired = threading.Event()

        def kill():
            expired.set()
            try:
                os.killpg(process.pid, 9)
            except ProcessLookupError:
                pass
        watchdog = threading.Timer(timeout, kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            for line in process.stdout:
                log.write(line)
                log.flush()  # a killed job's log keeps what it printed
                if "[mgpu-bench]" in line:
                    print("    " + line.split("[mgpu-bench]", 1)[1].strip(), flush=True)
            returncode = process.wait()
        except Stopped:
            _end(process)
            log.write("\nmgpu-bench: stopped, and so was this job\n")
            raise
        finally:
            watchdog.cancel()
            reaper.release()
        if expired.is_set():
            log.write(f"\nmgpu-bench: killed after {timeout:g} s (--timeout)\n")
            return 124
        return returncode
