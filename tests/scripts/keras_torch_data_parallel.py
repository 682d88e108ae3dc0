"""Keras master's torch DataParallel (keras#23316; not in Keras 3.15.1) as one process of a job.

``keras.distribution.DataParallel`` on the torch backend wraps the model in DDP inside ``fit``
once torch.distributed is up; the process group is started from torchrun's variables, which
mgpu-train exports. A small regression fit on arrays.

Usage: keras_torch_data_parallel.py OUT_DIR   (writes OUT_DIR/rank.N.json)
"""

import json
import os
import sys

import numpy as np
import torch.distributed as dist

import keras

dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
keras.distribution.set_distribution(keras.distribution.DataParallel())
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = x @ rng.normal(size=(8, 1)).astype("float32")
keras.utils.set_random_seed(dist.get_rank())  # different initial weights: DDP makes them one
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
report = {"world_size": dist.get_world_size(), "keras_file": keras.__file__,
          "loss": history.history["loss"],
          "weights": [float(np.sum(w)) for w in model.get_weights()]}
with open(os.path.join(sys.argv[1], f"rank.{dist.get_rank()}.json"), "w") as f:
    json.dump(report, f)
