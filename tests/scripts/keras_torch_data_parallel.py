"""Keras master's torch DataParallel (keras#23316; not in Keras 3.15.1) as one process of a job.

``keras.distribution.initialize()`` on master's torch backend starts the process group (gloo on
CPU) from the KERAS_DISTRIBUTION_* and torchrun variables mgpu-train exports;
``keras.distribution.DataParallel`` then wraps the model in DDP inside ``fit``. A small
regression fit on arrays (each process its half), different initial weights on each process.

Usage: keras_torch_data_parallel.py OUT_DIR   (writes OUT_DIR/rank.N.json)
"""

import json
import os
import sys

import numpy as np
import torch.distributed as dist

import keras

keras.distribution.initialize()
distribution = keras.distribution.DataParallel()
distribution.auto_shard_dataset = False  # arrays: each process feeds its own half (below)
keras.distribution.set_distribution(distribution)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = x @ rng.normal(size=(8, 1)).astype("float32")
keras.utils.set_random_seed(dist.get_rank())  # different initial weights: DDP makes them one
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
part = slice(dist.get_rank(), None, dist.get_world_size())
history = model.fit(x[part], y[part], batch_size=32, epochs=3, verbose=0)
report = {"world_size": dist.get_world_size(), "keras_file": keras.__file__,
          "loss": history.history["loss"],
          "weights": [float(np.sum(w)) for w in model.get_weights()]}
with open(os.path.join(sys.argv[1], f"rank.{dist.get_rank()}.json"), "w") as f:
    json.dump(report, f)
