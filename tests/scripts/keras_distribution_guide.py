"""The JAX flow of keras-io's distribution guide (guides/distribution.py), as one process of a job.

``keras.distribution.initialize()`` with no arguments (it reads the KERAS_DISTRIBUTION_*
variables mgpu-train exports), ``DataParallel`` over every process's devices, the guide's model
for MNIST-shaped inputs (Flatten, Dense 200 relu, Dropout, Dense 10 softmax; loss mse, adam),
trained with ``fit`` on a ``tf.data.Dataset`` batched by 16, as the guide's first version
feeds it (Keras shards it across the processes), of MNIST's shapes, since the test downloads
nothing: 28x28x1 images whose label is a fixed function of the pixels, so the loss can fall.

Usage: keras_distribution_guide.py OUT_DIR [NUM_PROCESSES]
    NUM_PROCESSES: passed to initialize() (the bad case: another count than the job's).
Writes OUT_DIR/rank.N.json (what this process saw, the losses) and OUT_DIR/rank.N.npz (its
weights after fit).
"""

import json
import os
import sys

import numpy as np

import keras
from keras import layers
from tensorflow import data as tf_data

out_dir = sys.argv[1]
asked = {"num_processes": int(sys.argv[2])} if len(sys.argv) > 2 else {}
keras.distribution.initialize(**asked)

import jax  # noqa: E402 (after initialize, as the guide does)

devices = keras.distribution.list_devices()
distribution = keras.distribution.DataParallel(devices=devices)
keras.distribution.set_distribution(distribution)

inputs = layers.Input(shape=(28, 28, 1))
y = layers.Flatten()(inputs)
y = layers.Dense(units=200, activation="relu")(y)
y = layers.Dropout(0.4)(y)
outputs = layers.Dense(units=10, activation="softmax")(y)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(loss="mse", optimizer="adam")

# The same 256 images on every process; Keras gives each process its part of every batch.
rng = np.random.default_rng(0)
images = rng.normal(size=(256, 28, 28, 1)).astype("float32")
labels = np.argmax(images.reshape(256, -1) @ rng.normal(size=(784, 10)), axis=1)
targets = np.eye(10, dtype="float32")[labels]
dataset = tf_data.Dataset.from_tensor_slices((images, targets)).batch(16)
history = model.fit(dataset, epochs=4, verbose=0)
index, count = jax.process_index(), jax.process_count()

rank = int(os.environ.get("KERAS_DISTRIBUTION_PROCESS_ID", "0"))
np.savez(os.path.join(out_dir, f"rank.{rank}.npz"),
         *[np.asarray(weight) for weight in model.get_weights()])
report = {"process_index": index, "process_count": count, "devices": len(devices),
          "loss": history.history["loss"],
          "addresses": os.environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES")}
with open(os.path.join(out_dir, f"rank.{rank}.json"), "w") as f:
    json.dump(report, f)
print("guide", json.dumps(report), flush=True)
