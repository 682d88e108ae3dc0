"""A rank ended by SIGTERM leaves its timeline (``FILE.rank<N>.json``, reason ``"SIGTERM"``).

SIGTERM is how a job's ranks usually end when they end early: mpirun sends it to every rank
when one failed, Slurm at the time limit or on ``scancel``, Kubernetes when a pod is deleted.
While a timeline file is being recorded (:func:`mgpu_launch.runtime.timeline.start`), a rank
whose SIGTERM handler is still the default gets one that writes what it recorded and then
ends the process with status 143 (128 + SIGTERM, what the default action reports to a shell).

How, so that a rank blocked in a long C call (a collective waiting for a dead peer) still
ends: Python runs signal handlers only in the main thread and only between bytecodes, so the
handler itself does nothing; Python's C-level handler writes the signal's number to a wake-up
pipe (``signal.set_wakeup_fd``) at once, and a daemon thread reading it writes the dump and
calls ``os._exit``. A handler installed by someone else (the user, a framework) is left alone,
as is a wake-up fd already in use (asyncio); then SIGTERM ends the rank without a dump.
SIGKILL (the OOM killer, mpirun's last resort) can never be caught.
"""

import os
import signal
import threading
from typing import Callable, Optional

EXIT_STATUS = 128 + signal.SIGTERM


class _Watch:
    """The wake-up pipe, the reading thread and what was there before."""

    def __init__(self, dump: Callable[[str], object]):
        self.dump = dump
        self.read_fd, self.write_fd = os.pipe()
        try:
            os.set_blocking(self.write_fd, False)
            self.previous_fd = signal.set_wakeup_fd(self.write_fd)
        except (ValueError, OSError):
            os.close(self.read_fd)
            os.close(self.write_fd)
            raise

    def start(self) -> None:
        """Take SIGTERM over and start reading (once the wake-up fd is known to be ours)."""
        signal.signal(signal.SIGTERM, _nothing)
        threading.Thread(target=self._run, name="mgpu-timeline-sigterm", daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                received = os.read(self.read_fd, 64)
                if not received:
                    return  # close() closed the writing end
                if signal.SIGTERM in received:
                    self.dump("SIGTERM")
                    os._exit(EXIT_STATUS)
        finally:
            os.close(self.read_fd)  # here, so no read can meet a closed (or reused) fd

    def close(self, started: bool = True) -> None:
        """Give SIGTERM and the wake-up fd back; the reader ends on the pipe's end of file."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(self.previous_fd)
        os.close(self.write_fd)
        if not started:
            os.close(self.read_fd)


def _nothing(signum, frame) -> None:
    """The Python-level handler: the wake-up pipe's reader does the work (see the module)."""


_watch: Optional[_Watch] = None


def install(dump: Callable[[str], object]) -> bool:
    """Dump with `dump(reason)` and exit 143 on SIGTERM, if this process can take it over.

    Args:
        dump: writes this rank's trace (``timeline.dump_own``); must not raise.

    Returns:
        Whether the handler is installed: False off the main thread, when SIGTERM already has a
        handler other than the default, or when the wake-up fd is already taken.

    Example:
        >>> timeline_signals.install(timeline.dump_own)  # doctest: +SKIP
        True
    """
    global _watch
    if _watch is not None:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    try:
        watch = _Watch(dump)
    except (ValueError, OSError):
        return False
    if watch.previous_fd != -1:  # somebody else's wake-up fd (asyncio): give it back
        watch.close(started=False)
        return False
    watch.start()
    _watch = watch
    return True


def uninstall() -> None:
    """Give SIGTERM its default action back (when :func:`install` took it; main thread)."""
    global _watch
    if _watch is None or threading.current_thread() is not threading.main_thread():
        return
    watch, _watch = _watch, None
    watch.close()
