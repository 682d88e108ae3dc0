"""TensorFlow backend: host memory and step time over a long run (CPU, 2 processes).

    mgpu-train -np 2 benchmarks/tf_long_run.py [STEPS] [BLOCK] [OUT.jsonl]

A tiny Dense model trained with ``DistributedOptimizer`` and ``fit`` for STEPS steps (default
100000) in epochs of BLOCK steps (default 5000). After every epoch each rank appends one row:
steps done, its resident set size (VmRSS), the epoch's mean and median wall time per step, its
process CPU time per step, and the 1-minute load average. The box is shared: a busy neighbour
inflates the mean wall time; the median and the CPU time per step are the robust figures.
Rank 0 prints the summary: RSS growth from the end of the first block to the end, and the last
block's step times over the second block's (the first block includes tracing).
"""

import json
import os
import sys
import time

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
block = int(sys.argv[2]) if len(sys.argv) > 2 else 5_000
out = sys.argv[3] if len(sys.argv) > 3 else None


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Probe(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rows = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.durations, self.last = [], self.start

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self.durations.append(now - self.last)
        self.last = now

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self.start
        cpu = time.process_time() - self.cpu_start
        row = {"rank": mgpu.rank(), "steps": (epoch + 1) * block, "rss_mb": round(rss_mb(), 1),
               "step_ms": round(1000 * seconds / block, 4),
               "median_step_ms": round(1000 * float(np.median(self.durations)), 4),
               "cpu_ms_per_step": round(1000 * cpu / block, 4),
               "load1": round(os.getloadavg()[0], 2)}
        self.rows.append(row)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
        if mgpu.rank() == 0:
            print(json.dumps(row), flush=True)


rng = np.random.default_rng(mgpu.rank())
x = rng.normal(size=(256, 8)).astype("float32")
y = rng.normal(size=(256, 1)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.001)), loss="mse")
probe = Probe()
model.fit(data, steps_per_epoch=block, epochs=steps // block, verbose=0,
          callbacks=[mgpu.callbacks.BroadcastGlobalVariablesCallback(0), probe])
if mgpu.rank() == 0 and len(probe.rows) >= 3:
    first, second, last = probe.rows[0], probe.rows[1], probe.rows[-1]
    print(json.dumps({"summary": True, "steps": last["steps"],
                      "rss_growth_mb": round(last["rss_mb"] - first["rss_mb"], 1),
                      **{f"{key}_last_over_second": round(last[key] / second[key], 3)
                         for key in ("step_ms", "median_step_ms", "cpu_ms_per_step")}}),
          flush=True)
