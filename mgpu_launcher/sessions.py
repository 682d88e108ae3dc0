"""A job's process session: who is in it, how to end it, and who ends it if the caller dies.

mpirun runs in a session of its own (``start_new_session``) and its ranks stay in that session
(Open MPI gives each rank its own process group, so killing mpirun's group is not enough): the
session is the job. :func:`kill` and :func:`wait_until_gone` end it from the launcher.

Whatever ends the launching process (mgpu-train, or the caller of ``mgpu_launch.run`` on any
thread) may leave it no chance to end its job: SIGKILL, an OOM kill, a crash, or a thread that
cannot catch signals. A :class:`Reaper` covers that, for every attempt of every launch: a small
watchdog process, started beside the job, that holds a pipe from the caller. When the caller
lets it go (:meth:`Reaper.release`, after its own teardown) it leaves; when the pipe closes
without that word (the caller is gone, however it died) it ends the session as mgpu-train's own
Ctrl-C would, and removes the run's temporary folder if it was given one. Run as a script
(``python -I sessions.py SESSION [FOLDER]``), this module is that watchdog: it needs only the
standard library, so it starts the same wherever the package is installed.

Linux only (/proc); elsewhere no member is ever found and only mpirun's group is signalled.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import List, Optional, Tuple

#: seconds between asking mpirun to stop (SIGTERM) and killing what is left of its session
GRACE_SECONDS = 5.0
# What the caller writes to its reaper when the job is already torn down.
_RELEASE = b"released\n"


def members(session: int) -> List[int]:
    """Live processes (not zombies) of the session `session`, from /proc (empty elsewhere)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == session and fields[0] not in "ZX":
            found.append(int(entry))
    return found


def kill(session: int) -> None:
    """SIGKILL the session leader's process group and every other process of the session."""
    try:
        os.killpg(session, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in members(session):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_until_gone(session: int, timeout: float) -> Tuple[int, ...]:
    """Wait for the session's processes to die; returns those still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        alive = members(session)
        if not alive or time.monotonic() > deadline:
            return tuple(alive)
        time.sleep(0.05)


class Reaper:
    """A watchdog process that ends the session `session` if this process dies first.

    Args:
        session: the session to end: mpirun's pid, mpirun having been started with
            ``start_new_session=True`` (start it before the reaper, so that mpirun does not
            inherit the reaper's pipe).
        folder: a folder of the run to remove once the job is gone (``mgpu_launch.run``'s
            temporary one), or None. Only when the caller died: otherwise the caller removes it.

    Example:
        >>> proc = subprocess.Popen(command, start_new_session=True)
        >>> reaper = Reaper(proc.pid)
        >>> ...                      # wait for the job, tear it down
        >>> reaper.release()         # done: the reaper leaves without touching anything
    """

    def __init__(self, session: int, folder: Optional[str] = None):
        # Its own session: a Ctrl-C in the terminal (SIGINT to the foreground group) must not
        # take the watchdog down with the caller.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(session)]
            + ([os.path.abspath(folder)] if folder else []),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    def release(self) -> None:
        """Tell the reaper the job is over (torn down by the caller); it exits at once."""
        try:
            self._proc.stdin.write(_RELEASE)
            self._proc.stdin.close()
        except (BrokenPipeError, ValueError):  # it is gone already, or released twice
            pass
        self._proc.wait()


def _reap(session: int, folder: Optional[str] = None) -> int:
    """The watchdog's body: wait for the caller's word or its end; end the session if gone."""
    if sys.stdin.buffer.read() == _RELEASE:
        return 0
    try:
        return _end(session)
    finally:
        if folder:  # after the ranks are gone: none writes into it any more
            shutil.rmtree(folder, ignore_errors=True)


def _end(session: int) -> int:
    alive = members(session)
    if not alive:
        return 0
    if session in alive:  # mpirun (the session's leader) stops its ranks, as on Ctrl-C
        try:
            os.kill(session, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        wait_until_gone(session, GRACE_SECONDS)
    kill(session)
    left = wait_until_gone(session, GRACE_SECONDS)
    try:
        print(f"mgpu-train: the process that started the job (session {session}) ended before "
              f"it; the job was stopped" + (f", but these processes are still alive: "
                                            f"{', '.join(map(str, left))}" if left else ""),
              file=sys.stderr, flush=True)
    except OSError:  # the caller's terminal or pipe went with it
        pass
    return 0


if __name__ == "__main__":
    sys.exit(_reap(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
