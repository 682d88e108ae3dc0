"""Test worker for the efficiency report and the timeline: a short fit made slow on purpose.

    mgpu-train -np 2 [--timeline FILE] efficiency.py MODE

MODE ``input``: every batch takes SLEEP seconds to read (a PyDataset sleeping in
``__getitem__``). MODE ``rank``: rank 1 alone sleeps SLEEP seconds in a callback before each
step. MODE ``comm``: a model of about 4.2M parameters (17 MB of float32 gradients) on a
batch of 2, whose gradient allreduce dominates the step. MODE ``plain``: none of these.
MODE ``crash``: rank 1 raises in a callback before step FAULT_STEP. MODE ``stall``: rank 1
sleeps 120 s there (the stall inspector ends the job). MODE ``sigterm``: rank 1 sends itself
SIGTERM there and sleeps (what Slurm's time limit or mpirun's teardown does to a rank).
MODE ``small``: a job too small to judge: 6 epochs of 4 steps, each validated on 24 batches
and ended by a 0.3 s sleep on every rank (a checkpoint's time, the same on each rank and
whatever the box's load: on CI's loaded 2-core box, validation alone did not always outweigh
a rank descheduled for 54 ms a step, or the JAX and torch steps).
Rank 0 prints the report (verbose=2).
"""

import os
import signal
import sys
import time

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402

MODE, SLEEP, FAULT_STEP = sys.argv[1], 0.04, 10
BATCHES, EPOCHS = (4, 6) if MODE == "small" else (24, 1)
BATCH = 2 if MODE == "comm" else 16


class Batches(keras.utils.PyDataset):
    def __init__(self, batches=BATCHES):
        super().__init__()
        rng = np.random.default_rng(mgpu.rank())
        self.batches = batches
        self.x = rng.normal(size=(batches * BATCH, 8)).astype("float32")
        self.y = rng.normal(size=(batches * BATCH, 1)).astype("float32")

    def __len__(self):
        return self.batches

    def __getitem__(self, index):
        if MODE == "input":
            time.sleep(SLEEP)
        part = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[part], self.y[part]


class SlowRank(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if MODE == "small":
            time.sleep(0.3)  # every rank: a fixed cost of each epoch

    def on_train_batch_begin(self, batch, logs=None):
        if MODE == "rank" and mgpu.rank() == 1:
            time.sleep(SLEEP)
        if batch == FAULT_STEP and mgpu.rank() == 1:
            if MODE == "crash":
                raise RuntimeError(f"rank 1 fails on purpose before step {batch}")
            if MODE == "stall":
                time.sleep(120)
            if MODE == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(120)


keras.utils.set_random_seed(1)
if MODE == "comm":
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(2048, activation="relu")
                                                    for _ in range(2)] + [keras.layers.Dense(1)])
else:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
model.fit(Batches(), epochs=EPOCHS, verbose=2 if mgpu.rank() == 0 else 0, callbacks=[SlowRank()],
          validation_data=Batches(24) if MODE == "small" else None)
