"""Test worker: what ``optimizer.iterations`` counts with backward_passes_per_step=2.

    mgpu-train -np 2 hvd_iterations.py OUT_DIR

Four ``fit`` runs of the same model on the same ``mgpu.data.shard`` data (4 batches per rank
and epoch), each with an ExponentialDecay schedule and a one-epoch LearningRateWarmupCallback:

- ``horovod``: Horovod's names (``mgpu_launch.keras``), 2 epochs;
- ``mgpu``: ``mgpu.DistributedOptimizer``, 2 epochs;
- ``first`` then ``resumed``: Horovod's names, epoch 1 with a BackupAndRestore, then a fresh
  model and optimizer that resume from its backup and train epoch 2.

Writes rank.N.json: per run, ``iterations`` read after every batch, the final learning rate,
and the final weights.
"""

import json
import os
import sys

import numpy as np

import mgpu_launch.keras as hvd

hvd.init()
import keras  # noqa: E402

import mgpu_launch as mgpu  # noqa: E402

out = sys.argv[1]
rng = np.random.default_rng(7)
x = rng.normal(size=(32, 5)).astype("float32")
y = rng.integers(0, 3, size=32)
data = mgpu.data.shard((x, y), batch_size=4, shuffle=False)   # 4 batches per rank and epoch


class Iterations(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)))


def fit(wrap, epochs, backup=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(3)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.9)
    optimizer = wrap(keras.optimizers.SGD(schedule), backward_passes_per_step=2)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = Iterations()
    callbacks = [hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1), seen]
    if backup:
        callbacks.append(mgpu.callbacks.BackupAndRestore(backup, delete_checkpoint=False))
    model.fit(data, epochs=epochs, callbacks=callbacks, verbose=0)
    return {"iterations": seen.seen,
            "lr": float(keras.ops.convert_to_numpy(optimizer.learning_rate)),
            "weights": [w.tolist() for w in model.get_weights()]}


def horovods(optimizer, **kwargs):
    return hvd.DistributedOptimizer(optimizer, average_aggregated_gradients=True, **kwargs)


backup = os.path.join(out, "backup")
report = {"horovod": fit(horovods, 2), "mgpu": fit(mgpu.DistributedOptimizer, 2),
          "first": fit(horovods, 1, backup), "resumed": fit(horovods, 2, backup)}
with open(os.path.join(out, f"rank.{hvd.rank()}.json"), "w") as f:
    json.dump(report, f)
