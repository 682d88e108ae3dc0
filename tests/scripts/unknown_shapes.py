"""Test worker for tests/backends/test_tensorflow_unknown_shapes.py (issue 48): the TensorFlow
engine's allreduce on tensors whose static shape is unknown inside a tf.function, as a
Horovod-style custom loop meets them (``hvd.allreduce`` of a per-batch tensor).

    mgpu-train -np N unknown_shapes.py OUT_DIR

Rank r sums, in one fused call, a (rows, 3) float32 tensor of value r + 1 traced with an
unknown row count, a (2, 2) tensor of static shape and a float64 vector of unknown length;
it writes the results to ``OUT_DIR/rank<r>.npz``.
"""

import os
import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import tensorflow as tf  # noqa: E402 - after init, as the README asks

from mgpu_launch.backends import get_engine  # noqa: E402

rank = mgpu.rank()


@tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32),
                              tf.TensorSpec([None], tf.float64)])
def summed(rows, vector):
    fixed = tf.fill([2, 2], float(rank + 1))
    return get_engine().allreduce([rows, fixed, vector], average=False)


outputs = summed(tf.fill([4, 3], float(rank + 1)), tf.range(5, dtype=tf.float64) * (rank + 1))
np.savez(os.path.join(sys.argv[1], f"rank{rank}.npz"), *[o.numpy() for o in outputs])
