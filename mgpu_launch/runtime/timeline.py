"""The timeline: where every rank's time goes, as one Chrome / Perfetto trace of the whole job.

Every rank records *slices* — (thread, name, category, start, duration, step) — into a ring
buffer of :data:`CAPACITY` slices (a week-long job keeps its last steps, not all of them):

* the step phases, from the fit probes (``mgpu_launch.training.stall_probes``) through
  :func:`phase`: each phase ends where the next one begins, so a thread's phases never overlap;
* slices inside a phase, through :func:`span` / :func:`add`: the host collectives
  (``mgpu_launch.runtime.collectives``) and the wait for the next batch in the device
  prefetcher (``mgpu_launch.training.prefetch``). They nest inside the phase they ran in.

Times are this host's monotonic clock (``time.monotonic_ns``), which every process of one
host shares; for a rank on another host :func:`measure_offsets` pings it from rank 0 a few
times over MPI when recording starts and keeps the offset that turns its clock into rank 0's
(taken from the round trip with the least delay, as NTP does), so its slices line up to
within about half that round trip.

:func:`write` (rank 0, collective) gathers every rank's slices and writes one trace-event JSON
file: one process per rank (``pid`` = rank, named ``rank N``), one thread track per recording
thread, ``"X"`` events with ``ts``/``dur`` in microseconds (``mgpu_launch.runtime.trace_files``
holds the format and writes it atomically, never through a planted link). Open it in
``ui.perfetto.dev`` or ``chrome://tracing``.

``MGPU_TIMELINE=FILE`` (or ``mgpu-train --timeline FILE``, or ``mgpu_launch.run(...,
timeline=FILE)``) starts it at ``mgpu.init()`` and writes the file at ``mgpu.shutdown()``;
``start()`` / ``stop()`` do it by hand (Horovod's ``hvd.start_timeline`` /
``hvd.stop_timeline``). A job that never gets there still leaves what it recorded:
:func:`dump_own` writes one rank's slices, with the phase it is in at that moment, to
``FILE.rank<N>.json`` (no collective) when the rank dies of an uncaught exception or of SIGTERM
(:mod:`mgpu_launch.runtime.timeline_signals`) and, on a stall, on rank 0 and on each rank the
inspector names; ``python3 -m
mgpu_launch.runtime.trace_files merge OUT FILE.rank*.json`` joins them into one trace.
Recording a slice costs one clock read and one
deque append; when nothing records, every hook is one ``None`` test. No framework is imported.
"""

import collections
import contextlib
import os
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from mgpu_launch.runtime import folders, timeline_signals, trace_files
from mgpu_launch.config import settings

#: slices each rank keeps (the oldest go first): about 10 MiB, some 15,000 steps of fit
CAPACITY = 100_000
#: ping rounds per rank when the clock offsets are measured
PING_ROUNDS = 16
_PING_TAG = 0x7E1

Slice = trace_files.Slice  # (thread index, name, category, start ns, duration ns, step, parent)


class Recorder:
    """One process's slices, with the phase each of its threads is in."""

    def __init__(self, capacity: int = CAPACITY):
        self.slices: "collections.deque[Slice]" = collections.deque(maxlen=capacity)
        self.appended = 0  # slices ever added (the ring forgets, this does not)
        self.open: Dict[int, Tuple[str, str, int, int]] = {}  # thread -> its phase
        # thread ident -> (index, name). The main thread, where fit runs its loop, is track 0
        # whichever thread records first (the prefetch thread often does): the efficiency
        # report reads the loop's time from thread 0.
        main = threading.main_thread()
        self.threads: Dict[int, Tuple[int, str]] = {main.ident: (0, main.name)}

    def thread(self) -> int:
        current = threading.current_thread()
        known = self.threads.get(current.ident)
        if known is None:
            known = self.threads[current.ident] = (len(self.threads), current.name)
        return known[0]

    def add(self, thread: int, name: str, category: str, start: int, end: int,
            step: int) -> None:
        parent = self.open.get(thread, ("",))[0]
        self.slices.append((thread, name, category, start, max(0, end - start), step, parent))
        self.appended += 1

    def phase(self, name: Optional[str], category: str, step: int) -> None:
        now, thread = time.monotonic_ns(), self.thread()
        ending = self.open.pop(thread, None)
        if ending is not None:
            self.slices.append((thread, ending[0], ending[1], ending[2], now - ending[2],
                                ending[3], ""))
            self.appended += 1
        if name is not None:
            self.open[thread] = (name, category, now, step)

    def since(self, count: int) -> List[Slice]:
        """The slices added after the first `count` ever added (as many as the ring holds)."""
        fresh = min(len(self.slices), self.appended - count)
        return list(self.slices)[len(self.slices) - fresh:] if fresh > 0 else []


_recorder: Optional[Recorder] = None
_path: Optional[str] = None  # where write() puts the trace (None: record for the report only)
_offsets: Optional[List[int]] = None  # rank -> ns to add to its clock to get rank 0's
_step = 0  # the step the fit probes saw last (slices of collectives carry it)
_state: Any = None  # the runtime state recording started with (this layer's __init__ holds
# the hooks that call this module, so the state is handed in rather than imported)


def recording() -> bool:
    """Whether this process records slices."""
    return _recorder is not None


def phase(name: Optional[str], category: str = "phase", step: Optional[int] = None) -> None:
    """End this thread's current phase and begin `name` (None: begin nothing).

    Args:
        name: the phase, e.g. ``"train step"``.
        category: its kind (``step``, ``callbacks``, ``input``, ``other``).
        step: the training step it belongs to (default: the last one given).
    """
    global _step
    if _recorder is not None:
        if step is not None:
            _step = step
        _recorder.phase(name, category, _step)


def add(name: str, category: str, start: int, end: int) -> None:
    """Record a slice of this thread that ran from `start` to `end` (``time.monotonic_ns``)."""
    if _recorder is not None:
        _recorder.add(_recorder.thread(), name, category, start, end, _step)


@contextlib.contextmanager
def span(name: str, category: str) -> Iterator[None]:
    """Record the time the ``with`` block takes as a slice (nothing when not recording)."""
    if _recorder is None:
        yield
        return
    start = time.monotonic_ns()
    try:
        yield
    finally:
        add(name, category, start, time.monotonic_ns())


def appended() -> int:
    """How many slices this process recorded so far (a bookmark for :func:`since`)."""
    return 0 if _recorder is None else _recorder.appended


def since(count: int) -> List[Slice]:
    """This process's slices after bookmark `count`, its clock moved onto rank 0's."""
    if _recorder is None:
        return []
    shift = _own_offset()
    return [(t, n, c, start + shift, d, s, p) for t, n, c, start, d, s, p in
            _recorder.since(count)]


def _own_offset() -> int:
    return _offsets[_state.rank] if _offsets else 0


def _kernel() -> str:
    """This kernel's boot id: processes that share it share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return f"pid {os.getpid()}"  # unknown: measure


def measure_offsets(transport) -> List[int]:
    """Every rank's clock offset to rank 0, in ns (collective over `transport`, the runtime's
    control plane; None: one process).

    Ranks on rank 0's kernel (same boot id: same host, containers included) read the same
    monotonic clock: offset 0, exactly. For each other rank, rank 0 sends :data:`PING_ROUNDS`
    pings and the rank answers with its clock; the round with the shortest round trip gives
    the offset (rank 0's clock at the middle of the round trip, less the rank's answer), good
    to half that round trip. Rank 0 broadcasts the list.
    """
    if transport is None:
        return [0]
    rank = transport.rank
    kernels = transport.allgather_object(_kernel())
    offsets = [0] * len(kernels)
    for other in (r for r in range(1, len(kernels)) if kernels[r] != kernels[0]):
        if rank == 0:
            best = None
            for _ in range(PING_ROUNDS):
                sent = time.monotonic_ns()
                transport.send_object(None, other, _PING_TAG)
                theirs = transport.receive_object(other, _PING_TAG)
                back = time.monotonic_ns()
                if best is None or back - sent < best[0]:
                    best = (back - sent, (sent + back) // 2 - int(theirs))
            offsets[other] = best[1]
        elif rank == other:
            for _ in range(PING_ROUNDS):
                transport.receive_object(0, _PING_TAG)
                transport.send_object(time.monotonic_ns(), 0, _PING_TAG)
    return transport.broadcast_object(offsets, 0)


def ensure_recording(state) -> None:
    """Start recording (for the efficiency report) if nothing records yet.

    Collective on a multi-process job (the clock offsets are measured): every rank calls it at
    the same point, e.g. in ``on_train_begin`` of a callback every rank has.

    Args:
        state: the runtime state (``mgpu_launch.runtime.state``), initialized.
    """
    global _recorder, _offsets, _state
    state.require()
    _state = state
    if _offsets is None:
        _offsets = measure_offsets(state.transport)
    if _recorder is None:
        _recorder = Recorder()


def discard() -> bool:
    """Stop recording for the efficiency report alone (no timeline file asked for) and drop
    what was recorded; returns whether it stopped. mgpu-bench alternates rows with and
    without the recorder with it; a fit with the report on starts recording again."""
    global _recorder
    if _path is not None:
        return False
    _recorder = None
    return True


def start(path: str, state) -> None:
    """Record every rank's timeline, to be written to `path` by :func:`stop` (collective).

    Args:
        path: the trace file rank 0 writes, mode 0600 (a missing folder is made, mode 0700).
        state: the runtime state (``mgpu_launch.runtime.state``).

    Raises:
        ValueError: `path` is empty.
        mgpu_launch.runtime.folders.UnsafeFolder: (a PermissionError) another user could
            change the file's folder or its path (``runtime/folders.py``).
        mgpu_launch.runtime.NotInitializedError: before ``mgpu.init()``.

    Example:
        >>> timeline.start("/scratch/job-42/timeline.json", runtime.state)
    """
    global _path
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ValueError(f"the timeline file: expected a path, e.g. 'timeline.json'; got "
                         f"{path!r}")
    absolute = os.path.abspath(os.fspath(path))
    # Checked now, not at the end of training: another user's folder or link on the path
    # would decide where every rank's trace goes (write_document checks it again then).
    folders.private_folder(os.path.dirname(absolute), "the timeline file's folder")
    ensure_recording(state)
    _path = absolute
    timeline_signals.install(dump_own)  # a rank ended by SIGTERM leaves FILE.rank<N>.json


def stop() -> Optional[str]:
    """Write the trace (rank 0, collective) and stop recording; returns the path written (rank
    0) or None (also when no trace was started)."""
    global _recorder, _path
    if _recorder is None or _path is None:
        return None
    path, _path = _path, None
    timeline_signals.uninstall()
    try:
        return write(path, _state)
    finally:
        _recorder = None


def on_init(state) -> None:
    """Runtime hook of ``mgpu.init()``: start recording when ``MGPU_TIMELINE`` names a file."""
    path = settings.text("MGPU_TIMELINE")
    if path:
        start(path, state)


def on_shutdown() -> None:
    """Runtime hook of ``mgpu.shutdown()``: write the trace of ``MGPU_TIMELINE`` (a failure to
    write is reported, not raised: the job's own work is done)."""
    global _recorder, _offsets
    try:
        stop()
    except OSError as error:
        print(f"mgpu: timeline not written: {error}", file=sys.stderr, flush=True)
    _recorder, _offsets = None, None


def dump_own(reason: str) -> Optional[str]:
    """Write this rank's slices alone, now, to ``<timeline file>.rank<N>.json``: what a job that
    ends without ``mgpu.shutdown()`` (a crash, a stall) leaves (not collective, never raises).

    The phase each thread is in is closed at this moment (``args.open``: it had not ended), so
    the trace shows where the rank was. Times are on rank 0's clock, as in the job's trace.

    Args:
        reason: why (``"uncaught exception"``, ``"stall"``), kept in the file's ``otherData``.

    Returns:
        The path written, or None: no timeline file was asked for, or it could not be written
        (said on stderr).

    Example:
        >>> timeline.dump_own("stall")  # doctest: +SKIP
        '/scratch/job-42/timeline.json.rank1.json'
    """
    recorder, path, state = _recorder, _path, _state
    if recorder is None or path is None or state is None:
        return None
    try:
        now, shift = time.monotonic_ns(), _own_offset()
        slices = since(0) + [
            (thread, name, category, start + shift, now - start, step, trace_files.OPEN)
            for thread, (name, category, start, step) in list(recorder.open.items())]
        threads = dict(recorder.threads.values())
        events = trace_files.trace_events([(slices, threads)], first_rank=state.rank, base=0)
        target = f"{path}.rank{state.rank}.json"
        trace_files.write_document(target, {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {
            "producer": "mgpu-launch", "rank": state.rank, "reason": reason}})
        print(f"mgpu: rank {state.rank}: timeline so far written to {target} ({reason})",
              file=sys.stderr, flush=True)
        return target
    except Exception as error:  # a dump must never hide the failure it accompanies
        print(f"mgpu: rank {getattr(state, 'rank', '?')}: timeline not dumped: "
              f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return None


def write(path: str, state) -> Optional[str]:
    """Gather every rank's slices to rank 0 and write them to `path` there (collective).

    Returns:
        The path written, on rank 0; None on the other ranks.

    Raises:
        OSError: rank 0 cannot write the file (e.g. another user's file has that name).
    """
    own = (since(0), {index: name for index, name in
                      (_recorder.threads.values() if _recorder else [])})
    gathered = state.transport.gather_object(own, 0) if state.transport is not None else [own]
    if state.rank != 0:
        return None
    trace_files.write_document(path, {
        "traceEvents": trace_files.trace_events(gathered), "displayTimeUnit": "ms",
        "otherData": {"producer": "mgpu-launch", "ranks": len(gathered),
                      "clock offsets to rank 0 (ns)": _offsets or [0]}})
    return path
