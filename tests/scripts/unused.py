"""Test worker: a layer that only rank 0 uses, so rank 1 has no gradient for it.

    mgpu-train -np 2 unused.py OUT_DIR

Every rank must still take part in every allreduce (zeros for the missing gradient): the job
finishes and all ranks end with the same weights.
"""

import os
import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402


class TwoHeads(keras.Model):
    def __init__(self, use_extra):
        super().__init__()
        self.main = keras.layers.Dense(3)
        self.extra = keras.layers.Dense(3)
        self.use_extra = use_extra

    def build(self, input_shape):
        self.main.build(input_shape)
        self.extra.build(input_shape)  # built on every rank, called on rank 0 only

    def call(self, x):
        y = self.main(x)
        return y + self.extra(x) if self.use_extra else y


rng = np.random.default_rng(mgpu.rank())
x = rng.normal(size=(64, 5)).astype("float32")
y = rng.integers(0, 3, size=64)
model = TwoHeads(use_extra=mgpu.rank() == 0)
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=8, epochs=2, verbose=0)
np.savez(os.path.join(sys.argv[1], f"rank.{mgpu.rank()}.npz"), *model.get_weights())
print("finished", mgpu.rank())
