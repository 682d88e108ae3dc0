"""Test worker in the shape of Horovod's examples/elastic/tensorflow2/tensorflow2_mnist_elastic.py
(a custom TF2 loop with DistributedGradientTape under @hvd.elastic.run), ported by its import
line, on synthetic 8x8 one-channel images (nothing is downloaded).

    mgpu-train -np 2 --min-np 1 --max-np 2 --host-discovery-script D hvd_tf2_elastic.py \
        STATE_DIR OUT_DIR

TF2_STATE picks the state: ``variables`` (default) ``hvd.elastic.TensorFlowState`` over the
model's and the optimizer's variables; ``keras`` ``TensorFlowKerasState(model, opt)`` as
Horovod's example. Every step trains one global batch of 16 images, split evenly over the
attempt's ranks, so a job resized 2 -> 1 -> 2 trains the batches of an uninterrupted one
(Horovod's example keeps each rank's batch and scales the learning rate in its reset callback;
here the rate stays, and the reset callback records the size it ran at). TF2_STEPS steps (24),
a commit every TF2_COMMIT_EVERY (2), TF2_STEP_SECONDS of sleep after each step (0).

Each rank writes OUT_DIR/attempt.A.rank.R.json as it trains (A = MGPU_RESTART_COUNT): the
size, state.batch when train() began, the steps trained, the sizes the reset callbacks ran
at; and at the end its weights (attempt.A.rank.R.npz). Its pid goes to OUT_DIR/pid.A.R.
"""

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import mgpu_launch.tensorflow as hvd  # was: import horovod.tensorflow as hvd

hvd.init()
import keras  # noqa: E402

state_dir, out = sys.argv[1], sys.argv[2]
attempt = os.environ.get("MGPU_RESTART_COUNT", "0")
kind = os.environ.get("TF2_STATE", "variables")
steps = int(os.environ.get("TF2_STEPS", "24"))
commit_every = int(os.environ.get("TF2_COMMIT_EVERY", "2"))
pause = float(os.environ.get("TF2_STEP_SECONDS", "0"))
GLOBAL_BATCH, LR = 16, 0.01
path = os.path.join(out, f"attempt.{attempt}.rank.{hvd.rank()}")
with open(os.path.join(out, f"pid.{attempt}.{hvd.rank()}"), "w") as f:
    f.write(str(os.getpid()))
log = {"size": hvd.size(), "trained": [], "resets": []}


def write():
    with open(path + ".json.partial", "w") as f:
        json.dump(log, f)
    os.replace(path + ".json.partial", path + ".json")


# The same images on every rank and in every attempt; step b's global batch is rows
# b * 16 ... b * 16 + 15, and this rank takes its share of them.
rng = np.random.default_rng(7)
images = rng.normal(size=(steps, GLOBAL_BATCH, 8, 8, 1)).astype("float32")
labels = rng.integers(0, 10, size=(steps, GLOBAL_BATCH)).astype("int64")
per_rank = GLOBAL_BATCH // hvd.size()
mine = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
dataset = tf.data.Dataset.from_tensor_slices((images[:, mine], labels[:, mine]))

keras.utils.set_random_seed(100 + hvd.rank())  # different on every rank: run()'s sync fixes it
mnist_model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(4, 3, activation="relu"),
    keras.layers.MaxPooling2D(2),
    keras.layers.Flatten(),
    keras.layers.Dense(16, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
loss = keras.losses.SparseCategoricalCrossentropy()
opt = keras.optimizers.Adam(LR)


@tf.function
def training_step(batch_images, batch_labels):
    with tf.GradientTape() as tape:
        loss_value = loss(batch_labels, mnist_model(batch_images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, mnist_model.trainable_variables)
    opt.apply_gradients(zip(grads, mnist_model.trainable_variables))
    return loss_value


# The optimizer's slots must exist before the state is made (Horovod's example runs one step
# without the allreduce for this; Keras 3 builds them directly).
opt.build(mnist_model.trainable_variables)


@hvd.elastic.run
def train(state):
    log["started"] = state.batch
    write()
    for batch_images, batch_labels in dataset.skip(state.batch):
        loss_value = training_step(batch_images, batch_labels)
        log["trained"].append(state.batch)
        write()
        state.batch += 1
        if state.batch % 8 == 0 and hvd.rank() == 0:
            print(f"Step #{state.batch}\tLoss: {float(loss_value):.6f}", flush=True)
        time.sleep(pause)
        if state.batch % commit_every == 0:
            state.commit()


def on_state_reset():
    log["resets"].append(hvd.size())
    opt.learning_rate.assign(LR)  # the global batch stays 16: so does the rate


if kind == "keras":
    state = hvd.elastic.TensorFlowKerasState(mnist_model, opt, backup_dir=state_dir, batch=0)
else:
    state = hvd.elastic.TensorFlowState(mnist_model.variables + opt.variables,
                                        backup_dir=state_dir, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
log.update(final=state.batch, iterations=int(opt.iterations.numpy()),
           state_dir_left=os.path.exists(state_dir))
np.savez(path + ".npz", *mnist_model.get_weights())
write()
