"""Learning-rate warm-up and schedules with Horovod's semantics, that reach the compiled step.

How a new learning rate reaches Keras's compiled train step on every backend: a float learning
rate lives in an optimizer variable, so assigning ``optimizer.learning_rate`` changes what the
next step reads (on JAX, touching ``callback.model`` first writes the step's state back into the
variables, and the fit loop re-reads them after the callback). A ``LearningRateSchedule`` cannot
be assigned: its output is multiplied instead, by the DistributedOptimizer's ``lr_multiplier``
variable (see :func:`lr_target`).

Momentum correction (Goyal et al.): for the batch where the learning rate moves from ``old`` to
``new``, Horovod multiplies the momentum coefficient by ``new / old`` and restores it after the
batch. Keras 3 optimizers keep ``momentum`` as a Python float that is baked into the compiled
step at trace time, so changing it would silently do nothing. The same update is obtained by
scaling the *velocity* slots (optimizer variables) by ``new / old`` before the batch:
``momentum * (r * v) - new * g == (momentum * r) * v - new * g``. This is done for optimizers
whose velocity slots we know (SGD's ``momentums``, RMSprop's ``_momentums``); any other
optimizer with a non-zero ``momentum`` is refused with a clear error rather than pretended to.
"""

from typing import Callable, Optional, Union

import keras

from mgpu_launch import keras_internals, runtime


def _innermost(optimizer):
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def velocity_slots(optimizer) -> list:
    """The momentum buffers that carry the learning rate, or [] when there is no momentum.

    Raises:
        ValueError: the optimizer has momentum but keeps it in a way we cannot correct.
    """
    inner = _innermost(optimizer)
    if not float(getattr(inner, "momentum", 0.0) or 0.0) or not inner.built:
        return []  # no momentum, or no step taken yet (TF builds in the first step): v == 0
    slots = keras_internals.momentum_slots(inner)
    if slots:
        return slots
    raise ValueError(
        f"momentum_correction=True, but {type(inner).__name__} keeps its momentum in a way "
        f"mgpu_launch cannot correct (no velocity slots found). Pass momentum_correction=False.")


def correct_momentum(optimizer, ratio: float) -> int:
    """Scale the velocity slots by ``ratio`` (the learning rate's new / old); how many.

    Raises:
        ValueError: as :func:`velocity_slots`.
    """
    slots = velocity_slots(optimizer)
    for velocity in slots:
        velocity.assign(velocity * ratio)
    return len(slots)


def lr_target(optimizer):
    """Where the callback writes: ``("value", optimizer)`` for a float learning rate, or
    ``("multiplier", variable)`` for a LearningRateSchedule wrapped by DistributedOptimizer."""
    inner = _innermost(optimizer)
    schedule = keras_internals.raw_learning_rate(inner)
    if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return "value", optimizer
    multiplier = getattr(optimizer, "lr_multiplier", None)
    if multiplier is None:
        raise ValueError(
            "the optimizer's learning rate is a LearningRateSchedule, which a callback cannot "
            "overwrite. Wrap the optimizer in mgpu.DistributedOptimizer: the callback then "
            "multiplies the schedule's output (lr = schedule(step) * factor).")
    return "multiplier", multiplier


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier`` between two epochs (Horovod's).

    Args:
        initial_lr: the learning rate the multiplier applies to (already scaled by size,
            e.g. ``mgpu.scale_lr(0.1)``). Ignored when the optimizer's learning rate is a
            ``LearningRateSchedule``: then the schedule's output is multiplied.
        multiplier: a number ``m`` (the factor is ``m ** (epoch - start_epoch)``) or a
            callable ``epoch -> factor``.
        start_epoch: first epoch (inclusive) the callback acts on.
        end_epoch: first epoch it no longer acts on (None: until the end).
        staircase: change once per epoch (integer epochs); False changes every batch with
            the fractional epoch ``e + b / steps_per_epoch``.
        momentum_correction: keep ``learning_rate x velocity`` consistent when the rate changes
            (see the module docstring for how this reaches the compiled step).
        steps_per_epoch: batches per epoch; taken from ``fit``'s params when None.
        verbose: print the new rate on rank 0 when it changes at an epoch start.

    Example:
        >>> # divide the rate by 10 at epochs 30, 60 and 80 (Goyal et al.'s ImageNet recipe)
        >>> callbacks = [LearningRateScheduleCallback(lr, 1.0, start_epoch=5, end_epoch=30),
        ...              LearningRateScheduleCallback(lr, 1e-1, start_epoch=30, end_epoch=60)]
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (
            lambda epoch: float(multiplier) ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.current_epoch = 0
        self._factor = None  # the factor the optimizer holds now (None: not set by us yet)

    # -- the value ----------------------------------------------------------------------------
    def factor(self, epoch: int, batch: int) -> float:
        """The learning-rate factor (relative to initial_lr) for this batch."""
        return float(self.multiplier(epoch if self.staircase else
                                     epoch + batch / self.steps_per_epoch))

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    # -- Keras hooks ----------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise ValueError(
                f"{type(self).__name__}: the number of batches per epoch is unknown (fit was "
                f"given a dataset of unknown length). Pass steps_per_epoch=... to the callback "
                f"(or to fit).")
        self._kind, self._target = lr_target(self.model.optimizer)
        self._factor = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if not self._active(epoch) or (self.staircase and batch > 0 and self._factor is not None):
            return
        new = self.factor(epoch, batch)
        if new == self._factor:
            return
        optimizer = self.model.optimizer  # on JAX this writes the step's state back first
        old = self._current_lr()
        if self._kind == "value":
            optimizer.learning_rate = self.initial_lr * new
        else:
            self._target.assign(new)
        if self.momentum_correction and old:
            correct_momentum(optimizer, self._current_lr() / old)
        if self.verbose and batch == 0 and runtime.state.rank == 0:
            print(f"\nEpoch {epoch + 1}: {type(self).__name__} set the learning rate to "
                  f"{self._current_lr():.6g}.")
        self._factor = new

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._current_lr()

    def _current_lr(self) -> float:
        return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the first epochs.

    Horovod's (and Goyal et al.'s) gradual warm-up, updated every batch: with ``s`` batches per
    epoch, at epoch ``e`` and batch ``b``, ``t = e + (b + 1) / s`` and
    ``lr = initial_lr / size * (t * (size - 1) / warmup_epochs + 1)``, for ``e < warmup_epochs``.
    Afterwards the rate stays at ``initial_lr`` (until another callback changes it).

    Args:
        initial_lr: the rate to reach, usually ``mgpu.scale_lr(base_lr)``.
        warmup_epochs: epochs the ramp lasts.
        momentum_correction, steps_per_epoch, verbose: as in LearningRateScheduleCallback.

    With a ``LearningRateSchedule`` the schedule's output is multiplied by the same ramp
    (``lr / initial_lr``), so the warm-up composes with e.g. cosine decay.

    Example:
        >>> lr = mgpu.scale_lr(0.0125)
        >>> callbacks = [mgpu.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=5)]
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__(initial_lr, self._ramp, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def _ramp(self, epoch: float) -> float:
        size = runtime.size() if runtime.is_initialized() else 1
        t = epoch + 1.0 / self.steps_per_epoch
        return 1.0 / size * (t * (size - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.warmup_epochs - 1 and runtime.state.rank == 0:
            print(f"\nEpoch {epoch + 1}: finished the learning-rate warm-up at "
                  f"{self._current_lr():.6g}.")
