"""The jobs of one ``mgpu-bench`` invocation: which run and in what order, their names, and one
job run: its command line (a launcher job, or the one process of the mirrored row), its
environment, and the run itself, its output to a log, under a timeout.
"""

import os
import subprocess
import sys
import threading
from typing import Dict, List, Optional

from mgpu_launch.config import devices
from mgpu_launch.runtime import folders


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
    if backend not in ("native", "mirrored"):  # mgpu's own knobs: the references have none
        worker += ["--prefetch", ",".join(map(str, args.prefetch_depths)),
                   "--cuda-graph", ",".join(args.cuda_graphs),
                   "--steps-per-execution", ",".join(map(str, args.executions)),
                   "--recorder", ",".join(args.recorders),
                   "--shard-optimizer-state", ",".join(args.shardings)]
        if args.compression != "none":
            worker += ["--compression", args.compression]
    if backend == "native":
        worker[1] = "mgpu_launch.bench.native"
    if backend == "mirrored":  # one process, not a launcher job: it replicates over N GPUs
        worker[1] = "mgpu_launch.bench.mirrored"
        return [sys.executable] + worker + ["--gpus", str(gpus)]
    return [sys.executable, "-m", "mgpu_launcher", "-np", str(gpus)] + worker


def environment(args, backend: str, gpus: int) -> Dict[str, str]:
    """One job's environment: this one, with the job's Keras backend and (--cpu) no GPU."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    if backend == "native":
        env["MGPU_ENGINE"] = "none"
    elif backend == "mirrored":
        env["KERAS_BACKEND"] = "tensorflow"
        if not args.cpu:  # the GPUs the N-process job's ranks are pinned to: the first N
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices.visible_gpus()[:gpus])
    else:
        env["KERAS_BACKEND"] = backend
    if args.cpu:
        env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    return env


def run(command, env, log_path: str, timeout: float) -> int:
    """Run one job; its output goes to the log, its progress lines to the console. A job still
    running after `timeout` seconds is killed (also one that prints nothing: a hung first step
    of a GPU job wrote no line for 570 s); returns 124 then."""
    if os.path.lexists(log_path):  # a log of an earlier call: replaced, never written through
        os.unlink(log_path)
    with folders.open_new(log_path, text=True) as log:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace",
                                   start_new_session=True)
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
        finally:
            watchdog.cancel()
        if expired.is_set():
            log.write(f"\nmgpu-bench: killed after {timeout:g} s (--timeout)\n")
            return 124
        return returncode
