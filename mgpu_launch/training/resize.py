"""Stopping an elastic job at a backup point, every rank at the same step, to resize it.

``mgpu-train --host-discovery-script`` (mgpu_launcher.elastic) runs every rank with
``MGPU_ELASTIC=1``; when discovery offers more slots (or a host of the job leaves it) it sends
mpirun ``SIGUSR1``, which mpirun forwards to every rank, where mgpu_launcher.worker notes it (mgpu_launch.config.markers.resize_requested).
The ranks receive it at different moments, so at each backup point of
``callbacks.BackupAndRestore`` (after rank 0 wrote the backup) every rank calls
:func:`stop_here_if_asked`: one allgather decides for all, and when any rank was asked, every
rank leaves ``fit`` there — rank 0 first prints ``mgpu_launch.config.markers.RESIZE_MARKER`` with the
position — and exits with status 0. mgpu-train then starts the job again with the new size,
and BackupAndRestore resumes it from that backup.

At every backup point of an elastic job rank 0 also prints ``mgpu_launch.config.markers.BACKUP_MARKER``
with the position (mgpu-train keeps it from the console): when two attempts in a row fail with
the same error at the same point, mgpu-train stops restarting (mgpu_launcher.elastic).
"""

import sys

from mgpu_launch import runtime
from mgpu_launch.runtime import collectives
from mgpu_launch.config import markers
from mgpu_launch.config import settings


def elastic() -> bool:
    """Whether this process is a rank of an elastic mgpu-train job."""
    return settings.flag(markers.ELASTIC_VARIABLE)


def stop_here_if_asked(where: str) -> None:
    """At a backup point: end every rank's program together if mgpu-train asked any rank to.

    Call it on every rank at the same point (a collective runs). Outside an elastic job it
    does nothing and costs nothing; in one, rank 0 first reports the point to mgpu-train.

    Args:
        where: the backup point, in words (rank 0 prints it for mgpu-train).

    Raises:
        SystemExit: status 0, on every rank, when the job is to stop here.
    """
    if not elastic():
        return
    if runtime.state.rank == 0:  # mgpu-train tells a failure repeated here from a later one
        print(markers.line(markers.BACKUP_MARKER, where), file=sys.stderr, flush=True)
    asked = markers.resize_requested()
    if runtime.is_multi_process():
        asked = any(collectives.allgather_object(asked))
    if not asked:
        return
    if runtime.state.rank == 0:
        print(markers.line(markers.RESIZE_MARKER, where), file=sys.stderr, flush=True)
    sys.stdout.flush()
    raise SystemExit(0)
