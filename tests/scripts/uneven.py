"""Test worker: ranks whose fit arguments disagree must fail before the first step.

    mgpu-train -np 2 uneven.py {train,validation,freq,unknown,agree}

train: rank r has 64 + 32 r samples (2 vs 3 batches of 32); validation: equal training data,
validation sets of 32 vs 64 samples; freq: validation_freq 1 vs 2; unknown: a generator
without steps_per_epoch (cannot be checked: a warning); agree: sharded data, runs.
"""

import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402

mode, rank = sys.argv[1], mgpu.rank()
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.01)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def arrays(n):
    return np.ones((n, 4), "float32"), np.zeros((n,), "int32")


def generator():
    for _ in range(2):
        yield arrays(32)


train = arrays(64 + 32 * rank if mode == "train" else 64)
options = {"batch_size": 32, "epochs": 2, "verbose": 0}
if mode == "validation":
    options["validation_data"] = arrays(32 + 32 * rank)
elif mode == "freq":
    options.update(validation_data=arrays(32), validation_freq=1 + rank)
if mode == "unknown":
    del options["batch_size"]
    history = model.fit(generator(), **options)
elif mode == "agree":
    history = model.fit(mgpu.data.shard(arrays(130), batch_size=32), epochs=2, verbose=0,
                        validation_data=mgpu.data.shard(arrays(70), batch_size=16))
else:
    history = model.fit(*train, **options)
print(f"rank {rank} trained {len(history.history['loss'])} epochs")
