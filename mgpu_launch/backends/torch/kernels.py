"""Keras's torch lowering of BatchNormalization and channels-last convolutions, on torch's kernels.

Keras's torch backend computes a training BatchNormalization as its own arithmetic: the input
cast to float32, ``mean`` and ``mean(square)`` as two reductions, then subtract / multiply /
add, and the result cast back; autograd then runs every one of those backwards. A ResNet-50
step in bfloat16 spends most of its GPU time there (benchmarks/torch_speed/). And Keras's
``conv`` with ``channels_last`` data copies the input twice per convolution (to channels-first
memory by ``.contiguous()``, then back to channels-last memory for cuDNN), and the gradient
twice more.

Here the same layers run on torch's own kernels:

- :func:`batch_norm` — ``torch.nn.functional.batch_norm`` (cuDNN or torch's fused kernels,
  bfloat16/float16 input with float32 statistics, the layout the input has). The batch's mean
  and biased variance come back through two scratch running buffers (momentum 1: torch stores
  the batch's mean and unbiased variance there; the variance is scaled back by (n-1)/n), and
  the layer's moving statistics are updated with Keras's own formula and momentum.
- :func:`conv` — ``channels_last`` input handed to Keras's ``conv`` as a ``channels_first``
  *view*: in memory it is already what cuDNN wants, so neither copy is made.

Both give Keras's results up to float rounding (different summation order; tested against
Keras's own lowering in tests/backends/test_torch_kernels.py) and fall back to Keras's code for
everything they do not cover: masks, renorm, a training batch with one value per channel (or
none), which torch's kernel refuses, ``synchronized=True`` on several processes (mgpu's
cross-rank moments; on one process it is plain BatchNormalization, and takes this path too),
subclasses that override ``_moments``, float64, non-dense layouts. Declared in the torch patch
set (``mgpu_launch.backends.torch.patches``), installed with it by
``mgpu_launch.training.patches`` unless ``MGPU_TORCH_KERNELS=0``.
"""

from typing import Callable

from mgpu_launch import runtime

#: dtypes of the input taken by :func:`batch_norm` (statistics and parameters in float32)
_BATCH_NORM_DTYPES = ("float32", "bfloat16", "float16")


def _plain_batch_norm(layer, inputs, mask, keras_moments) -> bool:
    """Whether `layer` computes what :func:`batch_norm` computes (up to rounding)."""
    import torch

    if mask is not None or layer.renorm:
        return False
    if getattr(layer, "synchronized", False) and runtime.is_multi_process():
        return False  # mgpu's moments over every rank's batch (one process: the local ones)
    if type(layer)._moments is not keras_moments:  # a subclass computes its own moments
        return False
    if not isinstance(inputs, torch.Tensor) or inputs.ndim < 2:
        return False
    if str(inputs.dtype).replace("torch.", "") not in _BATCH_NORM_DTYPES:
        return False
    params = [v for v in (layer.moving_mean, layer.moving_variance,
                          layer.gamma if layer.scale else None,
                          layer.beta if layer.center else None) if v is not None]
    return all(v.dtype == "float32" for v in params)


def _values_per_channel(layer, inputs) -> int:
    """How many values of each channel the batch statistics are taken over."""
    channels = inputs.shape[layer.axis % inputs.ndim]
    return inputs.numel() // channels if channels else 0


def batch_norm(original: Callable, keras_moments: Callable) -> Callable:
    """``BatchNormalization.call`` on ``torch.nn.functional.batch_norm`` where it is the same.

    Args:
        original: Keras's ``BatchNormalization.call``.
        keras_moments: the class's ``_moments`` as installed when this is built; a layer whose
            class has another one keeps Keras's call.

    Returns:
        The replacement ``call(self, inputs, training=None, mask=None)``.
    """

    def call(self, inputs, training=None, mask=None):
        if not _plain_batch_norm(self, inputs, mask, keras_moments) or (
                training and self.trainable and _values_per_channel(self, inputs) < 2):
            # torch's training kernel refuses one value per channel ("Expected more than 1
            # value per channel when training": a last batch of 1 after a Dense layer), and an
            # empty batch; Keras's arithmetic takes both (variance 0, or its NaN statistics)
            return original(self, inputs, training=training, mask=mask)
        import torch
        import torch.nn.functional as functional

        axis = self.axis % inputs.ndim
        x = inputs if axis == 1 else inputs.movedim(axis, 1)  # a view: no copy
        weight = self.gamma.value if self.scale else None
        bias = self.beta.value if self.center else None
        if training and self.trainable:
            channels = x.shape[1]
            mean = torch.zeros(channels, dtype=torch.float32, device=x.device)
            variance = torch.zeros(channels, dtype=torch.float32, device=x.device)
            outputs = functional.batch_norm(x, mean, variance, weight, bias, training=True,
                                            momentum=1.0, eps=self.epsilon)
            count = x.numel() // channels
            with torch.no_grad():
                if count > 1:  # torch stored the unbiased variance; Keras uses the biased one
                    # (not in place: autograd saved the buffer for batch_norm's backward)
                    variance = variance * ((count - 1) / count)
                momentum = self.momentum
                self.moving_mean.assign(self.moving_mean.value * momentum
                                        + mean * (1.0 - momentum))
                self.moving_variance.assign(self.moving_variance.value * momentum
                                            + variance * (1.0 - momentum))
        else:
            outputs = functional.batch_norm(x, self.moving_mean.value,
                                            self.moving_variance.value, weight, bias,
                                            training=False, eps=self.epsilon)
        outputs = outputs if axis == 1 else outputs.movedim(1, axis)
        compute = getattr(torch, self.compute_dtype)
        return outputs if outputs.dtype == compute else outputs.to(compute)

    return call


def conv(original: Callable) -> Callable:
    """Keras's torch ``conv`` without its two copies of a ``channels_last`` input.

    Args:
        original: ``keras.src.backend.torch.nn.conv``.

    Returns:
        The replacement, with the same parameters.
    """

    def conv(inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
        import keras
        import torch

        data_format = str(data_format or keras.config.image_data_format()).lower()
        if (data_format != "channels_last" or not isinstance(inputs, torch.Tensor) or inputs.ndim not in (4, 5)
                or not inputs.is_contiguous()):
            return original(inputs, kernel, strides, padding, data_format, dilation_rate)
        # N, spatial..., C dense in memory is channels-last memory format for a N, C, spatial...
        # view: Keras's channels_first path hands it to cuDNN as it is.
        first = (0, inputs.ndim - 1) + tuple(range(1, inputs.ndim - 1))
        outputs = original(inputs.permute(first), kernel, strides, padding, "channels_first",
                           dilation_rate)
        last = (0,) + tuple(range(2, inputs.ndim)) + (1,)
        return outputs.permute(last)

    return conv
