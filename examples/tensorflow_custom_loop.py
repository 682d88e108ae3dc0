"""A TensorFlow custom training loop on mgpu-launch: Horovod's ``horovod.tensorflow`` names.

    mgpu-train -np 2 examples/tensorflow_custom_loop.py
    mgpu-train -np 2 examples/tensorflow_custom_loop.py --epochs 2     # CI's size

A ``tf.function`` train step with ``hvd.DistributedGradientTape`` (gradients averaged over
the ranks inside the step), ``hvd.broadcast_variables`` after the first step (every rank
continues from rank 0's weights and Adam state), ``hvd.allreduce`` of the loss and accuracy
inside a ``tf.function``, on the 8x8 digits that ship with scikit-learn. Each rank trains on
its own shard of the 1437 training images; rank 0 prints the validation accuracy over the
360 held-out images, averaged over the ranks' halves of them. A Horovod script of this shape
ports by its import line (docs/horovod-migration.md). TensorFlow backend only.
"""

import argparse

import numpy as np

import mgpu_launch.tensorflow as hvd    # was: import horovod.tensorflow as hvd

hvd.init()  # first: TensorFlow's collectives are set up before it creates any tensor
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--batch-size", type=int, default=32, help="per process")
parser.add_argument("--base-lr", type=float, default=0.002, help="for one process")
args = parser.parse_args()

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int64")
order = np.random.default_rng(0).permutation(len(x))  # the same split on every rank
x, y = x[order], y[order]
x_train, y_train, x_val, y_val = x[:1437], y[:1437], x[1437:], y[1437:]
per_rank, val_per_rank = len(x_train) // hvd.size(), len(x_val) // hvd.size()
mine = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
my_val = slice(hvd.rank() * val_per_rank, (hvd.rank() + 1) * val_per_rank)
dataset = (tf.data.Dataset.from_tensor_slices((x_train[mine], y_train[mine]))
           .shuffle(per_rank, seed=hvd.rank()).batch(args.batch_size, drop_remainder=True))

model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(128, activation="relu"),
                             tf.keras.layers.Dense(10)])
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
opt = tf.keras.optimizers.Adam(args.base_lr * hvd.size())  # the rate scaled by the ranks


@tf.function
def train_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)  # gradient() returns the ranks' average
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:  # after the first update, so that Adam's state exists to be copied
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return hvd.allreduce(loss)  # the mean loss over the ranks, still inside the step


@tf.function
def accuracy(images, labels):
    correct = tf.reduce_mean(tf.cast(tf.argmax(model(images), axis=1) == labels, tf.float32))
    return hvd.allreduce(correct)


for epoch in range(args.epochs):
    for batch, (images, labels) in enumerate(dataset):
        loss = train_step(images, labels, epoch == 0 and batch == 0)
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1}: loss {float(loss):.4f}", flush=True)

val_accuracy = float(accuracy(x_val[my_val], y_val[my_val]))
if hvd.rank() == 0:
    print(f"validation accuracy after {args.epochs} epochs on {hvd.size()} processes: "
          f"{val_accuracy:.4f}")
