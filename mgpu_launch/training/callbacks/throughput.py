"""Training throughput in samples/s: the seed study's metric (SamplesPerSec), not epoch time."""

import statistics
import time

import keras
import numpy as np

from mgpu_launch import runtime
from mgpu_launch.runtime import collectives


class ThroughputCallback(keras.callbacks.Callback):
    """Log samples/s per step and per epoch, summed over the ranks.

    Each step's time is measured from one batch end to the next; the callback reads the step's
    loss first, which waits for the device (so the time is the device's, not the dispatch's).
    Per epoch, the median over the steps after `warmup_steps` (compilation and caches stay out
    of the figure) is summed over the ranks with one collective and stored in the epoch logs as
    ``samples_per_sec``; rank 0 prints it when `verbose`. Per step, the batch logs get
    ``samples_per_sec`` = this rank's rate x size (an estimate: no collective per step).

    Args:
        batch_size: samples per step on each process (fit's ``batch_size``).
        warmup_steps: steps of each epoch left out of the epoch's median.
        verbose: print the epoch figure on rank 0.

    Example:
        >>> model.fit(x, y, batch_size=64, callbacks=[mgpu.callbacks.ThroughputCallback(64)])
    """

    def __init__(self, batch_size: int, warmup_steps: int = 5, verbose: int = 1):
        super().__init__()
        if int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size!r}: expected the number of samples per "
                             f"step on each process (>= 1)")
        self.batch_size, self.warmup_steps, self.verbose = int(batch_size), warmup_steps, verbose
        self.rates, self._last = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self.rates, self._last = [], time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if logs and "loss" in logs:
            float(logs["loss"])  # wait for the device
        now = time.perf_counter()
        if self._last is not None and now > self._last:
            rate = self.batch_size / (now - self._last)
            self.rates.append(rate)
            if logs is not None:
                logs["samples_per_sec"] = rate * (runtime.size() if runtime.is_initialized()
                                                  else 1)
        self._last = now

    def on_epoch_end(self, epoch, logs=None):
        timed = self.rates[self.warmup_steps:] or self.rates
        local = statistics.median(timed) if timed else 0.0
        total = local
        if runtime.is_multi_process():
            total = float(collectives.allreduce(np.array([local]), op=collectives.Sum)[0])
        if logs is not None:
            logs["samples_per_sec"] = total
        if self.verbose and runtime.state.rank == 0:
            print(f"\nEpoch {epoch + 1}: {total:.1f} samples/s over all ranks "
                  f"(median of {len(timed)} steps)")
