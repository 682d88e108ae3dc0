"""Test worker: ranks whose fit arguments disagree must fail before the first step.

    mgpu-train -np 2 uneven.py MODE [MODE...]    MODE: train, validation, freq, unknown, agree

train: rank r has 64 + 32 r samples (2 vs 3 batches of 32); validation: equal training data,
validation sets of 32 vs 64 samples; freq: validation_freq 1 vs 2; unknown: a generator
without steps_per_epoch (cannot be checked: a warning); agree: sharded data, runs.

One job runs the modes in turn, each on a fresh model (one start-up of the framework, not one
per mode). Every mode but the last reports on stdout, each line starting with ``MODE:`` —
``MODE: MismatchError: ...`` when fit refused, ``MODE: rank R trained N epochs`` when it ran,
``MODE: warning: ...`` for each warning fit gave — and the job goes on. The last mode's error
is not caught: it ends the job as it would a user's script.
"""

import sys
import warnings

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402

rank = mgpu.rank()


def arrays(n):
    return np.ones((n, 4), "float32"), np.zeros((n,), "int32")


def generator():
    for _ in range(2):
        yield arrays(32)


def fit(mode):
    """One fit of a fresh model with `mode`'s disagreement; returns the epochs trained."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
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
    return len(history.history["loss"])


*caught, last = sys.argv[1:]
for mode in caught:
    with warnings.catch_warnings(record=True) as given:
        warnings.simplefilter("always")
        try:
            print(f"{mode}: rank {rank} trained {fit(mode)} epochs", flush=True)
        except mgpu.MismatchError as error:
            print(f"{mode}: MismatchError: {error}", flush=True)
    for warning in given:
        print(f"{mode}: warning: {warning.message}", flush=True)
print(f"{last}: rank {rank} trained {fit(last)} epochs")
