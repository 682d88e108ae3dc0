"""Test worker for resuming with another number of processes: which samples trained, and when.

    mgpu-train -np N resize_ids.py BACKUP_DIR OUT_DIR [KILL_EPOCH KILL_BATCH]

64 samples (RESIZE_SAMPLES) of 5 random features, mgpu.data.shard(batch_size=4 (RESIZE_BATCH),
shuffle=True), 3 epochs (RESIZE_EPOCHS), BackupAndRestore every 3 batches. RESIZE_DATA=digits:
the first RESIZE_SAMPLES of scikit-learn's 8x8 digits instead (a 64-128-10 classifier, learning
rate scale_lr(0.02)), and every rank also logs the accuracy on the last 360 images (held out)
when training ends.

With KILL_EPOCH KILL_BATCH (0-based), the last rank SIGKILLs itself at the end of that batch, in
the first attempt only (MGPU_RESTART_COUNT 0 or unset). With RESIZE_STEP_SECONDS, every step
sleeps that long (an elastic test's job lasts while hosts come and go). With RESIZE_RAISE, a
comma-separated list of ATTEMPT:EPOCH:BATCH (ATTEMPT * for every attempt), the last rank raises
RuntimeError("the data source failed") at the end of that batch of that attempt.

Each rank writes OUT_DIR/attempt.A.rank.R.json as it trains: the size, its host name, the backup
it resumed from (file names in BACKUP_DIR when training began), for every trained step its
epoch, batch and the ids of the samples it trained on, and the sum of |momentum buffers| after
each step and before the first (as restored); as it leaves (also when it stops for a resize),
whether mgpu-train's resize signal reached it; at the end the optimizer's step count and
learning rate, and the final weights (attempt.A.rank.R.npz). Its pid goes to OUT_DIR/pid.A.R.
"""

import json
import os
import signal
import socket
import sys
import time

import numpy as np

import mgpu_launch as mgpu
from mgpu_launch.training.callbacks.schedule import velocity_slots
from mgpu_launch.config import markers as worker

mgpu.init()
import keras  # noqa: E402
import tiny_model  # noqa: E402

backup_dir, out = sys.argv[1], sys.argv[2]
# RESIZE_ATTEMPT: a test that starts the attempts itself (mgpu-train sets MGPU_RESTART_COUNT 0)
attempt = os.environ.get("RESIZE_ATTEMPT") or os.environ.get("MGPU_RESTART_COUNT", "0")
kill = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 and attempt == "0" else None
pause = float(os.environ.get("RESIZE_STEP_SECONDS", "0"))
raises = {(int(e), int(b)) for a, e, b in (item.split(":") for item in
                                          os.environ.get("RESIZE_RAISE", "").split(",") if item)
          if a in ("*", attempt)}
samples = int(os.environ.get("RESIZE_SAMPLES", "64"))
digits = os.environ.get("RESIZE_DATA") == "digits"
if digits:
    from sklearn.datasets import load_digits

    images = load_digits()
    order = np.random.default_rng(0).permutation(len(images.target))
    x_all = (images.data[order] / 16.0).astype("float32")
    y_all = images.target[order].astype("int32")
    x, y, x_val, y_val = x_all[:samples], y_all[:samples], x_all[-360:], y_all[-360:]
    keras.utils.set_random_seed(42)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=mgpu.DistributedOptimizer(
        keras.optimizers.SGD(mgpu.scale_lr(0.02), momentum=0.9)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
else:
    rng = np.random.default_rng(7)  # the same data on every rank: shard() splits it
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = rng.integers(0, 3, size=samples)
    model = tiny_model.compiled(keras, mgpu)
id_of = {row.tobytes(): i for i, row in enumerate(x)}
train = mgpu.data.shard((x, y), batch_size=int(os.environ.get("RESIZE_BATCH", "4")), shuffle=True,
                        seed=3)
fetched = {}


class Recorded(type(train)):
    def __getitem__(self, index):
        batch = super().__getitem__(index)
        fetched[(self.epoch, index)] = [id_of[row.tobytes()] for row in batch[0]]
        return batch


train.__class__ = Recorded
path = os.path.join(out, f"attempt.{attempt}.rank.{mgpu.rank()}")


def velocity():
    """Sum of |momentum buffers| of the optimizer."""
    return float(sum(np.abs(keras.ops.convert_to_numpy(v)).sum()
                     for v in velocity_slots(model.optimizer)))


with open(os.path.join(out, f"pid.{attempt}.{mgpu.rank()}"), "w") as f:
    f.write(str(os.getpid()))
log = {"size": mgpu.size(), "host": socket.gethostname(), "trained": []}


def write():
    with open(path + ".json.partial", "w") as f:
        json.dump(log, f)
    os.replace(path + ".json.partial", path + ".json")


class Trace(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):  # the backup BackupAndRestore resumes from
        found = os.listdir(backup_dir) if os.path.isdir(backup_dir) else []
        log["resumed_from"] = sorted(n for n in found if not n.startswith("."))
        write()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        log.setdefault("velocity_at_start", velocity())  # as restored (and corrected)

    def on_train_batch_end(self, batch, logs=None):
        log["trained"].append([self.epoch, batch, fetched[(train.epoch, batch)]])
        log.setdefault("velocity", []).append(velocity())  # what a backup after it holds
        write()
        if kill == (self.epoch, batch) and mgpu.rank() == mgpu.size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if (self.epoch, batch) in raises and mgpu.rank() == mgpu.size() - 1:
            raise RuntimeError("the data source failed")
        time.sleep(pause)


try:
    model.fit(train, epochs=int(os.environ.get("RESIZE_EPOCHS", "3")), verbose=0,
              # Trace first: it logs a step before a backup point can end the program (a resize)
              callbacks=[Trace(), mgpu.callbacks.BackupAndRestore(backup_dir, save_freq=3)])
finally:  # also when the job stops for a resize (SystemExit at a backup point)
    log["resize_signal"] = worker.resize_requested()
    write()
if digits:
    log["accuracy"] = float(model.evaluate(x_val, y_val, verbose=0)[1])
log["iterations"] = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
log["learning_rate"] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
np.savez(path + ".npz", *model.get_weights())
write()
