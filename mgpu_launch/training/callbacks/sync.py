"""Callbacks that keep the ranks in step: same start, same (averaged) epoch metrics."""

import keras
import numpy as np

from mgpu_launch import backends, runtime
from mgpu_launch.runtime import collectives


def model_state_variables(model):
    """Model weights and optimizer state, without seed-generator states (those stay per rank)."""
    variables = [v for v in model.variables if "seed_generator" not in v.path]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built and not holds_sharded_state(optimizer):
        variables += [v for v in optimizer.variables if "seed_generator" not in v.path]
    return variables


def holds_sharded_state(optimizer) -> bool:
    """Whether `optimizer` is a DistributedOptimizer whose state is sharded: its variables
    differ between ranks by design, so they are not broadcast; a loaded state reaches the
    ranks through :func:`scatter_sharded_state` (``training/sharded_saving.py``)."""
    from mgpu_launch.training.optimizer import DistributedOptimizer  # same layer, built later
    return isinstance(optimizer, DistributedOptimizer) and optimizer.holds_sharded_state()


def sharded_state_variables(model) -> list:
    """This rank's part of a sharded optimizer's state (what :func:`model_state_variables`
    leaves out), for a snapshot kept in this process; [] when not sharded."""
    optimizer = getattr(model, "optimizer", None)
    return list(optimizer.variables) if holds_sharded_state(optimizer) else []


def gather_sharded_state(model) -> None:
    """Collective, before rank 0 saves `model`: a sharded optimizer's whole state to rank 0."""
    if holds_sharded_state(getattr(model, "optimizer", None)):
        model.optimizer.gather_state()


def scatter_sharded_state(model, root_rank: int) -> None:
    """Collective, after `root_rank` loaded `model`: each rank its part of a sharded state."""
    if holds_sharded_state(getattr(model, "optimizer", None)):
        model.optimizer.scatter_state(root_rank)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank rank `root_rank`'s weights and optimizer state.

    ``DistributedOptimizer`` already broadcasts the trainable weights when it is built; this
    callback also covers non-trainable weights (e.g. BatchNorm statistics loaded from a
    checkpoint) and is harmless to combine with it.

    Args:
        root_rank: the rank whose state everyone starts from.

    Example:
        >>> model.fit(x, y, callbacks=[mgpu.callbacks.BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs=None):
        if runtime.is_multi_process():
            backends.get_engine().broadcast_variables(model_state_variables(self.model),
                                                     self.root_rank)
            scatter_sharded_state(self.model, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's metric logs by their average over the ranks.

    Put it before callbacks that read the logs (checkpointing, early stopping, CSV logging) so
    they decide on the same, averaged numbers on every rank. Keys are reduced in sorted order,
    in one collective, so every rank issues the same call.
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs or not runtime.is_multi_process():
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        everyone = collectives.allgather_object(keys)
        if any(other != keys for other in everyone):
            raise collectives.MismatchError(
                f"MetricAverageCallback: ranks log different metrics at epoch {epoch}: "
                + "; ".join(f"rank {r}: {k}" for r, k in enumerate(everyone)))
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = collectives.allreduce(values, op=collectives.Average)
        for key, value in zip(keys, averaged):
            logs[key] = float(value)
