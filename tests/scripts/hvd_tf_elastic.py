"""Test worker: a Horovod elastic custom TensorFlow loop, ported by its import line only (the
shape of Horovod's elastic/tensorflow2_mnist_elastic.py, on local data).

    mgpu-train -np 2 [--max-restarts 1] hvd_tf_elastic.py STATE_DIR OUT_DIR [FAIL_BATCH]

Each rank builds the model from its own seed (run()'s sync must give every rank rank 0's), then
trains 12 batches of its shard with a tf.function step and DistributedGradientTape, SGD with
momentum, committing every 2 batches. With FAIL_BATCH (0-based), rank 1 raises after training
that batch in the first attempt (MGPU_RESTART_COUNT 0). Writes rank.N.npz (final weights) and
rank.N.json: the batch train() started from and the batches this attempt trained.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import mgpu_launch.tensorflow as hvd  # was: import horovod.tensorflow as hvd

hvd.init()
import keras  # noqa: E402

state_dir, out = sys.argv[1], sys.argv[2]
fail = int(sys.argv[3]) if len(sys.argv) > 3 else None
if os.environ.get("MGPU_RESTART_COUNT", "0") != "0":
    fail = None  # the restart: the fault happened already
STEPS, BATCH = 12, 4
rng = np.random.default_rng(7)
x = rng.normal(size=(STEPS * BATCH * hvd.size(), 5)).astype("float32")
y = rng.integers(0, 3, size=len(x))
keras.utils.set_random_seed(100 + hvd.rank())  # different on every rank, on purpose
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                          keras.layers.Dense(3)])
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
opt = keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)


@tf.function
def training_step(images, labels):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


trained, started = [], {}


@hvd.elastic.run
def train(state):
    started.update(batch=state.batch, note=state.note)
    for batch in range(state.batch, STEPS):
        rows = slice((batch * hvd.size() + hvd.rank()) * BATCH,
                     (batch * hvd.size() + hvd.rank() + 1) * BATCH)
        training_step(x[rows], y[rows])
        trained.append(batch)
        if batch == fail and hvd.rank() == 1:
            raise RuntimeError(f"injected fault after batch {batch}")
        state.batch = batch + 1
        if state.batch % 2 == 0:
            state.commit()


def on_state_reset():
    opt.learning_rate = 0.05 * hvd.size()


state = hvd.elastic.TensorFlowKerasState(model, opt, backup_dir=state_dir, batch=0, note="tf")
state.register_reset_callbacks([on_state_reset])
train(state)
np.savez(os.path.join(out, f"rank.{hvd.rank()}.npz"), *model.get_weights())
with open(os.path.join(out, f"rank.{hvd.rank()}.json"), "w") as f:
    json.dump({"started": started, "trained": trained, "final": state.batch,
               "iterations": int(opt.iterations.numpy()),
               "state_dir_left": os.path.exists(state_dir)}, f)
