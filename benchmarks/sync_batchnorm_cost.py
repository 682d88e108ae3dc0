"""Per-step cost of synchronized BatchNorm: the same CNN with local vs synchronized statistics.

    mgpu-train -np 2 benchmarks/sync_batchnorm_cost.py [--steps 30] [--batch 16] [--rounds 3]
    mgpu-train -np 2 benchmarks/sync_batchnorm_cost.py --model resnet50 --size 224 --batch 64

Both ranks train, in one process, a small CNN (4 x [Conv2D 3x3 -> BatchNormalization ->
ReLU], 16 to 64 channels (144 BatchNorm channels), 16x16 images, global average pooling,
Dense 10) or, with ``--model resnet50``, Keras's ResNet-50 (53 BatchNormalization layers,
every one made synchronized), twice: with ``keras.layers.BatchNormalization()`` and with
``synchronized=True``, both with a ``DistributedOptimizer``. The difference is the
BatchNorm collectives: one gather of ranks x (2C + 1) floats per layer forward and one
backward. Both models are built and warmed up (5 steps), then each round times ``--steps``
``train_on_batch`` steps of each, interleaved (local, sync, sync, local, ...) so that the load
of a shared machine falls on both; the cost is the median of the paired differences. Rank 0
prints one JSON line per round.
"""

import argparse
import json
import platform
import statistics
import time

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=("cnn", "resnet50"), default="cnn")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch", type=int, default=16, help="per rank")
parser.add_argument("--size", type=int, default=16)
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()

rng = np.random.default_rng(mgpu.rank())
x = rng.normal(size=(args.batch, args.size, args.size, 3)).astype("float32")
y = rng.integers(0, 10, size=args.batch)


def build(synchronized: bool):
    keras.utils.set_random_seed(0)
    if args.model == "resnet50":
        model = keras.applications.ResNet50(weights=None, classes=10,
                                            input_shape=(args.size, args.size, 3))
        for layer in model.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = synchronized
        return model
    layers = [keras.Input((args.size, args.size, 3))]
    for channels in (16, 32, 32, 64):
        layers += [keras.layers.Conv2D(channels, 3, padding="same", use_bias=False),
                   keras.layers.BatchNormalization(synchronized=synchronized),
                   keras.layers.ReLU()]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
    return keras.Sequential(layers)


def compiled(synchronized: bool):
    model = build(synchronized)
    model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(5):
        model.train_on_batch(x, y)
    return model


def timed_step(model) -> float:
    start = time.perf_counter()
    model.train_on_batch(x, y)
    return time.perf_counter() - start


models = {"local": compiled(False), "sync": compiled(True)}
bn = [layer for layer in models["sync"].layers
      if isinstance(layer, keras.layers.BatchNormalization)]
for round_ in range(args.rounds):
    # Steps interleaved (local, sync, sync, local, ...): a shared machine's load falls on both.
    times = {"local": [], "sync": []}
    for step in range(args.steps):
        for name in (("local", "sync") if step % 2 == 0 else ("sync", "local")):
            times[name].append(timed_step(models[name]))
    paired = sorted(s - t for s, t in zip(times["sync"], times["local"]))
    row = {"round": round_, "backend": keras.backend.backend(), "ranks": mgpu.size(),
           "model": args.model, "batch_per_rank": args.batch, "image": args.size,
           "bn_layers": len(bn), "bn_channels": sum(int(b.moving_mean.shape[0]) for b in bn),
           "local_median_ms": 1e3 * statistics.median(times["local"]),
           "sync_median_ms": 1e3 * statistics.median(times["sync"]),
           "local_min_ms": 1e3 * min(times["local"]), "sync_min_ms": 1e3 * min(times["sync"]),
           "extra_median_paired_ms": 1e3 * statistics.median(paired)}
    row["extra_ms_per_layer"] = row["extra_median_paired_ms"] / len(bn)
    if mgpu.rank() == 0:
        row.update(keras=keras.__version__, python=platform.python_version())
        print(json.dumps(row), flush=True)
