"""The full recipe on real data that ships with scikit-learn (8x8 handwritten digits).

    mgpu-train -np 2 examples/keras_digits.py      # the README's quick start: ~1 min on 2 CPU cores

Each rank trains on its own equal shard of the 1437 training images; the learning rate is the
one-process rate scaled by the number of processes, reached through a warm-up (Goyal et al.);
gradients and epoch metrics are averaged; rank 0 writes the checkpoint and prints the final
validation accuracy over the 360 held-out images.
"""

import argparse

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32, help="per process")
parser.add_argument("--base-lr", type=float, default=0.02, help="for one process")
parser.add_argument("--warmup-epochs", type=int, default=5)
parser.add_argument("--checkpoint", default="checkpoints/digits.keras")
parser.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"],
                    help="the gradients' wire format (mgpu.Compression)")
args = parser.parse_args()

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
order = np.random.default_rng(0).permutation(len(x))  # the same split on every rank
x, y = x[order], y[order]
x_train, y_train, x_val, y_val = x[:1437], y[:1437], x[1437:], y[1437:]
per_rank = len(x_train) // mgpu.size()
mine = slice(mgpu.rank() * per_rank, (mgpu.rank() + 1) * per_rank)

keras.utils.set_random_seed(42)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                          keras.layers.Dense(10)])
lr = mgpu.scale_lr(args.base_lr)
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9),
                                                compression=getattr(mgpu.Compression,
                                                                    args.compression)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
callbacks = [mgpu.callbacks.BroadcastGlobalVariablesCallback(0),
             mgpu.callbacks.MetricAverageCallback(),
             mgpu.callbacks.ModelCheckpoint(args.checkpoint),
             mgpu.callbacks.ThroughputCallback(args.batch_size, verbose=0)]
if mgpu.size() > 1:
    callbacks.insert(2, mgpu.callbacks.LearningRateWarmupCallback(
        lr, warmup_epochs=args.warmup_epochs))
model.fit(x_train[mine], y_train[mine], batch_size=args.batch_size, epochs=args.epochs,
          validation_data=(x_val, y_val), callbacks=callbacks,
          verbose=2 if mgpu.is_chief() else 0)
_, accuracy = model.evaluate(x_val, y_val, verbose=0)
if mgpu.is_chief():
    print(f"final validation accuracy: {accuracy:.4f} ({mgpu.size()} processes, "
          f"{args.epochs} epochs, lr {lr:g})")
