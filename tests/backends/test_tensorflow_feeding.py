"""What mgpu's prefetch thread hands Keras's TensorFlow train function (issue 38): each batch a
copy on the device, with int32 tensors widened to int64 there (TensorFlow keeps int32 in host
memory, and the compiled step would wait for the step before to copy them in).

Without a GPU the engine copies nothing, so these tests give the transfer the CPU device
explicitly: the dtypes and values it hands over, and a real ``fit`` fed through the prefetch
thread with widened inputs and labels, which must match Keras's own feeding.
"""

import doctest

import numpy as np
import pytest

from conftest import BACKEND

if BACKEND != "tensorflow":  # importing TF before Keras's torch backend (triton) segfaults
    pytest.skip("TensorFlow-backend only", allow_module_level=True)
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import mgpu_launch as mgpu  # noqa: E402
from mgpu_launch.backends import get_engine# noqa: E402
from mgpu_launch.backends.tensorflow import feeding as tensorflow_feeding
from mgpu_launch.backends.tensorflow.engine import TensorFlowEngine  # noqa: E402


def _batch():
    return {"tokens": tf.constant([[1, 2], [3, 4]], tf.int32),
            "pixels": tf.ones([2, 3], tf.float32)}, tf.constant([0, 1], tf.int32)


def test_int32_tensors_arrive_as_int64_with_the_same_values_and_others_untouched():
    x, y = tensorflow_feeding.device_transfer("/CPU:0", widen_int32=True)(_batch())
    assert (x["tokens"].dtype, x["pixels"].dtype, y.dtype) == (tf.int64, tf.float32, tf.int64)
    assert x["tokens"].numpy().tolist() == [[1, 2], [3, 4]] and y.numpy().tolist() == [0, 1]
    assert "CPU:0" in x["tokens"].device


@pytest.mark.parametrize("value, expected", [("0", tf.int32), ("1", tf.int64), (None, tf.int64)])
def test_the_setting_decides_and_widening_is_the_default(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("MGPU_TF_WIDEN_INT32", raising=False)
    else:
        monkeypatch.setenv("MGPU_TF_WIDEN_INT32", value)
    _, y = tensorflow_feeding.device_transfer("/CPU:0")(_batch())
    assert y.dtype == expected


def test_a_bad_setting_is_explained(monkeypatch):
    monkeypatch.setenv("MGPU_TF_WIDEN_INT32", "maybe")
    with pytest.raises(ValueError, match="MGPU_TF_WIDEN_INT32.*maybe"):
        tensorflow_feeding.device_transfer("/CPU:0")


def test_without_a_gpu_the_batch_is_handed_over_as_it_is():
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    batch = _batch()
    assert tensorflow_feeding.device_transfer()(batch) is batch


def test_the_docstring_example_runs():
    failed, tried = doctest.testmod(tensorflow_feeding)
    assert (failed, tried > 0) == (0, True)


def _fit_losses(prefetch, monkeypatch):
    """Two epochs of an Embedding classifier whose input and labels are int32 (a Functional
    model declares its input int32: it casts the widened tensor back inside the step)."""
    monkeypatch.setenv("MGPU_PREFETCH", str(prefetch))
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (64, 6)).astype("int32")
    labels = (tokens.sum(1) % 3).astype("int32")
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.5)),
                  "sparse_categorical_crossentropy", metrics=["sparse_categorical_accuracy"])
    history = model.fit(tokens, labels, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return history.history


def test_fit_on_widened_batches_matches_keras_own_feeding(monkeypatch):
    assert isinstance(get_engine(), TensorFlowEngine)
    seen = []

    def widening_on_cpu(self):  # the engine's transfer, given the CPU as its device
        copy = tensorflow_feeding.device_transfer("/CPU:0", widen_int32=True)
        return lambda batch: seen.append(copy(batch)) or seen[-1]
    monkeypatch.setattr(TensorFlowEngine, "prefetch_transfer", widening_on_cpu)
    widened = _fit_losses(2, monkeypatch)
    direct = _fit_losses(0, monkeypatch)
    assert len(seen) == 2 * 4  # every batch of both epochs came through the transfer
    assert {t.dtype for t in tf.nest.flatten(seen)} == {tf.int64}
    for name in ("loss", "sparse_categorical_accuracy"):
        assert widened[name] == pytest.approx(direct[name], rel=1e-6), name
