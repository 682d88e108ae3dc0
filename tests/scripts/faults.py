"""Test worker for the stall inspector, restarts and fault injection: a tiny model's fit.

    mgpu-train -np 2 faults.py OUT_DIR FAULT STEP

FAULT happens on rank 1 in on_train_batch_end of training step STEP (steps count from 1, across
epochs), on the first attempt only (MGPU_RESTART_COUNT unset or 0; on every attempt with
FAULT_EVERY_ATTEMPT=1):
    none    nothing
    sleep   sleep FAULT_SLEEP_S seconds (default 600): a stall
    raise   raise RuntimeError
    kill    SIGKILL itself
    slow    every rank sleeps 0.5 s per step from STEP on (for SIGTERM to the launcher)
Every rank writes OUT_DIR/pid.<rank>.<attempt> (its pid) at the start and
OUT_DIR/reached.<rank>.<attempt> (time.time()) when it finishes step STEP; rank 1 writes
OUT_DIR/fault.<attempt> (time.time()) just before the fault. Epochs: FAULT_EPOCHS (default 2),
16 steps each. With FAULT_GO_FILE=PATH every rank writes OUT_DIR/ready.<rank>.<attempt> before
fit and waits there (all at one place: no stall) until PATH exists.
"""

import os
import signal
import sys
import time

import numpy as np

import mgpu_launch as mgpu

out, fault, fault_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
attempt = os.environ.get("MGPU_RESTART_COUNT", "0")
faulty_attempt = attempt == "0" or os.environ.get("FAULT_EVERY_ATTEMPT") == "1"
mgpu.init()
import keras  # noqa: E402

rank = mgpu.rank()


def write(name, value):
    with open(os.path.join(out, f"{name}.tmp{os.getpid()}"), "w") as f:
        f.write(str(value))
    os.replace(os.path.join(out, f"{name}.tmp{os.getpid()}"), os.path.join(out, name))


write(f"pid.{rank}.{attempt}", os.getpid())
rng = np.random.default_rng(rank)
x = rng.normal(size=(64, 4)).astype("float32")
y = rng.integers(0, 2, size=64)
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.01)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class Fault(keras.callbacks.Callback):
    step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == fault_step:
            write(f"reached.{rank}.{attempt}", time.time())
        if fault == "slow" and self.step >= fault_step:
            time.sleep(0.5)
        if self.step != fault_step or rank != 1 or not faulty_attempt or fault in ("none", "slow"):
            return
        write(f"fault.{attempt}", time.time())
        if fault == "sleep":
            time.sleep(float(os.environ.get("FAULT_SLEEP_S", "600")))
        elif fault == "raise":
            raise RuntimeError(f"injected fault at step {self.step}")
        elif fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


go_file = os.environ.get("FAULT_GO_FILE")
if go_file:
    write(f"ready.{rank}.{attempt}", time.time())
    while not os.path.exists(go_file):
        time.sleep(0.1)
model.fit(x, y, batch_size=4, epochs=int(os.environ.get("FAULT_EPOCHS", "2")), shuffle=False,
          verbose=0, callbacks=[Fault()])
print(f"rank {rank} finished")
