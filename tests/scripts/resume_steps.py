"""Test worker for BackupAndRestore(save_freq=STEPS): killed mid-epoch, resumed mid-epoch.

    mgpu-train -np 2 resume_steps.py BACKUP_DIR OUT_DIR [KILL_EPOCH KILL_BATCH]

Trains on ``mgpu.data.shard`` data shuffled per epoch (8 batches per rank and epoch, 3 epochs),
backing up every 3 batches and keeping 2 backups. With KILL_EPOCH KILL_BATCH (0-based), rank 1
SIGKILLs itself at the end of that batch (in the first attempt only, under mgpu-train
--max-restarts). With RESUME_PLAIN_FIT=1, fit is called without shuffle= (Keras's default
shuffle=True). Writes rank.N.npz (final weights) and rank.N.json (the optimizer's step count,
and the (epoch, batch) of every step this run trained).
"""

import json
import os
import signal
import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402
import tiny_model  # noqa: E402

backup_dir, out = sys.argv[1], sys.argv[2]
kill = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else None
if os.environ.get("MGPU_RESTART_COUNT", "0") != "0":
    kill = None  # a restart: the fault happened already
fit_options = {} if os.environ.get("RESUME_PLAIN_FIT") else {"shuffle": False}
rng = np.random.default_rng(7)  # the same data on every rank: shard() splits it
x = rng.normal(size=(64, 5)).astype("float32")
y = rng.integers(0, 3, size=64)
model = tiny_model.compiled(keras, mgpu)


class Trace(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([self.epoch, batch])
        if kill == (self.epoch, batch) and mgpu.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


trace = Trace()
train = mgpu.data.shard((x, y), batch_size=4, shuffle=True, seed=3)
model.fit(train, epochs=3, verbose=0, **fit_options,
          callbacks=[mgpu.callbacks.BackupAndRestore(backup_dir, save_freq=3, keep=2), trace])
np.savez(os.path.join(out, f"rank.{mgpu.rank()}.npz"), *model.get_weights())
with open(os.path.join(out, f"rank.{mgpu.rank()}.json"), "w") as f:
    json.dump({"iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
               "steps": trace.steps}, f)
