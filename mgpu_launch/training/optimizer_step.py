"""The update inside ``DistributedOptimizer.apply``, apart from the reduction itself.

Three pieces, each the same on every backend:

- :func:`apply_inner`: the wrapped optimizer's update. Keras's JAX step is a pure function
  (``stateless_apply`` inside a ``StatelessScope``); a wrapped optimizer with a stateless path
  of its own (``LossScaleOptimizer``: its ``apply`` runs ``ops.cond`` over stateful branches,
  whose traced values would leak out of ``jax.lax.cond``) must be called through that path.
- :class:`Accumulation`: ``backward_passes_per_step > 1``, local gradients summed over the
  passes, one reduction and one update at the last pass of each window. ``iterations`` counts
  updates (Keras's ``gradient_accumulation_steps`` convention) or, under Horovod's names,
  backward passes (Horovod's: ``iterations == step + 1`` after every pass).
- :class:`_MultipliedSchedule`: what a wrapped ``LearningRateSchedule`` becomes: its output
  times the LR callbacks' multiplier, and, under accumulation, called with the number of
  backward passes, as Keras's own ``gradient_accumulation_steps`` calls it (and as Horovod's
  does, whose ``iterations`` already counts them).
"""

import contextlib
from typing import Any, Callable, List, Optional

import keras
from keras import ops

from mgpu_launch import keras_internals


def innermost(optimizer):
    """The optimizer at the bottom of a chain of wrappers (``inner_optimizer`` attributes)."""
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def in_stateless_step() -> bool:
    """Whether variables are read and written through a Keras ``StatelessScope`` (JAX step)."""
    return keras_internals.in_stateless_scope()


def apply_inner(inner, grads: List[Any], trainable_variables,
                schedule: Optional["_MultipliedSchedule"] = None) -> None:
    """``inner.apply(grads, trainable_variables)``, also correct inside a stateless step.

    Inside a ``StatelessScope`` the wrapped optimizer runs its own ``stateless_apply`` on the
    scope's current values, and the results are assigned back into the scope. Keras's nested
    scopes do not see each other: variables the wrapped optimizer reads but does not own
    (our schedule's multiplier and pass counter) are pinned to their current values first.
    """
    if not in_stateless_step():
        inner.apply(grads, trainable_variables)
        return
    variables = list(keras_internals.built_variables(inner))
    if trainable_variables is not None and [id(v) for v in trainable_variables] != [
            id(v) for v in variables]:
        raise ValueError(
            f"inside a stateless (JAX) train step the wrapped {type(inner).__name__} updates the "
            f"{len(variables)} variables it was built with; got a different list of "
            f"{len(trainable_variables)}. Pass the gradients of all of them (None where a "
            f"variable has none), in the order the optimizer was built with.")
    pinned = schedule.pinned() if schedule is not None else contextlib.nullcontext()
    with pinned:
        new_trainable, new_state = inner.stateless_apply(
            [v.value for v in inner.variables], list(grads), [v.value for v in variables])
    for variable, value in zip(variables, new_trainable):
        variable.assign(value)
    for variable, value in zip(inner.variables, new_state):
        variable.assign(value)


class Accumulation:
    """Sum local gradients over `passes` backward passes; reduce and update at the last one.

    The variables belong to `owner` (its ``add_variable``), so a stateless step maps them.

    Args:
        owner: the DistributedOptimizer.
        var_list: the variables it was built with.
        passes: backward passes per update (>= 2).
        average: divide the sum by `passes` before the reduction (else keep the sum).
        iterations: None (Keras's convention: the wrapped optimizer counts its updates), or
            the optimizer's ``iterations`` variable to count every backward pass in
            (Horovod's). Then the window's position is ``iterations % passes``, so a run
            restored from a backup (whose partial window is not saved) keeps the windows where
            an uninterrupted run has them.
    """

    def __init__(self, owner, var_list, passes: int, average: bool, iterations=None):
        self.passes, self.average, self.iterations = passes, average, iterations
        #: passes since the last update, 0 .. passes - 1 (a schedule adds it to the step)
        self.pass_counter = owner.add_variable(shape=(), dtype="int", initializer="zeros",
                                               name="pass_counter")
        self.sums = [owner.add_variable_from_reference(v, name="accumulated_grad")
                     for v in var_list]

    def step(self, grads: List[Any], cond_update: Callable, apply: Callable[[List[Any]], None],
             variables: List[Any]) -> None:
        """Add `grads`; at the window's last pass call ``apply(local gradients)`` and reset.

        Args:
            grads: this pass's gradients (None: no gradient).
            cond_update: the engine's ``cond_update(predicate, update, variables)``.
            apply: reduces the gradients it is given and updates the model.
            variables: every variable `apply` reads or writes, ours included (for
                ``cond_update``).
        """
        for total, grad in zip(self.sums, grads):
            if grad is not None:
                total.assign_add(ops.convert_to_tensor(grad, total.dtype))

        def reduce_and_apply():
            local = [ops.divide(s.value, self.passes) if self.average else s.value
                     for s in self.sums]
            apply(local)
            for total in self.sums:
                total.assign(ops.zeros(total.shape, total.dtype))

        if self.iterations is None:
            # The counter moves after the update, as Keras's iterations do: a schedule called
            # in the update sees the window's last pass, k * passes + passes - 1.
            cond_update(ops.equal(self.pass_counter, self.passes - 1), reduce_and_apply,
                        variables)
            self.pass_counter.assign(ops.mod(ops.add(self.pass_counter, 1), self.passes))
            return
        # Horovod's counting: the passes done after this one, computed before the update
        # (which counts itself, or not when a loss scaler skips it) as a new tensor (torch's
        # variable value would alias it); afterwards the variable holds exactly that.
        after = ops.add(self.iterations.value, 1)
        cond_update(ops.equal(ops.mod(after, self.passes), 0), reduce_and_apply, variables)
        self.iterations.assign(after)
        self.pass_counter.assign(ops.cast(ops.mod(after, self.passes), self.pass_counter.dtype))


class _MultipliedSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``schedule(step) * multiplier``: how LR callbacks scale a schedule they cannot set.

    With gradient accumulation the wrapped optimizer counts updates, while Keras's own
    ``gradient_accumulation_steps`` feeds its schedule the number of backward passes; so
    ``step`` (updates done) becomes ``step * passes + pass_counter``: the same numbers. Under
    Horovod's counting ``iterations`` is the number of passes already: built with
    ``passes=1``, the step goes to the schedule as it is.
    """

    def __init__(self, schedule, multiplier, passes: int = 1):
        self.schedule, self.multiplier, self.passes = schedule, multiplier, passes
        self.pass_counter = None  # the Accumulation's, once the optimizer is built
        self._pinned = None

    def __call__(self, step):
        multiplier, counter = self._pinned or (self.multiplier, self.pass_counter)
        if self.passes > 1 and counter is not None:
            dtype = keras.backend.standardize_dtype(step.dtype)
            step = ops.add(ops.multiply(step, ops.cast(self.passes, dtype)),
                           ops.cast(counter, dtype))
        value = self.schedule(step)
        return value * ops.cast(multiplier, keras.backend.standardize_dtype(value.dtype))

    @contextlib.contextmanager
    def pinned(self):
        """Use the variables' values as read now (a stateless scope's) until the block ends."""
        counter = None if self.pass_counter is None else self.pass_counter.value
        self._pinned = (self.multiplier.value, counter)
        try:
            yield
        finally:
            self._pinned = None

    def get_config(self):
        return self.schedule.get_config()
