"""Run the user's program in this process, the way ``python`` would, as one rank of a job.

A worker: reads its placement from the launcher's variables, pins its GPU, exports the MGPU_*
variables, runs the script / module / code with ``__name__ == "__main__"``, and returns
python's exit status. If the program fails on a rank that a launcher started, the worker prints
the traceback and a one-line failure marker for the supervising ``mgpu-train`` (its root cause,
also for a job of one process); in a multi-process job it then aborts the MPI job so that no
other rank stays blocked in a collective.
"""

import os
import runpy
import signal
import sys
from typing import Optional, Sequence

from mgpu_launch import backends
from mgpu_launch.config import devices, environments, markers, settings
from mgpu_launch.config.markers import (ELASTIC_VARIABLE, FAILURE_MARKER, RESIZE_SIGNAL,  # noqa: F401
                                         _resize_requested, abort_job, describe_exception)

def export_placement(placement: environments.Placement, environ=os.environ) -> None:
    """Export the placement as MGPU_* variables for the runtime and the user's code."""
    environ.update({
        "MGPU_RANK": str(placement.rank), "MGPU_SIZE": str(placement.size),
        "MGPU_LOCAL_RANK": str(placement.local_rank),
        "MGPU_LOCAL_SIZE": str(placement.local_size),
        "MGPU_ENVIRONMENT": placement.source,
    })


def pins_by_visible_devices(environ) -> bool:
    """The worker's backend's pinning rule (its facts); a backend without an engine (a script
    run with MGPU_ENGINE=none) is pinned by CUDA_VISIBLE_DEVICES, like most."""
    known = backends.BACKENDS.get(devices.keras_backend(environ))
    return known.pins_by_visible_devices if known else True


def run_target(kind: str, target: str, args: Sequence[str]) -> None:
    """Execute a script path, ``-m`` module or ``-c`` code as ``__main__`` with python's argv."""
    if kind == "script":
        sys.argv = [target, *args]
        sys.path[0:0] = [os.path.dirname(os.path.abspath(target))]
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        sys.argv = [target, *args]  # runpy replaces argv[0] with the module's file
        sys.path[0:0] = [os.getcwd()]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "code":
        sys.argv = ["-c", *args]
        sys.path[0:0] = [""]
        main = sys.modules["__main__"].__dict__
        main.update({"__name__": "__main__", "__file__": None})
        exec(compile(target, "<string>", "exec"), main)
    else:
        raise ValueError(f"unknown target kind {kind!r}; expected script, module or code")


def _exit_status(error: SystemExit) -> int:
    """The status python gives a SystemExit: None->0, int->int, anything else printed, 1."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _user_frames(tb):
    """Drop the frames of this module and runpy, so the traceback reads as python's would."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    return tb


def run(kind: str, target: str, args: Sequence[str], pin: bool = True,
        placement: Optional[environments.Placement] = None) -> int:
    """Run one rank's program; returns its exit status (or does not return: see abort_job).

    Args:
        kind: "script", "module" or "code".
        target: the script path, module name or code string.
        args: the program's arguments (``sys.argv[1:]``).
        pin: pin GPU `local_rank` to this process (see mgpu_launch.config.devices).
        placement: where this rank stands; detected from the environment when None.
    """
    placement = placement or environments.detect()
    if placement.rank == 0:  # mgpu-train checked the values; unknown names: one warning
        settings.warn_unknown(emit=lambda text: print(f"mgpu-train: warning: {text}",
                                                      file=sys.stderr, flush=True))
    export_placement(placement)
    if settings.flag(ELASTIC_VARIABLE):  # noted, acted on by BackupAndRestore
        signal.signal(RESIZE_SIGNAL, lambda *_: _resize_requested.append(True))
    if pin:
        devices.pin_gpu(placement.local_rank, placement.local_size, os.environ,
                        by_visible_devices=pins_by_visible_devices(os.environ))
    try:
        run_target(kind, target, args)
        status, reason = 0, ""
    except SystemExit as error:
        status = _exit_status(error)
        reason = f"exit code {status}"
    except BaseException as error:  # noqa: B036 - a rank must report everything, Ctrl-C too
        # With mgpu.init() done, this hook is the runtime's: it prints and aborts the job itself.
        error = error.with_traceback(_user_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        status = 130 if isinstance(error, KeyboardInterrupt) else 1
        reason = describe_exception(error, status)
    if status != 0 and placement.size > 1:
        abort_job(status, reason)
    if status != 0 and placement.source != environments.SINGLE_PROCESS.source:
        # A job of one process (an elastic job scaled down to one) has no other rank to stop,
        # but mgpu-train still reads its root cause from this line.
        print(markers.line(FAILURE_MARKER, reason), file=sys.stderr, flush=True)
    return status
