"""MGPU_TF_LAG_LOGS: on TensorFlow the per-batch logs callbacks see lag one step (so Keras does
not wait for each step before it queues the next, on GPUs); the epoch's logs, train_on_batch
and a custom train step's logs do not. Real Keras fit on TensorFlow (CPU), in this process."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                reason="the lag is TensorFlow's (Keras waits for every step)")

import mgpu_launch as mgpu  # noqa: E402
from mgpu_launch.training import lagged_logs  # noqa: E402

X = np.random.default_rng(0).normal(size=(48, 5)).astype("float32")
Y = (X @ np.arange(1.0, 6.0, dtype="float32"))[:, None]


class Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _model(model_class=keras.Sequential):
    keras.utils.set_random_seed(1)
    model = model_class([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(mgpu.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse",
                  metrics=["mae"])
    return model


def _fit(monkeypatch, lag, model_class=keras.Sequential):
    monkeypatch.setenv("MGPU_TF_LAG_LOGS", lag)
    model = _model(model_class)
    batches = Batches()
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                        callbacks=[batches])
    return model, batches.losses, history.history


def test_each_batch_sees_the_step_before_and_the_epochs_are_unchanged(monkeypatch):
    model, lagged, history = _fit(monkeypatch, "on")
    assert isinstance(model.train_function, lagged_logs.LaggedLogs)
    _, losses, reference = _fit(monkeypatch, "off")
    assert len(lagged) == len(losses) == 12
    # Each epoch's first batch sees its own logs (a new iterator), then each the one before.
    expected = [losses[0], *losses[0:5], losses[6], *losses[6:11]]
    np.testing.assert_allclose(lagged, expected, rtol=1e-6)
    assert lagged != losses
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history[key], reference[key], rtol=1e-6)
    assert history["loss"][1] < history["loss"][0]


def test_off_and_on_a_cpu_by_default_keras_function_is_kept(monkeypatch):
    model, _, _ = _fit(monkeypatch, "off")
    assert not isinstance(model.train_function, lagged_logs.LaggedLogs)
    monkeypatch.delenv("MGPU_TF_LAG_LOGS")
    model = _model()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert not isinstance(model.train_function, lagged_logs.LaggedLogs)  # auto: no GPU here


def test_train_on_batch_returns_its_own_batch(monkeypatch):
    monkeypatch.setenv("MGPU_TF_LAG_LOGS", "on")
    model, reference = _model(), _model()
    for start in range(0, 24, 8):
        mine = model.train_on_batch(X[start:start + 8], Y[start:start + 8], return_dict=True)
        theirs = reference.train_on_batch(X[start:start + 8], Y[start:start + 8],
                                          return_dict=True)
        np.testing.assert_allclose(mine["loss"], theirs["loss"], rtol=1e-6)


class OtherLogs(keras.Sequential):
    """A custom train step whose logs are not the model's metrics: Keras then gives the epoch
    the last batch's logs, so they must not lag."""

    def train_step(self, data):
        logs = super().train_step(data)
        return {"loss": logs["loss"], "batch_mean": keras.ops.mean(data[1])}


def test_a_custom_step_with_other_logs_is_not_lagged(monkeypatch):
    _, lagged, history = _fit(monkeypatch, "on", OtherLogs)
    _, losses, reference = _fit(monkeypatch, "off", OtherLogs)
    np.testing.assert_allclose(lagged, losses, rtol=1e-6)
    np.testing.assert_allclose(history["batch_mean"], reference["batch_mean"], rtol=1e-6)
