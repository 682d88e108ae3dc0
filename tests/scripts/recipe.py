"""Test worker for the rank-0 I/O and throughput callbacks.

    mgpu-train -np 2 recipe.py MODE OUT_DIR

MODE "checkpoint": 3 epochs with MetricAverageCallback, a per-epoch ModelCheckpoint into
OUT_DIR/rank<r>/ (only rank0/ may appear), a save_best_only one, and ThroughputCallback.
MODE "kill": a ModelCheckpoint to OUT_DIR/model.keras whose second save is killed (SIGKILL)
half-way through writing.
"""

import json
import os
import signal
import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
rank = mgpu.rank()
rng = np.random.default_rng(rank)
x = rng.normal(size=(64, 4)).astype("float32")
y = rng.integers(0, 2, size=64)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

if mode == "kill":
    saves = []
    original_save = keras.Model.save

    def save_then_die(self, filepath, *args, **kwargs):
        saves.append(filepath)
        original_save(self, filepath, *args, **kwargs)
        if len(saves) == 2:  # the second checkpoint: cut the file short, then die
            with open(filepath, "r+b") as f:
                f.truncate(os.path.getsize(filepath) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

    keras.Model.save = save_then_die
    callbacks = [mgpu.callbacks.ModelCheckpoint(os.path.join(out, "model.keras"))]
else:
    callbacks = [mgpu.callbacks.MetricAverageCallback(),
                 mgpu.callbacks.ModelCheckpoint(os.path.join(out, f"rank{rank}",
                                                             "model-{epoch}.keras")),
                 mgpu.callbacks.ModelCheckpoint(os.path.join(out, "best.weights.h5"),
                                                monitor="loss", save_best_only=True,
                                                save_weights_only=True),
                 mgpu.callbacks.ThroughputCallback(batch_size=8, warmup_steps=2, verbose=0)]
history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
with open(os.path.join(out, f"history.{rank}.json"), "w") as f:
    json.dump(history.history, f)
