"""The first step of a ``DistributedOptimizer``: the same weights on every rank that reduces.

Before the first update every rank of the reduction (every rank, or the members of the
optimizer's process set) checks that they all hold the same variables, then receives the
root's values: rank 0's, or the set's first rank's. A rank outside the optimizer's set trains
alone and takes part in none of it. Where the variables can be read on the host, the copy is a
host broadcast before the step; variables created inside TensorFlow's traced step (a lazily
built model) are copied inside the first executed step instead, as a sum of the root's values
and zeros from the others.
"""

from typing import Callable, Optional

import keras
from keras import ops

from mgpu_launch import backends, keras_internals, runtime
from mgpu_launch.runtime import collectives, process_sets
from mgpu_launch.runtime.collectives import MismatchError


def reduction_group(process_set) -> Optional[process_sets.Group]:
    """The registered set behind an optimizer's `process_set`; None for every rank.

    Raises:
        ValueError: `process_set` is not registered (or was removed).
    """
    if process_set is None or process_set is process_sets.global_process_set:
        return None
    group = process_sets.group_of(process_set, "DistributedOptimizer", member=False)
    return group if group.process_set_id else None


def root_rank(group: Optional[process_sets.Group]) -> int:
    """The rank whose weights the others receive: 0, or the set's first rank."""
    return 0 if group is None else group.ranks[0]


class RootSync:
    """An optimizer's first-step copy of the root's weights, with its state: whether it is
    done, whether it waits for the first executed step (``in_step``).

    Args:
        process_set: the optimizer's (None: every rank).
        shared: `variables` -> those the ranks share (not kept per rank).
        flag: the optimizer's integer variable that keeps the in-step copy to one step.
    """

    def __init__(self, process_set, shared: Callable[[list], list], flag):
        self.process_set = process_set
        self.shared = shared
        self.flag = flag
        self.done = False
        self.in_step = False

    def from_root(self, trainable) -> None:
        """Once: check the ranks of the reduction hold the same `trainable` variables, then
        copy the root's values to them (or mark the copy for the first step, ``in_step``).

        Keras may build the optimizer while it traces the step symbolically, when variables
        have no values yet; then the sync waits for the first real step (``apply``).
        """
        if self.done or not runtime.is_multi_process():
            return
        if keras_internals.in_stateless_scope() or keras_internals.in_symbolic_scope():
            return
        group = reduction_group(self.process_set)
        if group is not None and runtime.rank() not in group.ranks:
            self.done = True  # outside the set: this rank trains alone
            return
        check_same_variables(trainable, "the model's trainable variables", group)
        # Only the model's weights: fresh optimizer slots are equal (zeros) on every rank, and
        # slots created inside the step's trace cannot be read back yet.
        engine = backends.get_engine()
        if engine.readable_on_host(trainable):
            engine.broadcast_variables(self.shared(trainable), root_rank(group), group)
        else:  # created inside the step's trace (TF, lazily built models): sync in the step
            self.in_step = True
        self.done = True

    def broadcast_in_step(self, variables) -> None:
        """At the first executed step: the root's values, as a sum of (the root's, zeros,
        ...); ``flag`` keeps it to that step."""
        engine = backends.get_engine()
        group = reduction_group(self.process_set)
        is_root = runtime.rank() == root_rank(group)
        within = {} if group is None else {"group": group}
        variables = self.shared(variables)
        flag = self.flag

        def copy_from_root():
            sent = [v.value if is_root else ops.zeros_like(v.value) for v in variables]
            for variable, value in zip(variables,
                                       engine.allreduce(sent, average=False, **within)):
                variable.assign(value)
            flag.assign(1)

        engine.cond_update(ops.equal(flag, 0), copy_from_root, list(variables) + [flag])


def check_same_variables(variables, what: str, group=None) -> None:
    """Raise MismatchError on every rank (of process set `group`) unless all hold the same
    variables.

    Compares count, shapes and dtypes (not values) with the first rank's, and names the first
    variable that differs.
    """
    # A raw tf.Variable (accepted by Keras optimizers on TF) has a name but no path.
    mine = [(getattr(v, "path", None) or v.name, tuple(v.shape),
             keras.backend.standardize_dtype(v.dtype)) for v in variables]
    everyone = collectives.allgather_object(mine, process_set=group)
    ranks = list(range(len(everyone))) if group is None else list(group.ranks)
    reference, first = everyone[0], ranks[0]
    for rank, theirs in zip(ranks[1:], everyone[1:]):
        for index, (ours, other) in enumerate(zip(reference, theirs)):
            if ours[1:] != other[1:]:
                raise MismatchError(
                    f"{what} differ between ranks: variable #{index} is {other[0]!r} "
                    f"{other[1]} {other[2]} on rank {rank} but {ours[0]!r} {ours[1]} {ours[2]} "
                    f"on rank {first}. Every rank must build the same model.")
        if len(theirs) != len(reference):
            raise MismatchError(
                f"{what} differ between ranks: rank {rank} has {len(theirs)} variables, rank "
                f"{first} has {len(reference)}. Every rank must build the same model.")
