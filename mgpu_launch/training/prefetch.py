"""A background thread that produces batches and copies them to the device ahead of the step.

Two shapes: :class:`Prefetcher`, one pass over one iterable; and :class:`EpochFeed`, what
``fit`` uses: one thread for every pass over the data of one Keras epoch iterator, which may
begin the next pass while the current epoch ends (:class:`EpochFeed` says when it may).

Framework-free: the backend's copy is passed in (``transfer``) by the Keras patch that installs
it (``mgpu_launch.training.patches``), so this module sits below the engines and the Keras glue.
"""

import queue
import threading
import time
from typing import Any, Callable, Iterable, Optional

from mgpu_launch.runtime import timeline
from mgpu_launch.config import settings


def prefetch_depth(accelerator: bool) -> int:
    """Batches to copy ahead of the step: ``MGPU_PREFETCH`` when set, else 2 on an
    accelerator and 0 (off) on CPU, where the hand-off between threads costs more than it
    hides (measured: a tiny MLP on JAX CPU ran 3x slower with it).

    Args:
        accelerator: whether the backend computes on a GPU (or another accelerator).

    Raises:
        mgpu_launch.config.settings.SettingError: the variable is not a whole number >= 0.
    """
    return settings.integer("MGPU_PREFETCH", fallback=2 if accelerator else 0)


class Prefetcher:
    """An iterator over `source`, produced by a background thread up to `depth` items ahead.

    The thread runs ``transfer(item)`` on every item (the engines pass their host-to-device
    copy, which waits for the copy to finish there, not in the training loop). An exception in
    the source or the transfer is raised by ``next`` in the consumer, after the items before
    it. The thread starts at the first ``next``. When the consumer drops the iterator early (``steps_per_epoch``, early stopping), the
    thread notices within 0.1 s and ends, releasing what it held.

    Args:
        source: any iterable (Keras's data adapter iterator, a DataLoader, a generator).
        transfer: applied to each item in the background thread.
        depth: items ready ahead of the consumer (>= 1).

    Example:
        >>> for batch in Prefetcher(adapter.get_jax_iterator(), jax.device_put, depth=2):
        ...     step(batch)
    """

    def __init__(self, source: Iterable, transfer: Callable[[Any], Any], depth: int = 2):
        self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        # The thread gets the queue and the event, not `self`, so dropping the Prefetcher
        # runs __del__ and stops it.
        self._thread = threading.Thread(
            target=_produce, args=(iter(source), transfer, self._queue, self._stop),
            name="mgpu-prefetch", daemon=True)

    def __iter__(self):
        return self

    def __next__(self):
        if not self._thread.is_alive() and not self._thread.ident:
            # Started by the first request, not at creation: Keras creates the next epoch's
            # iterator before the data's on_epoch_end() (a PyDataset's reshuffle) has run.
            self._thread.start()
        if self._done:
            raise StopIteration
        if timeline.recording():  # the time the step waits for its batch: the input wait
            start = time.monotonic_ns()
            kind, item = self._queue.get()
            timeline.add("input wait", "input", start, time.monotonic_ns())
        else:
            kind, item = self._queue.get()
        if kind == "item":
            return item
        self._done = True
        if kind == "error":
            raise item
        raise StopIteration

    def close(self) -> None:
        """Stop the background thread (also done when the iterator is garbage-collected)."""
        self._stop.set()

    __del__ = close


class EpochFeed:
    """One producer thread for all the passes (epochs) a Keras epoch iterator makes over its data.

    Keras asks its epoch iterator for a new iterator of batches at every epoch
    (``_get_iterator``); :meth:`next_pass` answers it. The producer thread iterates pass
    ``p``'s source (the one given to ``next_pass``, else ``make_source(p)``, called in the
    thread), batches go through ``transfer`` there, and each consumer pass takes only its own
    pass's batches, in order. A pass the consumer drops early (a build batch,
    ``stop_training``) is abandoned: the thread leaves it for the next one asked for.

    While the timeline records (``mgpu_launch.runtime.timeline``), the thread adds a
    ``batch read`` slice (the source's ``next``) and a ``device copy`` slice (``transfer``) for
    every batch, category ``prefetch``, on its own track: whether the producer keeps up.

    When pass ``p`` ends, the thread begins pass ``p + 1`` at once only if ``run_ahead`` and
    the consumer will still take that many batches (``planned_batches``, the ``fit``'s
    epochs x steps; None: unknown, no run-ahead); otherwise it waits for the consumer's first
    request of that pass, as Keras's own feeding does. The caller allows run-ahead only for
    data whose next pass does not depend on what happens between epochs (no ``on_epoch_end``
    of its own): see ``mgpu_launch.training.patches.fit``.

    Args:
        make_source: pass number -> an iterable of that pass's batches, for a pass begun
            without one (called in the thread).
        transfer: applied to each batch in the thread (the engine's device copy).
        depth: batches ready ahead of the consumer (>= 1).
        run_ahead: whether a next pass may begin before the consumer asks for it.
        planned_batches: batches the consumer will take over all passes, if known.

    Example:
        >>> feed = EpochFeed(lambda p: range(3), lambda x: 10 * x, depth=2, run_ahead=True,
        ...                  planned_batches=6)
        >>> [list(feed.next_pass()), list(feed.next_pass())]
        [[0, 10, 20], [0, 10, 20]]
    """

    def __init__(self, make_source: Callable[[int], Iterable], transfer: Callable[[Any], Any],
                 depth: int = 2, run_ahead: bool = False, planned_batches: Optional[int] = None):
        self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
        self._state = _FeedState(run_ahead, planned_batches)
        # The thread gets the queue and the state, not `self`: dropping the feed stops it.
        self._thread = threading.Thread(
            target=_produce_passes, args=(make_source, transfer, self._queue, self._state),
            name="mgpu-prefetch", daemon=True)

    @property
    def runs_ahead(self) -> bool:
        """Whether a next pass may begin before the consumer asks for it."""
        return self._state.run_ahead

    def next_pass(self, source: Optional[Iterable] = None) -> "_Pass":
        """The iterator of the next pass; it claims its pass at its first ``next``.

        Args:
            source: that pass's batches (an iterator made now, when its making has effects
                Keras orders, e.g. a DataLoader's seed draw); None: ``make_source``'s.
        """
        return _Pass(self, source)

    def _claim(self, source) -> int:
        if not self._thread.is_alive() and not self._thread.ident:
            self._thread.start()
        return self._state.claim(source)

    def close(self) -> None:
        """Stop the thread (also done when the feed is garbage-collected)."""
        self._state.stop()

    __del__ = close


#: batches of a pass (without run-ahead) read only when the consumer asks: see may_read
ON_DEMAND = 2


class _FeedState:
    """What the consumer tells the producer, under one condition variable."""

    def __init__(self, run_ahead: bool, planned_batches: Optional[int]):
        self.changed = threading.Condition()
        self.claimed = -1  # the newest pass the consumer asked for
        self.sources: dict = {}  # pass -> the source its consumer brought
        self.taken = 0  # batches handed to the consumer, all passes
        self.taken_of_claimed = 0  # of which from the pass claimed last
        self.asked_of_claimed = 0  # batches the consumer asked for of the pass claimed last
        self.stopped = False
        self.run_ahead = run_ahead
        self.planned = planned_batches

    def claim(self, source) -> int:
        with self.changed:
            self.claimed += 1
            if source is not None:
                self.sources[self.claimed] = source
            self.taken_of_claimed = self.asked_of_claimed = 0
            self.changed.notify_all()
            return self.claimed

    def ask(self) -> None:
        with self.changed:
            self.asked_of_claimed += 1
            self.changed.notify_all()

    def may_read(self, number: int, index: int) -> bool:
        """Block until batch `index` of pass `number` may be read; False: the pass is dropped.

        Without run-ahead, a pass's first :data:`ON_DEMAND` batches are read only once the
        consumer asks for them: a pass Keras drops after one batch (the build batch) then reads
        exactly what Keras's own feeding reads, so the data's code (a PyDataset's
        ``__getitem__``, which may draw from ``random``) runs as often, whatever the thread's
        timing (issue 58)."""
        if self.run_ahead or index >= ON_DEMAND:
            return not self.abandoned(number)
        with self.changed:
            while not self.abandoned(number) and not (
                    self.claimed == number and self.asked_of_claimed > index):
                self.changed.wait(0.1)
            return not self.abandoned(number)

    def take(self) -> None:
        with self.changed:
            self.taken += 1
            self.taken_of_claimed += 1

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()

    def abandoned(self, number: int) -> bool:
        return self.stopped or self.claimed > number

    def wait_to_begin(self, number: int, previous_length: Optional[int]) -> bool:
        """Block until pass `number` may begin; False: stopped. `previous_length`: the batches
        of pass ``number - 1`` when it ended without being dropped (else None)."""
        with self.changed:
            if (self.run_ahead and self.planned is not None and previous_length is not None
                    and self.claimed == number - 1):
                # batches the consumer will have taken once it finished the previous pass
                will_take = self.taken - self.taken_of_claimed + previous_length
                if will_take < self.planned:
                    return not self.stopped
            while not self.stopped and self.claimed < number:
                self.changed.wait(0.1)
            return not self.stopped


class _Pass:
    """One pass of an :class:`EpochFeed`, the iterator Keras's epoch loop reads."""

    def __init__(self, feed: EpochFeed, source):
        self._feed = feed
        self._source = source
        self._number: Optional[int] = None
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._number is None:
            # Claimed at the first request, not at creation: Keras makes the next epoch's
            # iterator before the data's on_epoch_end() has run, and drops it unread when
            # steps_per_epoch is unset (it makes another at the epoch's start).
            self._number, self._source = self._feed._claim(self._source), None
        self._feed._state.ask()
        source = self._feed._queue
        start = time.monotonic_ns() if timeline.recording() else None
        while True:
            kind, number, item = source.get()
            if number == self._number:
                break
            if number > self._number:  # never: the thread makes passes in the order claimed
                raise RuntimeError(f"mgpu_launch's prefetch thread handed a batch of pass "
                                   f"{number} to pass {self._number}; please report this")
            # else: what is left of a pass the consumer dropped before its end
        if start is not None:  # the time the step waits for its batch: the input wait
            timeline.add("input wait", "input", start, time.monotonic_ns())
        if kind == "item":
            self._feed._state.take()
            return item
        self._done = True
        if kind == "error":
            raise item
        raise StopIteration


def _offer(out: "queue.Queue", message, stopped) -> bool:
    """Put `message` on the bounded queue, waiting for room while ``stopped()`` is false;
    whether it was put (False: the consumer is gone, the producer should stop)."""
    while not stopped():
        try:
            out.put(message, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _produce_passes(make_source, transfer, out: "queue.Queue", state: _FeedState) -> None:
    def offer(message, number) -> bool:
        return _offer(out, message, lambda: state.abandoned(number))

    number, length = 0, None
    ready = None  # (pass, its iterator) made while the pass before it ran (run-ahead only)
    while state.wait_to_begin(number, length):
        with state.changed:
            if state.claimed > number:  # the consumer dropped passes before this one began
                number = state.claimed
            for old in [key for key in state.sources if key < number]:
                del state.sources[old]
            source = state.sources.pop(number, None)
        if source is None and ready is not None and ready[0] == number:
            source = ready[1]  # None (failed early) makes it again below
        ready, length = None, 0
        try:
            mark = time.monotonic_ns()
            batches = iter(source if source is not None else make_source(number))
            while True:
                if not state.may_read(number, length):
                    length = None  # dropped by the consumer
                    break
                mark = mark if length >= ON_DEMAND else time.monotonic_ns()  # not the wait
                try:
                    item = next(batches)
                except StopIteration:
                    offer(("end", number, None), number)
                    break
                if timeline.recording():  # where the thread's time goes, batch by batch
                    read = time.monotonic_ns()
                    item = transfer(item)
                    timeline.add("batch read", "prefetch", mark, read)
                    timeline.add("device copy", "prefetch", read, time.monotonic_ns())
                else:
                    item = transfer(item)
                if not offer(("item", number, item), number):
                    length = None  # dropped by the consumer
                    break
                mark = time.monotonic_ns()
                length += 1
                if ready is None and state.run_ahead:
                    ready = (number + 1, _start(make_source, number + 1))
        except BaseException as error:  # handed to the consumer, raised there
            offer(("error", number, error), number)
            length = None
        number, source = number + 1, None  # `source` dropped: a generator ends now


def _start(make_source, number):
    """Pass `number`'s iterator, made early: a tf.data iterator takes 40-60 ms to start on
    CPU, and starting one reads nothing (nor does a generator object before its first next).
    None when making it fails: the pass then makes it again when it begins, and raises there."""
    try:
        return iter(make_source(number))
    except Exception:
        return None


def _produce(iterator, transfer, out: "queue.Queue", stop: threading.Event) -> None:
    def offer(message) -> bool:
        return _offer(out, message, stop.is_set)

    try:
        for item in iterator:
            if not offer(("item", transfer(item))):
                return
        offer(("end", None))
    except BaseException as error:  # handed to the consumer, raised there
        offer(("error", error))
