"""Test worker: a Horovod elastic Keras script, ported by its import line only.

    mgpu-train -np 2 [--max-restarts 1] hvd_elastic.py STATE_DIR OUT_DIR [FAIL_EPOCH FAIL_BATCH]

8 batches per rank and epoch of ``mgpu.data.shard`` data, 3 epochs, a commit every 2 batches.
With FAIL_EPOCH FAIL_BATCH (0-based), rank 1 raises at the end of that batch in the first
attempt (MGPU_RESTART_COUNT 0). Writes rank.N.npz (final weights) and rank.N.json: the state
train() started from, and the (epoch, batch) of every step this attempt trained.
"""

import json
import os
import sys

import numpy as np

import mgpu_launch.keras as hvd  # was: import horovod.tensorflow.keras as hvd

hvd.init()
import keras  # noqa: E402
import tiny_model  # noqa: E402

import mgpu_launch as mgpu  # noqa: E402 - only for the test's sharded data

state_dir, out = sys.argv[1], sys.argv[2]
fail = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else None
if os.environ.get("MGPU_RESTART_COUNT", "0") != "0":
    fail = None  # the restart: the fault happened already
rng = np.random.default_rng(7)
x = rng.normal(size=(64, 5)).astype("float32")
y = rng.integers(0, 3, size=64)
model = tiny_model.compiled(keras, hvd)
data = mgpu.data.shard((x, y), batch_size=4, shuffle=True, seed=3)
epochs, trained, started = 3, [], {}


class Fault(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = state.epoch  # the state's numbering: fit's epoch 0 is state.epoch

    def on_train_batch_end(self, batch, logs=None):
        trained.append([self.epoch, batch])
        if fail == (self.epoch, batch) and hvd.rank() == 1:
            raise RuntimeError(f"injected fault after batch {batch} of epoch {self.epoch}")


def on_state_reset():
    state.model.optimizer.learning_rate = 0.1 * hvd.size()


state = hvd.elastic.KerasState(model, backup_dir=state_dir, batch=0, epoch=0, note="tiny")
state.register_reset_callbacks([on_state_reset])
callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.CommitStateCallback(state, batches_per_commit=2), Fault()]


@hvd.elastic.run
def train(state):
    started.update(epoch=state.epoch, batch=state.batch, note=state.note)
    state.model.fit(data, epochs=epochs - state.epoch, callbacks=callbacks, verbose=0)


train(state)
np.savez(os.path.join(out, f"rank.{hvd.rank()}.npz"), *model.get_weights())
with open(os.path.join(out, f"rank.{hvd.rank()}.json"), "w") as f:
    json.dump({"started": started, "trained": trained, "final": [state.epoch, state.batch],
               "state_dir_left": os.path.exists(state_dir)}, f)
