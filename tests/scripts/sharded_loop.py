"""Test worker for tests/training/test_sharding.py (issue 60): a sharded optimizer in a custom
training loop and under ``fit``, saved and loaded every way.

    mgpu-train -np N sharded_loop.py OUT
    mgpu-train -np M sharded_loop.py OUT reshard     # after a run of the first form

Every rank:

1. trains the same small model twice from the same weights in a custom loop (TensorFlow:
   GradientTape and ``optimizer.apply``; torch: ``loss.backward()`` and ``optimizer.apply``;
   JAX: ``train_on_batch``, the loop JAX runs), unsharded and sharded (``loop_plain_<i>``,
   ``loop_sharded_<i>``);
2. fits a model one epoch sharded (``BroadcastGlobalVariablesCallback``, ``BackupAndRestore``
   into OUT/backups) and its twin unsharded; gathers the state, and rank 0 writes
   OUT/sharded.keras, OUT/sharded.weights.h5, OUT/plain.weights.h5 and OUT/plain_state.npz
   (the unsharded optimizer's variables, in order);
3. trains one more epoch four ways, each from the state after 1.: the sharded model on
   (``continued_<i>``); a fresh sharded model that loads OUT/sharded.weights.h5 on every rank
   (``from_sharded_<i>``), one that loads OUT/plain.weights.h5 (``from_plain_<i>``: an
   unsharded file re-sharded), and one that ``BackupAndRestore`` restores from rank 0's backup
   (``restored_<i>``), and writes ``OUT/rank<r>.npz`` with all of them and ``state_bytes``.

``reshard``: M ranks restore the N ranks' backup (BackupAndRestore re-shards it), train nothing
more, gather the state again, and rank 0 writes OUT/resharded.weights.h5.
"""

import os
import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402 - after init, as the README asks

from mgpu_launch.training import sharding  # noqa: E402

OUT = sys.argv[1]
STEPS, BATCH = 3, 4  # per rank


def model_and_data():
    rng = np.random.default_rng(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    model.set_weights([rng.normal(size=w.shape) * 0.3 for w in model.weights])
    x = rng.normal(size=(mgpu.size() * STEPS * BATCH, 6)).astype("float32")
    y = rng.integers(0, 3, size=len(x))
    mine = slice(mgpu.rank() * STEPS * BATCH, (mgpu.rank() + 1) * STEPS * BATCH)
    return model, x[mine], y[mine]


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def custom_loop(shard: bool):
    model, x, y = model_and_data()
    optimizer = mgpu.DistributedOptimizer(keras.optimizers.AdamW(0.01, global_clipnorm=0.1),
                                          shard_optimizer_state=shard)
    backend = keras.backend.backend()
    if backend == "jax":
        model.compile(optimizer=optimizer, loss=LOSS)
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        if backend == "tensorflow":
            import tensorflow as tf
            with tf.GradientTape() as tape:
                loss = LOSS(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
        elif backend == "torch":
            model.zero_grad()
            loss = LOSS(keras.ops.convert_to_tensor(yb), model(xb, training=True))
            loss.backward()
            variables = model.trainable_variables
            optimizer.apply([v.value.grad for v in variables], variables)
        else:
            model.train_on_batch(xb, yb)
    return model, optimizer


def compiled(shard: bool, build: bool = False):
    model, x, y = model_and_data()
    model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                      shard_optimizer_state=shard), loss=LOSS)
    if build:  # the slots a loaded file fills (as BackupAndRestore builds them)
        model.optimizer.build(model.trainable_variables)
    return model, x, y


def fit(model, x, y, epochs=1, callbacks=()):
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model


def main():
    results = {}
    for shard in (False, True):
        model, optimizer = custom_loop(shard)
        name = "sharded" if shard else "plain"
        results.update({f"loop_{name}_{i}": w for i, w in enumerate(model.get_weights())})
    assert optimizer.holds_sharded_state() == (mgpu.size() > 1)

    backups = os.path.join(OUT, "backups")
    sharded = fit(*compiled(True), callbacks=[
        mgpu.callbacks.BroadcastGlobalVariablesCallback(0),
        mgpu.callbacks.BackupAndRestore(backups, delete_checkpoint=False)])
    plain = fit(*compiled(False))
    results["state_bytes"] = sharding.state_bytes(sharded.optimizer)
    sharded.optimizer.gather_state()  # every rank; then rank 0 saves the whole state
    if mgpu.rank() == 0:
        sharded.save(os.path.join(OUT, "sharded.keras"))
        sharded.save_weights(os.path.join(OUT, "sharded.weights.h5"))
        plain.save_weights(os.path.join(OUT, "plain.weights.h5"))
        np.savez(os.path.join(OUT, "plain_state.npz"), *[
            keras.ops.convert_to_numpy(v.value) for v in plain.optimizer.inner_optimizer.variables])
    mgpu.barrier()

    _, x, y = model_and_data()
    runs = {"continued": sharded}
    for source in ("sharded", "plain"):  # every rank loads the file, keeps its own part
        model, _, _ = compiled(True, build=True)
        model.load_weights(os.path.join(OUT, f"{source}.weights.h5"))
        runs[f"from_{source}"] = model
    for name, model in runs.items():
        fit(model, x, y)
    restored, _, _ = compiled(True)  # rank 0 reads the backup, every rank gets its part
    runs["restored"] = fit(restored, x, y, epochs=2, callbacks=[
        mgpu.callbacks.BackupAndRestore(backups, delete_checkpoint=False)])
    for name, model in runs.items():
        results.update({f"{name}_{i}": w for i, w in enumerate(model.get_weights())})
    np.savez(os.path.join(OUT, f"rank{mgpu.rank()}.npz"), **results)
    mgpu.barrier()


def reshard():
    model, x, y = compiled(True)
    fit(model, x, y, callbacks=[mgpu.callbacks.BackupAndRestore(os.path.join(OUT, "backups"),
                                                                delete_checkpoint=False)])
    model.optimizer.gather_state()
    if mgpu.rank() == 0:
        model.save_weights(os.path.join(OUT, "resharded.weights.h5"))
    mgpu.barrier()


if __name__ == "__main__":
    reshard() if sys.argv[2:] == ["reshard"] else main()
