"""Saving and loading the state of a sharded optimizer (issue 60) as plain Keras files.

A sharded optimizer's ranks each hold the slots of their own variables
(``mgpu_launch.training.sharding``), while a ``.keras`` or ``.weights.h5`` file holds the
optimizer Keras would have built on every variable, in its order. Both ways go through a
*full copy*: the wrapped optimizer made again from its config and built, on the host's CPU
device, with every variable (what one unsharded process holds), and matched to the ranks'
variables by name (Keras names a slot after its model variable's path, the same on every rank;
the step-wide scalars, ``iterations``, the rate, a loss scaler's, are alike on every rank).

- Saving: :func:`gather` (a collective, every rank) sends every rank's optimizer variables to
  the root, which fills its full copy; the root's ``save_own_variables`` then writes that copy,
  the plain layout, which plain Keras loads with the full state. ``mgpu.callbacks
  .ModelCheckpoint`` gathers before every save; a script that saves by hand calls
  ``optimizer.gather_state()`` on every rank first. A save without a gather at the optimizer's
  current step is refused (never a file with part of the state).
- Loading: a rank that loads a file (``load_own_variables``) reads it into a full copy and
  keeps the slots of the variables it owns now, which re-shards a file of any number of ranks,
  or of an unsharded run. When only the root loads (``BackupAndRestore``,
  ``BroadcastGlobalVariablesCallback`` after a load on rank 0), :func:`scatter` (a collective)
  hands every rank its part of the root's full copy.

The full copy costs the root the unsharded state's memory while it saves or loads (on the CPU
device), and the transfer goes through the host collectives (MPI, pickled numpy arrays).
"""

import contextlib
from typing import Dict, Optional

import keras
import numpy as np

from mgpu_launch import runtime
from mgpu_launch.runtime import collectives

__all__ = ["FullCopy", "gather", "write", "read", "scatter"]


def _values(optimizer) -> Dict[str, np.ndarray]:
    """The optimizer's variables (a wrapped loss scaler's own included) by name, on the host.

    Raises:
        ValueError: two variables share a name (they could not be told apart in a file).
    """
    values = {}
    for variable in optimizer.variables:
        if variable.name in values:
            raise ValueError(f"sharded optimizer state: two variables of {optimizer.name} are "
                             f"named {variable.name!r}, so the ranks' parts cannot be matched "
                             f"to the saved layout. Give the model's layers unique names.")
        values[variable.name] = np.asarray(keras.ops.convert_to_numpy(variable.value))
    return values


def _fill(variables, values: Dict[str, np.ndarray], what: str) -> None:
    """Assign each of `variables` the value of its name in `values`.

    Raises:
        ValueError: a variable has no value, or one of another shape (never a partial fill).
    """
    missing = [v.name for v in variables if v.name not in values]
    wrong = [v.name for v in variables
             if v.name in values and tuple(values[v.name].shape) != tuple(v.shape)]
    if missing or wrong:
        raise ValueError(f"sharded optimizer state: {what}: "
                         + (f"no value for {missing[:3]}" if missing else "")
                         + ("; " if missing and wrong else "")
                         + (f"another shape for {wrong[:3]}" if wrong else "")
                         + ". The optimizer and the model must be those the state was saved "
                           "from.")
    for variable in variables:
        variable.assign(values[variable.name])


class FullCopy:
    """The wrapped optimizer as one unsharded process holds it, built on the CPU device.

    Args:
        serialized: the wrapped optimizer, serialized (``DistributedOptimizer``'s
            ``_serialized_inner``: the user's schedule, not mgpu's).
        variables: every trainable variable the DistributedOptimizer was built with.
        step: the optimizer's ``iterations`` when the copy was filled (None: from a file).
    """

    def __init__(self, serialized: dict, variables, step: Optional[int] = None):
        try:
            self._build(serialized, variables, keras.device("cpu:0"))
        except (ValueError, RuntimeError):  # no CPU device for this backend's arrays here
            self._build(serialized, variables, contextlib.nullcontext())
        self.step = step

    def _build(self, serialized: dict, variables, where) -> None:
        with where:
            self.optimizer = keras.saving.deserialize_keras_object(serialized)
            self.optimizer.build(list(variables))

    def values(self) -> Dict[str, np.ndarray]:
        return _values(self.optimizer)


def _step(inner) -> int:
    return int(np.asarray(keras.ops.convert_to_numpy(inner.iterations.value)))


def gather(inner, serialized: dict, variables, root: int = 0) -> Optional[FullCopy]:
    """Every rank's part of the state, in one full copy on `root` (a collective: every rank
    calls it; the others get None)."""
    parts = runtime.state.transport.gather_object(_values(inner), root)
    if runtime.rank() != root:
        return None
    merged: Dict[str, np.ndarray] = {}
    for part in parts[::-1]:  # the root's last: its scalars win (they are alike anyway)
        merged.update(part)
    copy = FullCopy(serialized, variables, _step(inner))
    _fill(copy.optimizer.variables, merged, "gathering the ranks' parts")
    return copy


def write(copy: Optional[FullCopy], inner, store) -> None:
    """Write the gathered full copy into `store` (the plain layout).

    Raises:
        NotImplementedError: no gather at the optimizer's current step on this rank.
    """
    if copy is None or copy.step != _step(inner):
        raise NotImplementedError(
            "cannot save the state of a sharded optimizer (shard_optimizer_state=True) without "
            "gathering it first: each rank holds its own variables' part. Call "
            "optimizer.gather_state() on every rank, then save on rank 0 (mgpu.callbacks"
            ".ModelCheckpoint does both); "
            + ("no gather happened yet." if copy is None else
               f"the last gather was at step {copy.step}, the optimizer is at {_step(inner)}."))
    copy.optimizer.save_own_variables(store)


def read(inner, serialized: dict, variables, store) -> FullCopy:
    """Load `store` (a plain layout, from a sharded or unsharded run of any size) into a full
    copy and this rank's optimizer its part; returns the copy (for :func:`scatter`)."""
    copy = FullCopy(serialized, variables)
    copy.optimizer.load_own_variables(store)
    _fill(inner.variables, copy.values(), "loading a file")
    copy.step = _step(inner)  # scattered only before training moves on
    return copy


def scatter(inner, copy: Optional[FullCopy], root: int = 0) -> None:
    """Every rank takes its part of the root's full copy (a collective). When the root holds
    none of the optimizer's current step (it loaded nothing since), nothing changes."""
    current = copy is not None and runtime.rank() == root and copy.step == _step(inner)
    values = collectives.broadcast_object(copy.values() if current else None, root_rank=root)
    if values is not None:
        _fill(inner.variables, values, f"receiving rank {root}'s loaded state")
