"""Test worker for tests/training/test_sharding.py (issue 60): a sharded optimizer in a custom
training loop, beside ``fit``'s callbacks, and its refused save.

    mgpu-train -np N sharded_loop.py OUT

Each rank trains the same small model twice from the same weights, in a custom loop
(TensorFlow: GradientTape and ``optimizer.apply``; torch: ``loss.backward()`` and
``optimizer.apply``; JAX: ``train_on_batch``, the loop JAX can run), unsharded and sharded,
then ``fit`` with ``BroadcastGlobalVariablesCallback`` on the sharded one; it writes
``OUT/rank<r>.npz`` (``plain_<i>``, ``sharded_<i>``: the weights after the loop; ``fit_<i>``:
after fit; ``state_bytes``: the sharded optimizer's; ``backup_refusal``: what fit with
``BackupAndRestore`` raised) and rank 0 tries ``model.save`` and writes the error it got to
``OUT/save_error.txt``.
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


def main():
    plain, _ = custom_loop(shard=False)
    sharded, optimizer = custom_loop(shard=True)
    assert optimizer.holds_sharded_state() == (mgpu.size() > 1)
    results = {f"plain_{i}": w for i, w in enumerate(plain.get_weights())}
    results.update({f"sharded_{i}": w for i, w in enumerate(sharded.get_weights())})
    results["state_bytes"] = sharding.state_bytes(optimizer)
    model, x, y = model_and_data()
    fitted = mgpu.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True)
    model.compile(optimizer=fitted, loss=LOSS)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[mgpu.callbacks.BroadcastGlobalVariablesCallback(0)])
    results.update({f"fit_{i}": w for i, w in enumerate(model.get_weights())})
    try:  # refused on every rank alike, before any step
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[mgpu.callbacks.BackupAndRestore(os.path.join(OUT, "backups"))])
        results["backup_refusal"] = np.array("backed up")
    except NotImplementedError as error:
        results["backup_refusal"] = np.array(str(error))
    np.savez(os.path.join(OUT, f"rank{mgpu.rank()}.npz"), **results)
    if mgpu.rank() == 0:
        try:
            model.save(os.path.join(OUT, "model.keras"))
            message = "saved"
        except NotImplementedError as error:
            message = str(error)
        with open(os.path.join(OUT, "save_error.txt"), "w") as file:
            file.write(message)
    mgpu.barrier()


if __name__ == "__main__":
    main()
