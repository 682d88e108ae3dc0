"""Synchronized BatchNormalization: batch statistics over every rank's batch, in the step.

    import mgpu_launch as mgpu
    mgpu.init()
    ...
    x = mgpu.layers.SyncBatchNormalization()(x)          # Horovod's hvd.SyncBatchNormalization
    x = keras.layers.BatchNormalization(synchronized=True)(x)   # the same, on every backend

In training, each BatchNormalization normalizes with the mean and variance of its *own* local
batch (Horovod's and mgpu's default): with 2-8 images per GPU, as detection and segmentation
models train, those statistics are noisy. A synchronized layer normalizes with the statistics of
the global batch instead, as one process with the batches of all ranks would: per layer and
step, each rank computes over its local batch, per channel, the sample count n_r, the sum s_r
and the sum of squared deviations from its own mean M2_r; one small collective inside the
compiled step (``mgpu_launch.training.batch_statistics``, through
:meth:`~mgpu_launch.backends.Engine.gather_in_step`: an all-gather on JAX, a sum of one-hot rows
on TensorFlow and torch) gives every rank every rank's (n_r, s_r, M2_r); each rank then
combines them (Chan et al.'s parallel variance, as torch's SyncBatchNorm does):

    N = sum n_r,   mean = sum s_r / N,   var = (sum M2_r + sum n_r (s_r / n_r - mean)^2) / N

which needs no E[x^2] - E[x]^2 (no cancellation when the mean is large against the spread) and
gives the exact global statistics when ranks have different batch sizes (an uneven last
batch). The backward pass goes through the collective, so gradients are those of the global
batch; the moving mean and variance, updated from the global statistics, stay identical on every
rank. Inference (``training=False``, ``evaluate``, ``predict``) uses the moving statistics and
runs no collective. On one process the layer is Keras's BatchNormalization, unchanged.

Cost: per layer and training step one collective of size x (2C + 1) floats forward and one of
the same size backward (C channels); benchmarks/sync_batchnorm_cpu.md has the figures.

JAX: the statistics are reduced inside the train step mgpu builds (``fit``, ``train_on_batch``
of a model compiled with a ``DistributedOptimizer``); anywhere else the layer uses local
statistics. The keras.layers.BatchNormalization changes live in ``mgpu_launch.training.patches``.
"""

from typing import Optional

import keras

from mgpu_launch.training import patches

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="mgpu_launch")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose training statistics cover the batches of every rank.

    The same as ``keras.layers.BatchNormalization(synchronized=True)`` under mgpu, and as
    Horovod's ``hvd.SyncBatchNormalization``; see the module docstring for the semantics.

    Args:
        fused: Horovod's argument; only ``None`` or ``False`` (Keras 3 has no fused kernel).
        **kwargs: ``keras.layers.BatchNormalization``'s arguments (``synchronized`` is always
            True here).

    Raises:
        ValueError: ``fused=True``.

    Example:
        >>> x = keras.layers.Conv2D(64, 3)(inputs)
        >>> x = mgpu.layers.SyncBatchNormalization()(x)
    """

    def __init__(self, fused: Optional[bool] = None, **kwargs):
        if fused:
            raise ValueError(
                "SyncBatchNormalization(fused=True) was received; Keras 3 has no fused "
                "BatchNormalization kernel. Leave fused out (or pass fused=False).")
        kwargs.pop("synchronized", None)
        patches.install()  # installed by mgpu.init() already, unless a script never called it
        super().__init__(synchronized=True, **kwargs)
