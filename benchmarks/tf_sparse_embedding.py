"""Sparse (allgather of IndexedSlices) vs dense (allreduce) embedding gradients, TF, CPU.

    mgpu-train -np 2 benchmarks/tf_sparse_embedding.py [--rows 1000000] [--dim 64] [--steps 8]

Two measurements, for ``DistributedOptimizer(sparse_as_dense=False)`` (the default: every
rank's slices gathered) and ``sparse_as_dense=True`` (the slices summed into a dense table
gradient, then allreduced):

1. ``train``: a Keras model ``Embedding(rows, dim) -> mean -> Dense(1)`` with SGD (which keeps
   the update sparse: a scatter into the touched rows), ``train_on_batch`` on a batch of
   tokens drawn uniformly, so that ~1% of the table's rows are touched per rank; median step
   time of `--steps` steps after 2 warm-up steps, and the plain optimizer (no reduction) as
   the baseline.
2. ``reduce``: the gradient reduction alone (the engine's ``reduce_gradients`` on one
   IndexedSlices in a ``tf.function``), at several touched fractions, to find where dense
   starts to win.

Bytes each rank sends per step are computed from the buffers' sizes: sparse, a ring gather
passes every other rank's padded block on: (N-1) x padded rows x (dim x 4 + 8) bytes (values
+ int64 indices; rows padded to the engine's buckets, at most +12.5%); dense, a ring
allreduce: 2 (N-1)/N x rows x dim x 4 bytes. Rank 0 prints one JSON line per measurement.
"""

import argparse
import json
import statistics
import time

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from mgpu_launch.backends import get_engine  # noqa: E402
from mgpu_launch.backends.reduction import GradientReduction  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=1_000_000)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--fractions", default="0.001,0.01,0.05,0.2,0.5")
args = parser.parse_args()
size, rank = mgpu.size(), mgpu.rank()
rng = np.random.default_rng(rank)


def padded(rows: int) -> int:
    unit = 1 << max(rows.bit_length() - 4, 0)
    return -(-rows // unit) * unit


def sent_bytes(sparse: bool, touched_rows: int) -> int:
    if sparse:
        return (size - 1) * padded(touched_rows) * (args.dim * 4 + 8)
    return int(2 * (size - 1) / size * args.rows * args.dim * 4)


def median(run, steps: int) -> float:
    times = []
    for _ in range(2 + steps):
        mgpu.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def emit(**row):
    if rank == 0:
        print(json.dumps(row), flush=True)


# 1. a whole train step, ~1% of the rows touched per rank
tokens_per_step = args.rows // 100
x = rng.integers(0, args.rows, (tokens_per_step // 100, 100)).astype("int64")
y = rng.normal(size=(len(x), 1)).astype("float32")
for mode in ("plain", "sparse", "dense"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((100,), dtype="int64"),
                              keras.layers.Embedding(args.rows, args.dim),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
    if mode != "plain":
        optimizer = mgpu.DistributedOptimizer(optimizer, sparse_as_dense=mode == "dense")
    model.compile(optimizer=optimizer, loss="mse")
    seconds = median(lambda: model.train_on_batch(x, y), args.steps)
    emit(measure="train", mode=mode, np=size, rows=args.rows, dim=args.dim,
         tokens_per_rank=int(x.size), touched_rows_per_rank=int(len(np.unique(x))),
         step_s=round(seconds, 4),
         bytes_sent_per_rank=0 if mode == "plain" else sent_bytes(mode == "sparse", x.size))

# 2. the reduction alone, at several touched fractions
engine = get_engine()
for fraction in [float(f) for f in args.fractions.split(",")]:
    touched = max(1, int(args.rows * fraction))
    values = tf.ones([touched, args.dim])
    indices = tf.constant(rng.integers(0, args.rows, touched))
    for mode in ("sparse", "dense"):
        @tf.function
        def reduce(values, indices, dense=mode == "dense"):
            gradient = tf.IndexedSlices(values, indices, tf.constant([args.rows, args.dim]))
            return engine.reduce_gradients([gradient], [None],
                                           GradientReduction(sparse_as_dense=dense))

        seconds = median(lambda: [getattr(t, "values", t).numpy()[:1]
                                  for t in reduce(values, indices)], args.steps)
        emit(measure="reduce", mode=mode, np=size, rows=args.rows, dim=args.dim,
             touched_fraction=fraction, reduce_s=round(seconds, 4),
             bytes_sent_per_rank=sent_bytes(mode == "sparse", touched))
