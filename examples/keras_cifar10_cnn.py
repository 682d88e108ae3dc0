"""The classic Keras CIFAR-10 CNN (1.25M parameters), data-parallel, from a local copy of CIFAR-10.

    mgpu-train -np 2 examples/keras_cifar10_cnn.py /data/cifar-10-batches-py --epochs 25
    mgpu-train -np 2 examples/keras_cifar10_cnn.py --synthetic --epochs 1   # random data

The data is the "CIFAR-10 python version" (cifar-10-python.tar.gz from
https://www.cs.toronto.edu/~kriz/cifar.html, unpacked: a folder ``cifar-10-batches-py`` with
data_batch_1 ... data_batch_5 and test_batch). Nothing is downloaded at run time: fetch and
unpack it once where every host can read it, and pass the folder. ``--synthetic`` trains on
random images of CIFAR's shape instead (for trying the job, not for accuracy).

Each rank trains on its own equal part of the training set (``mgpu.data.shard``, reshuffled
every epoch in step), with the learning rate scaled by the number of processes and reached
through a warm-up; rank 0 writes the checkpoint and prints the final validation accuracy,
averaged over the ranks' parts of the test set.
"""

import argparse
import os
import pickle

import numpy as np

import mgpu_launch as mgpu

FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]

parser = argparse.ArgumentParser()
parser.add_argument("data_dir", nargs="?", help="the unpacked cifar-10-batches-py folder")
parser.add_argument("--synthetic", action="store_true", help="random data, no data_dir")
parser.add_argument("--epochs", type=int, default=25)
parser.add_argument("--batch-size", type=int, default=32, help="per process")
parser.add_argument("--base-lr", type=float, default=1e-4, help="for one process (RMSprop)")
parser.add_argument("--warmup-epochs", type=int, default=3)
parser.add_argument("--train-samples", type=int, default=None,
                    help="use only the first N training (and N/5 test) images: a quick run")
parser.add_argument("--checkpoint", default="checkpoints/cifar10_cnn.keras")
args = parser.parse_args()


def check_data_dir(path):
    """Exit with status 2 and a message saying what to pass, unless `path` holds CIFAR-10."""
    if args.synthetic:
        return
    fix = ("Download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz once, unpack it "
           "(tar xzf cifar-10-python.tar.gz) and pass the cifar-10-batches-py folder it "
           "creates; or pass --synthetic to train on random data of CIFAR-10's shape.")
    if path is None:
        parser.error(f"no CIFAR-10 folder given. Expected the path of the unpacked "
                     f"cifar-10-batches-py folder (python version). {fix}")
    if not os.path.isdir(path):
        parser.error(f"{path!r}: no such folder. Expected the unpacked cifar-10-batches-py "
                     f"folder (python version). {fix}")
    missing = [name for name in FILES if not os.path.isfile(os.path.join(path, name))]
    if missing:
        inner = os.path.join(path, "cifar-10-batches-py")
        hint = f" Did you mean {inner!r}?" if os.path.isdir(inner) else ""
        parser.error(f"{path!r} is not the CIFAR-10 python folder: it lacks "
                     f"{', '.join(missing)} (expected data_batch_1 ... data_batch_5 and "
                     f"test_batch).{hint} {fix}")


def load_batches(path, names):
    """Images as float32 NHWC in [0, 1], labels as int32, from the pickled batch files."""
    images, labels = [], []
    for name in names:
        with open(os.path.join(path, name), "rb") as file:
            batch = pickle.load(file, encoding="bytes")
        images.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], np.int32))
    x = np.concatenate(images).transpose(0, 2, 3, 1).astype("float32") / 255.0
    return x, np.concatenate(labels)


def load():
    samples = args.train_samples or 50000
    # a fifth as many test images, but at least one batch per rank
    test_samples = max(samples // 5, args.batch_size * mgpu.size())
    if args.synthetic:
        rng = np.random.default_rng(0)  # the same data on every rank, as a real file would be
        return [(rng.random((n, 32, 32, 3), dtype=np.float32),
                 rng.integers(0, 10, size=n).astype("int32")) for n in (samples, test_samples)]
    (x_train, y_train) = load_batches(args.data_dir, FILES[:5])
    (x_test, y_test) = load_batches(args.data_dir, FILES[5:])
    if args.train_samples:
        x_train, y_train = x_train[:samples], y_train[:samples]
        x_test, y_test = x_test[:test_samples], y_test[:test_samples]
    return (x_train, y_train), (x_test, y_test)


check_data_dir(args.data_dir)  # before starting anything: a wrong path costs a second
mgpu.init()
import keras  # noqa: E402

(x_train, y_train), (x_test, y_test) = load()
train = mgpu.data.shard((x_train, y_train), batch_size=args.batch_size, shuffle=True, seed=1)
test = mgpu.data.shard((x_test, y_test), batch_size=args.batch_size)

keras.utils.set_random_seed(42)
layers = keras.layers
model = keras.Sequential([
    keras.Input((32, 32, 3)),
    layers.Conv2D(32, 3, padding="same", activation="relu"),
    layers.Conv2D(32, 3, activation="relu"),
    layers.MaxPooling2D(),
    layers.Dropout(0.25),
    layers.Conv2D(64, 3, padding="same", activation="relu"),
    layers.Conv2D(64, 3, activation="relu"),
    layers.MaxPooling2D(),
    layers.Dropout(0.25),
    layers.Flatten(),
    layers.Dense(512, activation="relu"),
    layers.Dropout(0.5),
    layers.Dense(10, activation="softmax"),
])
lr = mgpu.scale_lr(args.base_lr)
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.RMSprop(lr)),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
callbacks = [mgpu.callbacks.BroadcastGlobalVariablesCallback(0),
             mgpu.callbacks.MetricAverageCallback(),
             mgpu.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=args.warmup_epochs),
             mgpu.callbacks.ModelCheckpoint(args.checkpoint),
             mgpu.callbacks.ThroughputCallback(args.batch_size, verbose=0)]
history = model.fit(train, epochs=args.epochs, validation_data=test, callbacks=callbacks,
                    verbose=2 if mgpu.is_chief() else 0)
if mgpu.is_chief():
    print(f"{model.count_params()} parameters; final validation accuracy: "
          f"{history.history['val_accuracy'][-1]:.4f} ({mgpu.size()} processes, "
          f"{args.epochs} epochs, {'synthetic' if args.synthetic else 'CIFAR-10'} data)")
