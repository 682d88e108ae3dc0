"""torch's own kernels for Keras's BatchNormalization and channels_last conv (backends/torch/kernels.py).

Each replacement must compute what Keras's torch lowering computes: a train step of a small
convolutional network with BatchNormalization (channels_last images and a (batch, features)
input) gives Keras's weights, moving statistics and loss up to float rounding, in float32 and
in mixed_bfloat16; the inference path likewise. Layers the replacement does not cover keep
Keras's code. How much faster they are is measured on the GPU machine (benchmarks/torch_speed/).
"""

import subprocess
import sys

import numpy as np
import pytest

from conftest import BACKEND

pytestmark = [pytest.mark.backend,
              pytest.mark.skipif(BACKEND != "torch", reason="the torch engine's kernels"),
              pytest.mark.usefixtures("backend")]


def _network(keras, policy):
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(5)
        images = keras.Input((12, 12, 3))
        x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(images)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.Conv2D(16, 1, strides=2)(x)
        x = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)
        x = keras.layers.Conv2D(16, 3, padding="same", strides=2)(x)  # asymmetric: Keras pads
        x = keras.layers.BatchNormalization(center=False, scale=False)(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        x = keras.layers.Dense(10)(x)
        x = keras.layers.BatchNormalization()(x)  # a (batch, features) input
        outputs = keras.layers.Dense(4)(x)
        model = keras.Model(images, outputs)
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
        keras.config.set_dtype_policy("float32")
    return model


def _install_kernels() -> None:
    """The torch patch set's kernels (BatchNormalization, channels_last conv), installed."""
    from mgpu_launch.backends.torch import patches
    from mgpu_launch.keras_patching import apply

    for replacement in patches.KERNELS:
        apply(replacement)


def _step_results(keras, policy, patched: bool, monkeypatch):
    """Weights (moving statistics included), losses and inference outputs of 3 train steps."""
    from keras.src.backend.torch import nn as torch_nn
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    _install_kernels()
    with monkeypatch.context() as local:
        if not patched:  # Keras's own lowering, as without mgpu
            local.setattr(BatchNormalization, "call", BatchNormalization.call.__wrapped__)
            local.setattr(torch_nn, "conv", torch_nn.conv.__wrapped__)
        model = _network(keras, policy)
        rng = np.random.default_rng(0)
        x = (rng.standard_normal((16, 12, 12, 3)) * 2 + 1).astype("float32")
        y = rng.integers(0, 4, 16)
        losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
        inference = keras.ops.convert_to_numpy(model(x[:5], training=False)).astype("float64")
        weights = [np.asarray(w, dtype="float64") for w in model.get_weights()]
    return losses, inference, weights


@pytest.mark.parametrize("policy,tolerance", [("float32", 2e-5), ("mixed_bfloat16", 2e-2)])
def test_a_train_step_is_keras_own(policy, tolerance, monkeypatch):
    import keras

    keras_losses, keras_out, keras_weights = _step_results(keras, policy, False, monkeypatch)
    losses, out, weights = _step_results(keras, policy, True, monkeypatch)
    np.testing.assert_allclose(losses, keras_losses, rtol=tolerance)
    np.testing.assert_allclose(out, keras_out, rtol=tolerance, atol=tolerance)
    assert len(weights) == len(keras_weights)
    for ours, theirs in zip(weights, keras_weights):
        np.testing.assert_allclose(ours, theirs, rtol=tolerance, atol=tolerance)


def test_the_replacements_are_the_ones_called(monkeypatch):
    import keras
    import torch
    from keras.src.backend.torch import nn as torch_nn

    calls, copies = [], []
    real = torch.nn.functional.batch_norm
    monkeypatch.setattr(torch.nn.functional, "batch_norm",
                        lambda *a, **k: calls.append(k.get("training")) or real(*a, **k))
    transpose = torch_nn._transpose_spatial_inputs  # Keras's copy to channels-first memory
    monkeypatch.setattr(torch_nn, "_transpose_spatial_inputs",
                        lambda x: copies.append(x.device.type) or transpose(x))
    _step_results(keras, "float32", True, monkeypatch)
    # 4 layers: 4 calls as the functional model is built, 4 x 3 train steps, 4 at inference
    assert calls == [False] * 4 + [True] * 12 + [False] * 4
    assert "cpu" not in copies  # (shape inference runs on "meta" tensors: no data there)


def test_layers_it_does_not_cover_keep_keras_code(monkeypatch):
    import keras
    import torch
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    from mgpu_launch.backends.torch.kernels import _plain_batch_norm

    moments = BatchNormalization._moments
    x = torch.ones((4, 3))

    def layer(**kwargs):
        built = keras.layers.BatchNormalization(**kwargs)
        built.build((4, 3))
        return built

    assert _plain_batch_norm(layer(), x, None, moments)
    assert not _plain_batch_norm(layer(), x, torch.ones((4,)), moments)  # a mask
    assert not _plain_batch_norm(layer(renorm=True), x, None, moments)
    assert not _plain_batch_norm(layer(dtype="float64"), x.double(), None, moments)
    assert not _plain_batch_norm(layer(), x.double(), None, moments)
    assert not _plain_batch_norm(layer(), x, None, lambda *a: None)  # another _moments
    synced = layer()
    synced.synchronized = True  # one process: plain BatchNormalization (as Keras's would be)
    assert _plain_batch_norm(synced, x, None, moments)
    from mgpu_launch import runtime
    monkeypatch.setattr(runtime, "is_multi_process", lambda: True)  # mgpu's cross-rank moments
    assert not _plain_batch_norm(synced, x, None, moments)


def test_mgpu_torch_kernels_0_installs_neither():
    script = ("import keras, mgpu_launch as mgpu\n"
              "from keras.src.layers.normalization.batch_normalization import "
              "BatchNormalization as B\n"
              "from keras.src.backend.torch import nn\n"
              "mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1))\n"
              "print(getattr(B.call, '_mgpu', False), getattr(nn.conv, '_mgpu', False))\n")
    for value, expected in (("0", "False False"), ("1", "True True")):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=300, env={**__import__("os").environ,
                                                  "KERAS_BACKEND": "torch",
                                                  "MGPU_TORCH_KERNELS": value})
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split("\n")[-2] == expected, result.stdout


def _small_batch_results(keras, batch, spatial, patched, monkeypatch):
    """Losses and weights of 2 train steps of a BatchNormalization network on `batch` samples
    of `spatial` images (an image of 1x1 and a batch of 1: one value per channel)."""
    from keras.src.backend.torch import nn as torch_nn
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    _install_kernels()
    with monkeypatch.context() as local:
        if not patched:
            local.setattr(BatchNormalization, "call", BatchNormalization.call.__wrapped__)
            local.setattr(torch_nn, "conv", torch_nn.conv.__wrapped__)
        keras.utils.set_random_seed(7)
        images = keras.Input((*spatial, 2))
        x = keras.layers.Conv2D(4, 1)(images)
        x = keras.layers.BatchNormalization(momentum=0.5)(x)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Dense(6)(x)
        x = keras.layers.BatchNormalization(momentum=0.5)(x)  # (batch, features): 1 value at 1
        model = keras.Model(images, keras.layers.Dense(3)(x))
        model.compile(keras.optimizers.SGD(0.1), "mse")
        rng = np.random.default_rng(batch)
        x = rng.standard_normal((batch, *spatial, 2)).astype("float32")
        y = rng.standard_normal((batch, 3)).astype("float32")
        losses = [float(model.train_on_batch(x, y)) for _ in range(2)]
        out = keras.ops.convert_to_numpy(model(x, training=False)).astype("float64")
        return losses, out, [np.asarray(w, dtype="float64") for w in model.get_weights()]


@pytest.mark.parametrize("spatial", [(1, 1), (3, 5), (7, 1)])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_small_batches_and_odd_shapes_train_as_keras_does(batch, spatial, monkeypatch):
    """Issue 58, item 3: a batch of one after a Dense layer (one value per channel) made
    torch's batch_norm raise "Expected more than 1 value per channel when training", where
    Keras's own lowering trains through it."""
    import keras

    keras_losses, keras_out, keras_weights = _small_batch_results(keras, batch, spatial, False,
                                                                  monkeypatch)
    losses, out, weights = _small_batch_results(keras, batch, spatial, True, monkeypatch)
    np.testing.assert_allclose(losses, keras_losses, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(out, keras_out, rtol=2e-5, atol=1e-5)
    for ours, theirs in zip(weights, keras_weights):
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-5)
