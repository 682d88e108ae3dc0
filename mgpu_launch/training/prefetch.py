"""A background thread that produces batches and copies them to the device ahead of the step.

Framework-free: the backend's copy is passed in (``transfer``) by the Keras patch that installs
it (``mgpu_launch.training.patches``), so this module sits below the engines and the Keras glue.
"""

import queue
import threading
import time
from typing import Any, Callable, Iterable

from mgpu_launch.runtime import timeline
from mgpu_launcher import settings


def prefetch_depth(accelerator: bool) -> int:
    """Batches to copy ahead of the step: ``MGPU_PREFETCH`` when set, else 2 on an
    accelerator and 0 (off) on CPU, where the hand-off between threads costs more than it
    hides (measured: a tiny MLP on JAX CPU ran 3x slower with it).

    Args:
        accelerator: whether the backend computes on a GPU (or another accelerator).

    Raises:
        mgpu_launcher.settings.SettingError: the variable is not a whole number >= 0.
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


def _produce(iterator, transfer, out: "queue.Queue", stop: threading.Event) -> None:
    def offer(message) -> bool:
        while not stop.is_set():
            try:
                out.put(message, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in iterator:
            if not offer(("item", transfer(item))):
                return
        offer(("end", None))
    except BaseException as error:  # handed to the consumer, raised there
        offer(("error", error))
