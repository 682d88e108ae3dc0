"""Test worker for tests/training/test_saving.py: save under mgpu, load where mgpu cannot be
imported.

    mgpu-train -np 2 saving.py save OUT      # train, checkpoint, save; rank 0 writes OUT/*
    python -I saving.py load OUT             # plain Keras only: load every file, train on

`save` writes OUT/model.keras (model.save), OUT/ckpt-N.keras and OUT/ckpt-N.weights.h5
(mgpu's ModelCheckpoint), OUT/state.npz (the optimizer's variables at the end) and checks that
mgpu.load_model and hvd.load_model re-wrap with the saved settings. `load` blocks mgpu_launch
(as if it were not installed), loads each file with plain Keras, checks the optimizer state
against state.npz, trains one more epoch and writes OUT/loaded.json.
"""

import json
import os
import sys

import numpy as np

mode, out = sys.argv[1], sys.argv[2]
EPOCHS = 2


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 5)).astype("float32"), rng.integers(0, 3, size=32)


def build_model(keras):
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(3)])


def inner_adam(keras):
    # A schedule, so the wrapper holds an lr_multiplier variable of its own as well.
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9))


def loss(keras):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def save():
    import mgpu_launch as mgpu
    mgpu.init()
    import keras
    import mgpu_launch.keras as hvd

    x, y = data()
    model = build_model(keras)
    model.compile(optimizer=mgpu.DistributedOptimizer(inner_adam(keras), sparse_as_dense=True,
                                                      gradient_predivide_factor=2.0),
                  loss=loss(keras))
    model.fit(x, y, batch_size=4, epochs=EPOCHS, verbose=0, callbacks=[
        mgpu.callbacks.ModelCheckpoint(os.path.join(out, "ckpt-{epoch}.keras")),
        mgpu.callbacks.ModelCheckpoint(os.path.join(out, "ckpt-{epoch}.weights.h5"),
                                       save_weights_only=True)])
    if mgpu.rank() != 0:
        return
    model.save(os.path.join(out, "model.keras"))
    state = [np.asarray(v.numpy()) for v in model.optimizer.inner_optimizer.variables]
    np.savez(os.path.join(out, "state.npz"), *state)
    for load in (mgpu.load_model, hvd.load_model):
        loaded = load(os.path.join(out, "model.keras"))
        optimizer = loaded.optimizer
        assert isinstance(optimizer, mgpu.DistributedOptimizer), type(optimizer)
        assert optimizer.sparse_as_dense and optimizer.gradient_predivide_factor == 2.0
        assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
        for saved, now in zip(state, optimizer.inner_optimizer.variables, strict=True):
            np.testing.assert_array_equal(saved, now.numpy())
    print("mgpu.load_model and hvd.load_model re-wrapped with the saved settings")


class _NotInstalled:
    """A meta-path finder that makes mgpu_launch (and its launcher) unimportable."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in ("mgpu_launch", "mgpu_launcher"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def load():
    sys.meta_path.insert(0, _NotInstalled)
    try:
        import mgpu_launch  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("mgpu_launch is importable: the load test would prove nothing")
    import keras

    x, y = data()
    saved = list(np.load(os.path.join(out, "state.npz")).values())
    report = {"backend": keras.backend.backend()}
    for name in ("model.keras", f"ckpt-{EPOCHS}.keras", f"ckpt-{EPOCHS}.weights.h5"):
        path = os.path.join(out, name)
        if name.endswith(".weights.h5"):
            model = build_model(keras)
            model.compile(optimizer=inner_adam(keras), loss=loss(keras))
            model.optimizer.build(model.trainable_variables)
            model.load_weights(path)
        else:
            model = keras.models.load_model(path)
        optimizer = model.optimizer
        # (the torch backend builds its own Adam subclass)
        assert isinstance(optimizer, keras.optimizers.Adam), type(optimizer)
        assert "Distributed" not in type(optimizer).__name__, type(optimizer)
        for index, (want, got) in enumerate(zip(saved, optimizer.variables, strict=True)):
            np.testing.assert_array_equal(want, got.numpy(), err_msg=f"{name}: variable {index}")
        before = [w.copy() for w in model.get_weights()]
        history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        report[name] = {
            "iterations": int(optimizer.iterations.numpy()),
            "saved_iterations": int(saved[0]),
            "loss": float(history.history["loss"][-1]),
            "weights_changed": any(not np.array_equal(a, b)
                                   for a, b in zip(before, model.get_weights())),
        }
    with open(os.path.join(out, "loaded.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    {"save": save, "load": load}[mode]()
