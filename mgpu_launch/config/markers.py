"""The lines a rank prints for its launcher, and how a rank ends the whole job.

The supervising ``mgpu-train`` (``mgpu_launcher.relay``) reads these markers in the ranks'
stderr: the root cause of a failure, a stall the inspector ended, the first step done, an
elastic stop for a resize, a backup point. The library prints them (runtime, training); the
launcher reads them; both import them from here, below both.
"""

import os
import signal
import sys
from typing import Optional

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
#: Set by mgpu-train in every rank of a job: a random key, written in front of every marker line
#: (:func:`line`), so that only the job's own marker lines are read as markers, never a rank's
#: text that happens to hold a marker string.
KEY_VARIABLE = "MGPU_MARKER_KEY"
#: Set to "1" by mgpu-train's elastic mode in every rank.
ELASTIC_VARIABLE = "MGPU_ELASTIC"
#: What elastic mgpu-train sends mpirun (which forwards it to every rank) to ask for that stop.
RESIZE_SIGNAL = signal.SIGUSR1
_resize_requested = []


def resize_requested() -> bool:
    """Whether mgpu-train asked this rank (:data:`RESIZE_SIGNAL`) to stop at a backup point."""
    return bool(_resize_requested)



def line(marker: str, text: str = "") -> str:
    """The marker line to print: ``KEY:marker text`` under mgpu-train (:data:`KEY_VARIABLE`),
    ``marker text`` elsewhere (nobody reads it then).

    The launcher (mgpu_launcher.relay) reads a line as a marker only when it carries its job's
    key, and shows it without the key.
    """
    key = os.environ.get(KEY_VARIABLE, "")
    return f"{key + ':' if key else ''}{marker}{' ' + text if text else ''}"


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
    about = f"[{rank}] " if rank is not None else ""
    print(line(marker, f"{about}{reason}"), file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(status or 1)
    os._exit(status or 1)
