"""Test worker for the JAX engine's set-up order.

    mgpu-train -np 2 jax_init.py imports-first | device-first

imports-first: keras and jax imported before mgpu.init() (allowed), then a psum-backed fit step.
device-first: a JAX array created before mgpu.init() (refused with a clear error).
"""

import sys

import jax
import keras
import numpy as np

import mgpu_launch as mgpu

if sys.argv[1] == "device-first":
    jax.numpy.ones(2).block_until_ready()
mgpu.init()
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mse")
# Rank r's target is r: the averaged gradient is what one process with both samples gets.
x = np.ones((1, 3), "float32")
model.fit(x, np.full((1, 1), mgpu.rank(), "float32"), batch_size=1, epochs=1, verbose=0)
kernels = mgpu.allgather_object(model.get_weights()[0].ravel().tolist())
print("ranks agree:", all(k == kernels[0] for k in kernels),
      "devices", jax.device_count(), "local", jax.local_device_count())
