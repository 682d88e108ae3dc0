"""Data-parallel Keras training with mgpu-launch: the three added lines are marked.

    mgpu-train -np 2 examples/train.py --epochs 5

A small classifier on synthetic data (made here, so nothing is downloaded). Each rank trains on
its own slice of every global batch; gradients are averaged across ranks at every step.
"""

import argparse

import numpy as np

import mgpu_launch as mgpu

mgpu.init()                                                    # (1) join the job, first
import keras  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=32, help="per process")
parser.add_argument("--lr", type=float, default=0.05, help="for one process; scaled by size()")
parser.add_argument("--checkpoint", default="checkpoints/train.keras",
                    help="written by rank 0 after every epoch")
args = parser.parse_args()

# The same synthetic data set on every rank (fixed seed): 4096 samples, 20 features, 4 classes.
rng = np.random.default_rng(0)
centers = rng.normal(scale=0.3, size=(4, 20))
labels = rng.integers(0, 4, size=4096)
features = (centers[labels] + rng.normal(size=(4096, 20))).astype("float32")
split = 3584
x_train, y_train = features[:split], labels[:split]
x_val, y_val = features[split:], labels[split:]
# This rank's shard (every rank gets the same number of samples).
per_rank = len(x_train) // mgpu.size()
mine = slice(mgpu.rank() * per_rank, (mgpu.rank() + 1) * per_rank)

model = keras.Sequential([
    keras.Input((20,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(4),
])
optimizer = mgpu.DistributedOptimizer(                          # (2) average the gradients
    keras.optimizers.SGD(mgpu.scale_lr(args.lr), momentum=0.9))
model.compile(optimizer=optimizer,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
model.fit(x_train[mine], y_train[mine], batch_size=args.batch_size, epochs=args.epochs,
          validation_data=(x_val, y_val),
          callbacks=[mgpu.callbacks.BroadcastGlobalVariablesCallback(0),   # (3) same start,
                     mgpu.callbacks.MetricAverageCallback(),              #     same logs,
                     # the recipe: ramp the scaled rate up over the first epochs (Goyal et al.),
                     # checkpoints from rank 0 only, samples/s over all ranks
                     mgpu.callbacks.LearningRateWarmupCallback(mgpu.scale_lr(args.lr),
                                                               warmup_epochs=2),
                     mgpu.callbacks.ModelCheckpoint(args.checkpoint),
                     mgpu.callbacks.ThroughputCallback(args.batch_size, verbose=0)],
          verbose=2 if mgpu.is_chief() else 0)
if mgpu.is_chief():
    loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
    print(f"validation accuracy after {args.epochs} epochs on {mgpu.size()} processes: "
          f"{accuracy:.3f}")
