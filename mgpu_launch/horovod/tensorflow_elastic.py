"""Horovod's ``horovod.tensorflow.elastic`` names for custom TensorFlow loops, on mgpu-launch's
restart-based elastic training (the same step backups as ``mgpu_launch.keras.elastic``).

    import mgpu_launch.tensorflow as hvd        # was: import horovod.tensorflow as hvd

    @hvd.elastic.run
    def train(state):
        for batch, (images, labels) in enumerate(dataset.skip(state.batch)):
            state.batch = batch
            training_step(images, labels)        # a tf.function with DistributedGradientTape
            if state.batch % 10 == 0:
                state.commit()

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

``TensorFlowKerasState`` is ``mgpu_launch.keras.elastic.KerasState`` for a model that is not
compiled: the optimizer passed is committed and restored with it. ``run`` is the Keras one: it
loads the last commit from disk when the job starts (after a failure or a resize mgpu-train
restarts every process), runs the reset callbacks when the commit was written by a job of
another size, and then, as Horovod's, calls ``state.sync()`` so that every rank starts from rank
0's variables and attributes. The differences from Horovod's in-memory rollback are
``mgpu_launch.keras.elastic``'s (docs/fault-tolerance.md, "The Horovod names").

Not provided: ``TensorFlowState`` (TF1 sessions and raw variable lists) and Horovod's
model-less ``ObjectState``: a commit here is a model backup; keep plain values as attributes of
a ``TensorFlowKerasState``.
"""

from mgpu_launch.horovod import support
from mgpu_launch.horovod.elastic import KerasState, run

__all__ = ["TensorFlowKerasState", "run"]
__getattr__ = support.namespace_getattr("mgpu_launch.tensorflow.elastic", {
    "TensorFlowState": "TF1 sessions and raw variable lists are not committed; use "
                       "TensorFlowKerasState(model, optimizer, ...) for a Keras model",
    "ObjectState": "a commit is a model backup here; keep plain values as attributes of a "
                   "TensorFlowKerasState(model, optimizer, name=value, ...)",
})


class TensorFlowKerasState(KerasState):
    """Horovod's ``TensorFlowKerasState``: a Keras model, its optimizer and attributes, for a
    custom training loop (the model need not be compiled).

    Args:
        model: the Keras model (built: its variables exist).
        optimizer: the optimizer the loop applies gradients with (default:
            ``model.optimizer``). An uncompiled model gets it as ``model.optimizer``, so that
            a commit saves its slots with the weights.
        backend: Horovod's Keras backend module; ignored.
        backup_dir, **kwargs: as for ``mgpu_launch.keras.elastic.KerasState``.

    Raises:
        ValueError: neither `optimizer` nor ``model.optimizer``; an attribute name of the
            state's own.

    Example:
        >>> state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0, epoch=0)
    """

    def __init__(self, model, optimizer=None, backend=None, backup_dir=None, **kwargs):
        if optimizer is None and getattr(model, "optimizer", None) is None:
            raise ValueError("TensorFlowKerasState: the model has no optimizer and none was "
                             "passed; give the one your loop applies gradients with: "
                             "TensorFlowKerasState(model, optimizer, batch=0)")
        if getattr(model, "optimizer", None) is None:
            model.optimizer = optimizer  # what Keras saves with the weights
        super().__init__(model, optimizer=optimizer, backup_dir=backup_dir, **kwargs)
