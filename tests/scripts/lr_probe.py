"""Test worker: a one-weight model whose every update reveals the learning rate the step used.

    mgpu-train -np 2 lr_probe.py '<json config>' OUT_DIR
    mgpu-train -np 2 lr_probe.py '[<json config with "name">, ...]' OUT_DIR

A list runs each config in turn in this one job (one start-up of the framework), each on a
fresh model, optimizer and callbacks, writing to OUT_DIR/<name>/.

The model is w * x with x = 1 and loss = mean(w * x), so the gradient is exactly 1 on every rank
and, without momentum, w drops by the learning rate at each step. Config: optimizer ("sgd",
"momentum" (0.9) or "schedule" (ExponentialDecay 0.1 x 0.9^step)), warmup_epochs,
schedule (a list [initial_lr, multiplier, start_epoch, end_epoch] for the schedule callback),
epochs, lr. Writes rank.N.json with w after every batch and the epoch logs' lr.
"""

import json
import os

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import configs  # noqa: E402 - tests/scripts/configs.py: one config or several
import keras  # noqa: E402


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights, self.lrs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(float(self.model.get_weights()[0].ravel()[0]))

    def on_epoch_end(self, epoch, logs=None):
        self.lrs.append(logs.get("lr"))


def probe(config, out_dir):
    """Train as `config` says; writes OUT_DIR/rank.<rank>.json."""
    lr = config.get("lr", 0.1)
    kind = config.get("optimizer", "sgd")
    if kind == "schedule":
        inner = keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(lr, 1, 0.9))
    else:
        inner = keras.optimizers.SGD(lr, momentum=0.9 if kind == "momentum" else 0.0)
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=mgpu.DistributedOptimizer(inner),
                  loss=lambda y_true, y_pred: keras.ops.mean(y_pred))
    callbacks = []
    if config.get("warmup_epochs"):
        callbacks.append(mgpu.callbacks.LearningRateWarmupCallback(
            lr, warmup_epochs=config["warmup_epochs"]))
    if config.get("schedule"):
        start_lr, multiplier, start, end = config["schedule"]
        callbacks.append(mgpu.callbacks.LearningRateScheduleCallback(
            start_lr, multiplier, start_epoch=start, end_epoch=end))
    record = Record()
    x = np.ones((8, 1), "float32")
    model.fit(x, x, batch_size=2, epochs=config.get("epochs", 3), shuffle=False, verbose=0,
              callbacks=callbacks + [record])
    with open(os.path.join(out_dir, f"rank.{mgpu.rank()}.json"), "w") as f:
        json.dump({"weights": record.weights, "lrs": record.lrs}, f)


configs.run_each(probe)
