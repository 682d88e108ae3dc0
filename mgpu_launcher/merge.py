"""Noise once: the same stderr line from several ranks, shown once with the ranks' tags.

Every rank of a job imports the same framework and prints the same start-up lines (TF's oneDNN
notice, absl's "All log messages before absl::InitializeLog()", JAX / gloo connection lines):
at 8 ranks, 8 copies. :class:`LineMerger` holds each stderr line for a short window; when
other ranks print the same line (up to the time and process id of a glog prefix), it is
printed once as ``[0-7] text``. A line the other ranks do not repeat in time is printed with
the ranks that did.

The frameworks' start-up chatter goes further (:data:`DROPPED`, :data:`ONCE`): TensorFlow
prints absl's notice and its oneDNN notice twice in one process, a ``grpc_server_lib ...
Started server with target`` line per rank (each with its own port), JAX ``[Gloo] Rank N is
connected to M peer ranks``. Those that say nothing a user acts on are dropped; the notices
worth seeing once are shown once per job. TensorFlow's CUDA wheel also prints an E-line per rank
on a machine without GPUs, ``failed call to cuInit: ... UNKNOWN ERROR (303)``
(:data:`NO_GPU_DROPPED`): dropped only when the launcher knows every rank runs on its own host
and sees no GPU there (``no_gpu``); on a GPU host, or a host it cannot see, the line stays, since
there it tells why the GPU is unused. ``MGPU_STARTUP_NOISE=1`` (or ``--all-ranks-output``) shows
them all again, merged as any other line.

Never merged, never held: anything that looks like an error (a traceback and whatever follows
it on that rank, glog E/F lines, lines naming an Error or Exception, the launcher's failure
marker). Before such a line, everything its rank has pending is printed first, so a rank's
lines keep their order. Lines of different ranks keep the order in which they were first seen.
"""

import re
import threading
import time
from typing import Callable, List, Optional

from mgpu_launch.config import settings_table

#: how long a line waits for the other ranks' copies (MGPU_MERGE_SECONDS overrides)
DEFAULT_WINDOW = settings_table.MERGE_WINDOW
# glog's prefix: severity, date, time, thread id. Only "I file:line]" is kept for comparison.
_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ")
#: start-up lines dropped: they tell of the machinery, nothing a user acts on
DROPPED = re.compile(
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$|"
    r"^I\d{4} [\d:.]+\s+\d+ grpc_server_lib\.cc:\d+\] Started server with target: |"
    r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer "
    r"ranks is : \d+$")
#: TensorFlow's E-line where CUDA finds no GPU: dropped only on a job known to have none
#: (LineMerger's `no_gpu`); on a GPU host it is the reason the GPU goes unused
NO_GPU_DROPPED = re.compile(r"^E\d{4} [\d:.]+\s+\d+ \S+\] failed call to cuInit: ")
#: start-up notices shown once per job (TF prints them again in the same process)
ONCE = re.compile(r"^I port\.cc:\d+\] oneDNN custom operations are on\.|"
                  r"^I cpu_feature_guard\.cc:\d+\] |^I cudart_stub\.cc:\d+\] |"
                  r"^To enable the following instructions: ")
_ERRORISH = re.compile(r"Traceback \(most recent call last\)|Error\b|Error:|Exception\b|"
                       r"^[EF]\d{4} |^\s+File \"|mgpu-train: rank failure|FATAL|Fatal")


def ranks_tag(ranks: List[int]) -> str:
    """``[0-3]``, ``[0,2]``, ``[0-2,5]``: sorted ranks, runs of consecutive ranks as ranges."""
    ranks = sorted(set(ranks))
    parts, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return "[" + ",".join(parts) + "]"


def normalize(text: str) -> str:
    """The part of a line that is the same on every rank (glog: without time and thread id)."""
    return _GLOG.sub(r"\1 ", text)


def is_errorish(text: str) -> bool:
    return bool(_ERRORISH.search(text))


class _Pending:
    __slots__ = ("key", "text", "ranks", "since")

    def __init__(self, key: str, text: str, rank: int, since: float):
        self.key, self.text, self.ranks, self.since = key, text, [rank], since


class LineMerger:
    """Merges identical stderr lines of several ranks; calls `emit(tag, text)` to print.

    Args:
        emit: prints one line: ``emit("[0-3]", "text")``.
        size: number of ranks (a line all of them printed goes out at once); None: unknown,
            lines wait for the window.
        window: seconds a line waits for copies from other ranks.
        clock: time source (tests).
        quiet: drop the :data:`DROPPED` start-up lines and show each :data:`ONCE` notice
            once per job (False: ``MGPU_STARTUP_NOISE=1``).
        no_gpu: every rank runs on a host without GPUs (the launcher's, which it checked):
            drop :data:`NO_GPU_DROPPED` too, when `quiet`.
    """

    def __init__(self, emit: Callable[[str, str], None], size: Optional[int] = None,
                 window: float = DEFAULT_WINDOW, clock: Callable[[], float] = time.monotonic,
                 quiet: bool = True, no_gpu: bool = False):
        self.emit, self.size, self.window, self.clock = emit, size, window, clock
        self.quiet, self.no_gpu, self.shown = quiet, no_gpu, set()  # shown: ONCE notices queued
        self.queue: List[_Pending] = []
        self.tracing = set()  # ranks that printed a traceback: pass everything through
        self.lock = threading.RLock()

    def line(self, rank: int, text: str) -> None:
        with self.lock:
            if rank not in self.tracing and self.drops(text):
                return  # before the error test: the cuInit line is a glog E-line
            if rank in self.tracing or is_errorish(text):
                if "Traceback (most recent call last)" in text:
                    self.tracing.add(rank)
                self._flush_rank(rank)
                self.emit(f"[{rank}]", text)
                return
            key = normalize(text)
            once = self.quiet and ONCE.search(key)
            if once and key in self.shown and all(p.key != key for p in self.queue):
                return  # shown already: TF's second copy in a process, or a late rank's
            for pending in self.queue:
                if once and pending.key == key:  # a copy of the same rank joins it too
                    pending.ranks += [] if rank in pending.ranks else [rank]
                    break
                if pending.key == key and rank not in pending.ranks:
                    pending.ranks.append(rank)
                    break
            else:
                self.queue.append(_Pending(key, text, rank, self.clock()))
                if once:
                    self.shown.add(key)
            self._release()

    def drops(self, text: str) -> bool:
        """Whether a line is chatter to drop (also asked for stdout, which is not merged: JAX's
        Gloo line)."""
        return self.quiet and bool(DROPPED.search(text) or
                                   (self.no_gpu and NO_GPU_DROPPED.search(text)))

    def tick(self) -> None:
        """Print what waited long enough (call periodically)."""
        with self.lock:
            self._release()

    def flush(self) -> None:
        """Print everything still held (at the end of the job)."""
        with self.lock:
            while self.queue:
                self._pop()

    def _release(self) -> None:
        now = self.clock()
        while self.queue and (len(self.queue[0].ranks) == self.size
                              or now - self.queue[0].since >= self.window):
            self._pop()

    def _flush_rank(self, rank: int) -> None:
        last = max((i for i, p in enumerate(self.queue) if rank in p.ranks), default=-1)
        for _ in range(last + 1):
            self._pop()

    def _pop(self) -> None:
        pending = self.queue.pop(0)
        # One rank: its line as printed; several: the part they share.
        self.emit(ranks_tag(pending.ranks),
                  pending.text if len(pending.ranks) == 1 else pending.key)
