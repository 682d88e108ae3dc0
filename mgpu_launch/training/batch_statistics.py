"""The mean and variance of a batch spread over every rank, for synchronized BatchNormalization.

Kept apart from ``mgpu_launch.layers`` because the BatchNormalization patch in
``mgpu_launch.training.patches`` calls it, and ``mgpu_launch.layers`` installs that patch. The
semantics and the cost are described in ``mgpu_launch.layers``.
"""

from typing import Optional, Tuple

from keras import ops

from mgpu_launch import backends, runtime


def synchronized_moments(inputs, axes, mask=None) -> Optional[Tuple[object, object]]:
    """The mean and variance of `inputs` over `axes` and over every rank's batch.

    Called by the BatchNormalization patch in training mode; differentiable.

    Args:
        inputs: this rank's batch (float32 or wider; Keras upcasts before asking).
        axes: the reduced axes (all but the channel axis).
        mask: Keras's mask (one dimension less than `inputs`, True where a position counts),
            or None.

    Returns:
        ``(mean, variance)`` of shape (channels,), identical on every rank; None where no
        collective can run (one process; on JAX, outside mgpu's train step): the caller then
        uses the local statistics.
    """
    engine = backends.get_engine_or_default()
    if not runtime.is_multi_process() or not engine.reduces_in_step():
        return None
    axes = [axis % len(inputs.shape) for axis in axes]
    if mask is None:
        count = 1
        for axis in axes:
            count = count * ops.shape(inputs)[axis]
        count = ops.cast(ops.reshape(count, (1,)), inputs.dtype)
        local_sum = ops.sum(inputs, axis=axes, keepdims=True)
        centered = inputs - local_sum / ops.maximum(count, 1)
        squares = ops.square(centered)
    else:
        weight = ops.cast(ops.expand_dims(mask, -1), inputs.dtype)  # as Keras broadcasts it
        count = ops.reshape(ops.sum(weight), (1,))
        local_sum = ops.sum(inputs * weight, axis=axes, keepdims=True)
        centered = inputs - local_sum / ops.maximum(count, 1)
        squares = ops.square(centered) * weight
    local_sum = ops.reshape(local_sum, (-1,))
    channels = local_sum.shape[0]
    row = ops.concatenate([count, local_sum, ops.reshape(ops.sum(squares, axis=axes), (-1,))])
    rows = engine.gather_in_step(row)  # (ranks, 1 + 2 channels)
    counts, sums, deviations = rows[:, :1], rows[:, 1:1 + channels], rows[:, 1 + channels:]
    total = ops.maximum(ops.sum(counts), 1)
    mean = ops.sum(sums, axis=0) / total
    rank_means = sums / ops.maximum(counts, 1)
    spread = ops.sum(counts * ops.square(rank_means - mean), axis=0)
    variance = (ops.sum(deviations, axis=0) + spread) / total
    return mean, variance
