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

from mgpu_launcher import devices, environments, settings

#: Prefix of the line a failing rank prints to stderr; the supervisor looks for it.
FAILURE_MARKER = "mgpu-train: rank failure:"
#: Prefix of the line rank 0 prints when the stall inspector ends the job (``[late rank] text``).
STALL_MARKER = "mgpu-train: job stalled:"
#: Printed once (rank 0, stderr) when the first training step is done and ``MGPU_PROGRESS_MARKER``
#: is set: the supervisor then knows a failure of this attempt is worth a restart.
PROGRESS_MARKER = "mgpu-train: first step done"
#: Printed once (rank 0, stderr) when an elastic job stops at a backup point because mgpu-train
#: asked it to (to restart with another size), followed by where it stopped.
RESIZE_MARKER = "mgpu-train: stopped for a resize:"
#: Printed (rank 0, stderr) at every backup point of an elastic job, followed by the point: the
#: elastic loop tells a failure that repeats at the same point from one after progress.
BACKUP_MARKER = "mgpu-train: backup point:"
#: Set to "1" by mgpu-train's elastic mode in every rank.
ELASTIC_VARIABLE = "MGPU_ELASTIC"
#: What elastic mgpu-train sends mpirun (which forwards it to every rank) to ask for that stop.
RESIZE_SIGNAL = signal.SIGUSR1
_resize_requested = []


def resize_requested() -> bool:
    """Whether mgpu-train asked this rank (:data:`RESIZE_SIGNAL`) to stop at a backup point."""
    return bool(_resize_requested)


def export_placement(placement: environments.Placement, environ=os.environ) -> None:
    """Export the placement as MGPU_* variables for the runtime and the user's code."""
    environ.update({
        "MGPU_RANK": str(placement.rank), "MGPU_SIZE": str(placement.size),
        "MGPU_LOCAL_RANK": str(placement.local_rank),
        "MGPU_LOCAL_SIZE": str(placement.local_size),
        "MGPU_ENVIRONMENT": placement.source,
    })


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


def describe_exception(error: BaseException, status: int) -> str:
    """``Type: first line of the message (exit code N)`` — without notes (JAX adds some)."""
    lines = str(error).strip().splitlines()
    first = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return f"{first} (exit code {status})"


def abort_job(status: int, reason: str, marker: str = FAILURE_MARKER,
              rank: Optional[int] = None) -> None:
    """End this rank so the whole job ends: MPI_Abort when MPI is up, else exit hard.

    First prints the marker line (the supervisor's root cause): `marker`, then ``[rank]`` when
    the cause is another rank (the stall inspector names the late one), then `reason`. MPI_Abort
    makes mpirun kill every rank, including those blocked in a collective. Without MPI (the
    program never called ``mgpu.init()``), mpirun ends the job on our non-zero exit.
    """
    about = f" [{rank}]" if rank is not None else ""
    print(f"{marker}{about} {reason}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(status or 1)
    os._exit(status or 1)


def run(kind: str, target: str, args: Sequence[str], pin: bool = True,
        placement: Optional[environments.Placement] = None) -> int:
    """Run one rank's program; returns its exit status (or does not return: see abort_job).

    Args:
        kind: "script", "module" or "code".
        target: the script path, module name or code string.
        args: the program's arguments (``sys.argv[1:]``).
        pin: pin GPU `local_rank` to this process (see mgpu_launcher.devices).
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
        devices.pin_gpu(placement.local_rank, placement.local_size, os.environ)
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
        print(f"{FAILURE_MARKER} {reason}", file=sys.stderr, flush=True)
    return status
