"""Test worker for BackupAndRestore: deterministic training that may be killed mid-epoch.

    mgpu-train -np 2 resume.py BACKUP_DIR OUT_DIR [KILL_EPOCH]

With KILL_EPOCH, rank 1 SIGKILLs itself at batch 2 of that epoch (0-based), in the first
attempt only (under mgpu-train --max-restarts, MGPU_RESTART_COUNT=0). With RESUME_SAVE_FREQ=N,
the backup is written every N steps (BackupAndRestore(save_freq=N), step-level backup).
Writes rank.N.npz with the final weights when training finishes.
"""

import os
import signal
import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402
import tiny_model  # noqa: E402

backup_dir, out = sys.argv[1], sys.argv[2]
kill_epoch = int(sys.argv[3]) if len(sys.argv) > 3 else None
if os.environ.get("MGPU_RESTART_COUNT", "0") != "0":
    kill_epoch = None  # a restart: the fault happened already
save_freq = os.environ.get("RESUME_SAVE_FREQ")
backup_options = {"save_freq": int(save_freq)} if save_freq else {}
rng = np.random.default_rng(mgpu.rank())
x = rng.normal(size=(32, 5)).astype("float32")
y = rng.integers(0, 3, size=32)
model = tiny_model.compiled(keras, mgpu)


class Killer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == kill_epoch and batch == 2 and mgpu.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


model.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0,
          callbacks=[mgpu.callbacks.BackupAndRestore(backup_dir, **backup_options), Killer()])
np.savez(os.path.join(out, f"rank.{mgpu.rank()}.npz"), *model.get_weights())
