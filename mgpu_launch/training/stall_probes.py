"""The fit probes that tell the stall inspector where this rank is in the step protocol.

``fit`` of a model compiled with a DistributedOptimizer gets two extra callbacks: one before
every other callback and one after them all. Between them they mark each step's phases
(``mgpu_launch.runtime.stall``): entering on_train_begin (where ranks agree on the plan and restore
backups), entering on_train_batch_begin, entering the train step (its gradient
allreduce), entering on_train_batch_end, leaving it, validation, on_epoch_end and the end of
``fit``. Putting them first and last is what lets a warning say "last seen in
on_train_batch_end of step 5" when another callback of that step never returns.

The same marks begin the phases of the timeline (``mgpu_launch.runtime.timeline``) when it
records: each phase lasts until the next mark of its thread.

They are ``async_safe``, so they never stop Keras from dispatching batch-end callbacks on its
own thread; a mark that arrives late from there is dropped (positions only move forward).

The first probe also prints the supervisor's progress marker once, on rank 0, when the first
step is done (only when ``mgpu-train`` asks for it with ``MGPU_PROGRESS_MARKER=1``): a job
that fails after that line is worth a restart, one that fails before it is not.
"""

import sys
from typing import Any, Dict

import keras

from mgpu_launch import runtime
from mgpu_launch.runtime import stall, timeline
from mgpu_launch.config import markers
from mgpu_launch.config import settings


class _Steps:
    """The process-wide step count (steps are numbered from 1, across fit calls)."""

    step = 0
    last_begin_batch = -1
    progress_reported = False


def _step_of_end(batch: int) -> int:
    # Asynchronous dispatch may deliver a batch end after the next batch began.
    return _Steps.step if batch >= _Steps.last_begin_batch else _Steps.step - 1


def report_progress() -> None:
    """Print the supervisor's progress marker once (rank 0, when mgpu-train asks for it): a
    training step is done, or (a custom loop's) state was committed, so a later failure is
    worth a restart."""
    if not _Steps.progress_reported:
        _Steps.progress_reported = True
        if settings.flag("MGPU_PROGRESS_MARKER") and runtime.state.rank == 0:
            print(markers.line(markers.PROGRESS_MARKER), file=sys.stderr, flush=True)


class FirstProbe(keras.callbacks.Callback):
    """Runs before every other callback of the fit."""

    async_safe = True

    def on_train_begin(self, logs=None):
        stall.mark(_Steps.step, stall.FIT_BEGIN)
        timeline.phase("on_train_begin", "callbacks", _Steps.step)

    def on_train_batch_begin(self, batch, logs=None):
        _Steps.step += 1
        _Steps.last_begin_batch = batch
        stall.mark(_Steps.step, stall.BATCH_BEGIN)
        timeline.phase("on_train_batch_begin", "callbacks", _Steps.step)

    def on_train_batch_end(self, batch, logs=None):
        stall.mark(_step_of_end(batch), stall.BATCH_END)
        timeline.phase("on_train_batch_end", "callbacks", _step_of_end(batch))
        report_progress()

    def on_test_begin(self, logs=None):
        stall.mark(_Steps.step, stall.VALIDATION)
        timeline.phase("validation", "other", _Steps.step)

    def on_epoch_end(self, epoch, logs=None):
        stall.mark(_Steps.step, stall.EPOCH_END, f"epoch {epoch + 1}")
        timeline.phase("on_epoch_end", "callbacks", _Steps.step)


class LastProbe(keras.callbacks.Callback):
    """Runs after every other callback of the fit."""

    async_safe = True

    def on_train_batch_begin(self, batch, logs=None):
        stall.mark(_Steps.step, stall.TRAIN_STEP)
        timeline.phase("train step", "step", _Steps.step)

    def on_train_batch_end(self, batch, logs=None):
        stall.mark(_step_of_end(batch), stall.AFTER_STEP)
        # Until the next mark: Keras's loop, and where Keras reads batches in Python (JAX,
        # torch, TensorFlow fed by the prefetcher) the wait for the next one.
        timeline.phase("next batch", "input", _step_of_end(batch))

    def on_train_end(self, logs=None):
        stall.mark(_Steps.step, stall.FIT_END)
        timeline.phase(None)


def wanted() -> bool:
    """Whether a fit should carry the probes: the inspector runs, the timeline records or the
    efficiency report is on, or mgpu-train asks for the progress marker (restarts)."""
    return (stall.active() or timeline.recording() or settings.flag("MGPU_PROGRESS_MARKER")
            or (runtime.is_initialized() and settings.flag("MGPU_EFFICIENCY_REPORT")))


def add_probes(arguments: Dict[str, Any]) -> None:
    """Put the probes first and last in the callbacks of a ``fit`` call (its bound arguments)."""
    first, last = FirstProbe(), LastProbe()
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks.insert(0, first)
        callbacks.callbacks.append(last)
        if callbacks.model is not None:
            first.set_model(callbacks.model)
            last.set_model(callbacks.model)
    else:
        arguments["callbacks"] = [first, *list(callbacks or []), last]
