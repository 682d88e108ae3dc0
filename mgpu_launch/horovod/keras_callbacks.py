"""``mgpu_launch.keras.callbacks``: ``horovod.tensorflow.keras.callbacks``' names.

Thin layers over ``mgpu_launch.callbacks`` that take Horovod's arguments; imported by
``mgpu_launch.keras``, which registers this module as ``mgpu_launch.keras.callbacks``.
"""

from mgpu_launch import backends, runtime
from mgpu_launch.horovod import support
from mgpu_launch.training import callbacks as _callbacks
from mgpu_launch.training.callbacks import model_state_variables

_NAME = "mgpu_launch.keras"


class BroadcastGlobalVariablesCallback(_callbacks.BroadcastGlobalVariablesCallback):
    """Horovod's: every rank starts from `root_rank`'s weights and optimizer state.

    Args:
        root_rank: the rank whose state everyone starts from.
        device: ignored (each process has one device).
        local_variables: variables each rank keeps (a variable or a list): not copied from
            `root_rank`, and registered with the model's ``DistributedOptimizer`` (its
            ``register_local_var``) so their gradients are not averaged either.

    Example:
        >>> hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=head.weights)
    """

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__(root_rank)
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple)):
            local_variables = [local_variables]
        for variable in local_variables:
            if not hasattr(variable, "assign") or not hasattr(variable, "shape"):
                support.reject(_NAME, "local_variables", local_variables, "pass variables "
                                "(e.g. layer.weights), a single one or a list.")
        self.local_variables = list(local_variables)

    def on_train_begin(self, logs=None):
        local = {id(v) for v in self.local_variables}
        optimizer = getattr(self.model, "optimizer", None)
        for variable in self.local_variables:
            register = getattr(optimizer, "register_local_var", None)
            if register is not None:
                register(variable)
        if runtime.is_multi_process():
            backends.get_engine().broadcast_variables(
                [v for v in model_state_variables(self.model) if id(v) not in local],
                self.root_rank)


class MetricAverageCallback(_callbacks.MetricAverageCallback):
    """Horovod's: average the epoch's metric logs over the ranks (`device` is ignored)."""

    def __init__(self, device=""):
        super().__init__()


class BestModelCheckpoint(_callbacks.ModelCheckpoint):
    """Horovod's: keep only the best model (``save_best_only=True``), written by rank 0.

    ``mgpu.callbacks.ModelCheckpoint`` (rank 0, atomic, the monitored value averaged over the
    ranks). Horovod's version leaves the file path to its Spark estimator; here it is
    `filepath` (default ``best_model.keras``, or ``best_model.weights.h5`` with
    ``save_weights_only``).

    Example:
        >>> hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath="ckpt/best.keras")
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", filepath=None):
        if filepath is None:
            filepath = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)


LearningRateWarmupCallback = _callbacks.LearningRateWarmupCallback
LearningRateScheduleCallback = _callbacks.LearningRateScheduleCallback

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "BestModelCheckpoint",
           "LearningRateWarmupCallback", "LearningRateScheduleCallback"]
