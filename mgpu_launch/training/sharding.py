"""Sharding a ``DistributedOptimizer``'s state across ranks (ZeRO stage 1, issue 60).

With ``DistributedOptimizer(opt, shard_optimizer_state=True)`` each rank keeps the optimizer's
state (Adam's two moments, SGD's momentum, ...) for some of the model's variables only, and the
updated weights are shared after every update. With AdamW in float32 a parameter costs 4 bytes
of weight, 4 of gradient and 8 of state: at N ranks the state shrinks to about 1/N of its
size on each rank (docs/training-recipe.md, "Sharding the optimizer state", has the arithmetic).

How a step goes (:meth:`ShardedState.apply`), each part chosen so that the result is the
unsharded one, bit for bit on every rank:

1. The gradients are reduced exactly as without sharding (the engine's allreduce: averaging,
   compression, accumulation, fused buffers, torch's reduction during backward). Every rank
   then holds every reduced gradient; ZeRO's reduce-scatter would save that memory too, but
   it would change how each gradient is summed, and so the numbers.
2. ``global_clipnorm`` clips with the norm of the *whole* gradient, computed by Keras's own
   function on the full list before the split (the inner optimizer's own global clipping is
   off during its update, which sees a part only). Under a ``LossScaleOptimizer`` every rank
   decides on the finiteness of the whole gradient: the first gradient of a rank's part becomes
   NaN when any gradient is not finite, so the loss scaler skips (and lowers its scale) on
   every rank alike.
3. Each rank's inner optimizer (built with the variables it owns only: its slots exist for
   them alone, which is the memory saved) updates those variables; ``iterations``, the
   learning rate and its schedule advance on every rank as without sharding.
4. Every rank receives the owners' new values: one more in-step sum (the engine's
   ``allreduce``, uncompressed) where the owner sends the value and every other rank zeros.
   Adding zeros is exact in IEEE arithmetic (``x + 0 == x`` for every x but -0.0, which
   becomes +0.0, the same number), whatever the order or tree of the sum (JAX's psum, TF's
   CollectiveReduceV2 / ring, torch's gloo or NCCL all_reduce), so every rank gets the
   owner's value bit for bit. It moves as many bytes as the gradient allreduce; a broadcast
   from each owner (or an allgather of flat slices) would move half, and is left for later.

Ownership is per variable: each variable's state lives on one rank, chosen greedily (largest
first, onto the rank with the fewest bytes so far; ties to the lower rank, so every rank
computes the same table from the same list). Each rank then holds at most ``total / N`` plus
the largest variable's share: a variable larger than ``total / N`` (a big embedding, a language
model's output projection) fills one rank on its own. Flat slices (every variable cut across
the ranks, as ZeRO and torch's ``ZeroRedundancyOptimizer`` with ``parameters_as_bucket_view``
do) would balance exactly, but Keras's optimizers update whole variables: LAMB's trust ratio
and Muon's orthogonalization need the whole matrix, AdamW's ``exclude_from_weight_decay`` and
Muon's choice of rule go by variable, and a slice would need a second, slice-shaped copy of
every variable. Per-variable ownership keeps Keras's optimizers as they are.

Refused, at construction and on every rank alike (:func:`check_shardable`): optimizers whose
update may read more than one variable or that mgpu cannot see into (anything but Keras's own
per-variable optimizers, listed in :data:`SHARDABLE`, e.g. a subclass with its own ``apply``),
wrappers other than ``LossScaleOptimizer``, ``use_ema`` (Keras's final copy of the averages
would reach the owned variables only), ``global_clipnorm`` where the norm is taken after an
unscaling mgpu does not see (a ``LossScaleOptimizer``, ``loss_scale_factor``, Keras's own
``gradient_accumulation_steps``), and a process set. At build: a model with fewer shared
variables than ranks (a rank would own nothing, and Keras's update of an empty list does not
count ``iterations``).

Files hold the whole state in plain Keras's layout (``sharded_saving``: gathered to rank 0
before a save, each rank's part taken at a load). docs/training-recipe.md, "Sharding the
optimizer state", says when sharding pays.
"""

import contextlib
from typing import Any, List, Optional, Sequence

import keras
from keras import ops

from mgpu_launch import keras_internals

__all__ = ["SHARDABLE", "assign_owners", "check_shardable", "ShardedState", "state_bytes"]

#: Keras's optimizers whose update of a variable reads that variable, its gradient and its own
#: slots only (plus step-wide scalars: iterations, the rate), so they can be split by variable
SHARDABLE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
             "Lion", "Ftrl", "Lamb", "Adafactor", "Muon")


def assign_owners(sizes: Sequence[int], ranks: int) -> List[int]:
    """The rank that owns each item of `sizes`: largest first, onto the least-loaded rank.

    Deterministic: the result depends on `sizes` and `ranks` only (ties go to the earlier item
    and the lower rank). With at least `ranks` items of positive size every rank owns one, and
    no rank holds more than ``sum(sizes) / ranks + max(sizes)``.

    Example:
        >>> assign_owners([10, 3, 3, 4], 2)
        [0, 1, 1, 1]
    """
    if ranks < 1:
        raise ValueError(f"assign_owners: ranks={ranks!r}; expected an integer >= 1")
    owners = [0] * len(sizes)
    loads = [0] * ranks
    for index in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += int(sizes[index])
    return owners


def _chain(optimizer) -> list:
    """`optimizer` and every optimizer it wraps, outermost first."""
    chain = [optimizer]
    while hasattr(chain[-1], "inner_optimizer"):
        chain.append(chain[-1].inner_optimizer)
    return chain


def _is_keras_own(optimizer, names: Sequence[str]) -> Optional[str]:
    """The name in `names` of the Keras class `optimizer` is (a backend's variant of it
    included), or None: a user's subclass may have its own update."""
    cls = type(optimizer)
    if not cls.__module__.startswith("keras."):
        return None
    for name in names:
        public = getattr(keras.optimizers, name, None)
        if public is not None and isinstance(optimizer, public):
            return name
    return None


def check_shardable(optimizer) -> None:
    """Raise unless `optimizer` (what ``DistributedOptimizer`` wraps) can have its state split
    by variable with the same results as unsharded.

    Raises:
        ValueError: the reason, what is accepted, and the fix.
    """
    chain = _chain(optimizer)
    *wrappers, base = chain
    for wrapper in wrappers:
        if not _is_keras_own(wrapper, ("LossScaleOptimizer",)):
            raise ValueError(
                f"shard_optimizer_state=True: the wrapped {type(wrapper).__name__} wraps "
                f"another optimizer, and mgpu cannot tell what its update reads across "
                f"variables; only keras.optimizers.LossScaleOptimizer may wrap the optimizer "
                f"whose state is sharded. Remove the wrapper or shard_optimizer_state.")
    if not _is_keras_own(base, SHARDABLE):
        raise ValueError(
            f"shard_optimizer_state=True: {type(base).__module__}.{type(base).__name__} is not "
            f"one of Keras's per-variable optimizers ({', '.join(SHARDABLE)}); its update may "
            f"read other variables than the one it updates (or mgpu cannot see its apply), so "
            f"splitting its state by variable could change the results. Use one of those, or "
            f"shard_optimizer_state=False.")
    if base.use_ema:
        raise ValueError(
            "shard_optimizer_state=True with use_ema=True: Keras copies the moving averages "
            "into the model at the end of fit, and each rank holds those of its own variables "
            "only. Use use_ema=False, or shard_optimizer_state=False.")
    if base.global_clipnorm:
        scaled = [why for why, present in (
            ("a LossScaleOptimizer", bool(wrappers)),
            ("loss_scale_factor", base.loss_scale_factor is not None),
            ("gradient_accumulation_steps", bool(base.gradient_accumulation_steps))) if present]
        if scaled:
            raise ValueError(
                f"shard_optimizer_state=True with global_clipnorm={base.global_clipnorm} and "
                f"{scaled[0]}: Keras takes the global norm after unscaling (or accumulating) "
                f"the gradients inside the optimizer, where each rank sees its own variables' "
                f"part only. Use clipnorm (per variable), DistributedOptimizer("
                f"backward_passes_per_step=...) for accumulation, or shard_optimizer_state="
                f"False.")


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer state this rank holds: every variable of the optimizer a
    ``DistributedOptimizer`` wraps (slots, counters, the loss scale; not the wrapper's own
    accumulation buffers, which hold gradients). 0 before the optimizer is built."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not inner.built:
        return 0
    return sum(_bytes(v) for v in inner.variables)


def _bytes(variable) -> int:
    count = 1
    for dimension in variable.shape:
        count *= int(dimension)
    return count * _itemsize(variable.dtype)


def _itemsize(dtype) -> int:
    """Bytes per element of a Keras dtype ("bfloat16" and the float8s by their bit count)."""
    import re

    import numpy as np

    name = keras.backend.standardize_dtype(dtype)
    try:
        return np.dtype(name).itemsize
    except TypeError:
        bits = re.search(r"(\d+)", name)
        return int(bits.group(1)) // 8 if bits else 4


class ShardedState:
    """Which rank owns which variable's optimizer state, and the sharded update.

    Args:
        variables: the trainable variables the ``DistributedOptimizer`` was built with.
        local: those kept per rank (``register_local_var``): every rank updates its own.
        rank, size: this rank and the number of ranks.

    Raises:
        ValueError: fewer shared variables than ranks (the message says what to do).
    """

    def __init__(self, variables: Sequence[Any], local: Sequence[Any], rank: int, size: int):
        local_ids = {id(v) for v in local}
        self.variables = list(variables)
        self.shared = [v for v in self.variables if id(v) not in local_ids]
        if len(self.shared) < size:
            raise ValueError(
                f"shard_optimizer_state=True: the model has {len(self.shared)} shared trainable "
                f"variables for {size} ranks, so some rank would own none (and Keras does not "
                f"count the update of an empty list). Use shard_optimizer_state=False: a model "
                f"this small gains nothing from sharding.")
        #: the owning rank of each shared variable, in their order
        self.owners = assign_owners([_bytes(v) for v in self.shared], size)
        self.rank = rank
        owned_ids = {id(v) for v, owner in zip(self.shared, self.owners) if owner == rank}
        #: what this rank's inner optimizer is built with and updates, in the model's order
        self.owned = [v for v in self.variables if id(v) in owned_ids or id(v) in local_ids]
        self._owned_ids = {id(v) for v in self.owned}

    def apply(self, inner, grads: List[Any], variables, engine, apply_inner,
              schedule=None) -> None:
        """Update with the reduced `grads` of `variables`: clip over the whole gradient, the
        owned part through `inner`, then the new values to every rank.

        Args:
            inner: the wrapped optimizer (built with :attr:`owned`).
            grads: every variable's reduced gradient, in the order of `variables`.
            variables: the trainable variables the optimizer was built with (any order).
            engine: the backend's engine (its in-step ``allreduce``).
            apply_inner: ``optimizer_step.apply_inner`` (the stateless path on JAX).
            schedule: the DistributedOptimizer's multiplied schedule, if any.
        """
        chain = _chain(inner)
        base = chain[-1]
        by_id = {id(v): g for v, g in zip(variables, grads)}
        grads = [by_id[id(v)] for v in self.variables]  # the order the owners were drawn in
        if base.global_clipnorm:
            grads = keras_internals.clip_by_global_norm(grads, base.global_clipnorm)
        owned = [g for g, v in zip(grads, self.variables) if id(v) in self._owned_ids]
        if len(chain) > 1:  # a loss scaler decides on the whole gradient, on every rank alike:
            # one NaN in this rank's part when any gradient is not finite makes it skip here too
            finite = ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in grads]))
            first = engine.densify(owned[0]) if engine.is_sparse(owned[0]) else owned[0]
            owned[0] = ops.where(finite, first, ops.cast(float("nan"), first.dtype))
        with _global_clipping_off(base):
            apply_inner(inner, owned, self.owned, schedule)
        self._share(engine)

    def _share(self, engine) -> None:
        """Every shared variable gets its owner's value: a sum of it and zeros (exact)."""
        sent = [v.value if owner == self.rank else ops.zeros_like(v.value)
                for v, owner in zip(self.shared, self.owners)]
        for variable, value in zip(self.shared, engine.allreduce(sent, average=False)):
            variable.assign(value)


@contextlib.contextmanager
def _global_clipping_off(optimizer):
    """The optimizer's own ``global_clipnorm`` off while it updates a part of the model (the
    whole gradient was clipped already); restored afterwards."""
    clip = optimizer.global_clipnorm
    optimizer.global_clipnorm = None
    try:
        yield
    finally:
        optimizer.global_clipnorm = clip
