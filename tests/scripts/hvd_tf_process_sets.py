"""Test worker for process sets under mgpu_launch.tensorflow: OUT_DIR/rank<r>.json.

    mgpu-train -np 4 hvd_tf_process_sets.py OUT_DIR

Sets {0, 2} and {1, 3} (each rank uses the one it is in) and {0, 1, 2}. Every collective
within a set eagerly and inside a tf.function (TensorFlow collective groups of their own),
interleaved with collectives over every rank; DistributedGradientTape(process_set=) in a
tf.function; the errors of a rank outside a set. The test computes the expected numbers.
"""

import json
import os
import sys

import numpy as np
from reported import error_of, plain

import mgpu_launch.tensorflow as hvd

even, odd, first_three = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3]), hvd.ProcessSet([0, 1, 2])
hvd.init(process_sets=[even, odd, first_three])
import tensorflow as tf  # noqa: E402

out_dir = sys.argv[1]
rank = hvd.rank()
mine, other = (even, odd) if rank % 2 == 0 else (odd, even)


def value(r):
    return tf.constant([r + 1.0, 10.0 * (r + 1), -float(r)])


def collectives():
    """The same calls eagerly and traced; returns {name: tensor}."""
    rows = tf.reshape(tf.range(12, dtype=tf.float32), [4, 3]) * (rank + 1)
    slices = tf.IndexedSlices(tf.fill([rank + 1, 2], float(rank + 1)), tf.fill([rank + 1], rank),
                              tf.constant([4, 2]))
    sparse = hvd.allreduce(slices, op=hvd.Sum, process_set=mine)
    result = {
        "sum": hvd.allreduce(value(rank), op=hvd.Sum, process_set=mine),
        "global_sum": hvd.allreduce(value(rank), op=hvd.Sum),         # between set collectives
        "average": hvd.allreduce(value(rank), process_set=mine),
        "average_int": hvd.allreduce(tf.constant([3 * rank + 1]), process_set=mine),
        "min": hvd.allreduce(value(rank), op=hvd.Min, process_set=mine),
        "max": hvd.allreduce(value(rank), op=hvd.Max, process_set=mine),
        "grouped": hvd.grouped_allreduce([value(rank), tf.constant([rank], tf.int64)],
                                         op=hvd.Sum, process_set=mine),
        "allgather": hvd.allgather(tf.fill([rank + 1, 2], float(rank)), process_set=mine),
        "broadcast": hvd.broadcast(value(rank), root_rank=mine.ranks[-1], process_set=mine),
        "reducescatter": hvd.reducescatter(rows, op=hvd.Sum, process_set=mine),
        "alltoall": hvd.alltoall(tf.range(4) + 10 * rank, process_set=mine),
        "sparse_values": sparse.values, "sparse_indices": sparse.indices,
    }
    if first_three.included():
        result["first_three"] = hvd.allreduce(value(rank), op=hvd.Sum, process_set=first_three)
    return result


report = {"eager": plain(collectives()), "graph": plain(tf.function(collectives)()),
          "ops": [int(hvd.size_op(mine.process_set_id)),
                  int(hvd.process_set_included_op(mine.process_set_id)),
                  int(hvd.process_set_included_op(other.process_set_id)),
                  int(hvd.size_op(first_three.process_set_id)), int(hvd.size_op())]}

variable = tf.Variable([rank + 1.0, rank + 2.0])
hvd.broadcast_variables([variable], root_rank=mine.ranks[-1], process_set=mine)
report["broadcast_variables_eager"] = variable.numpy().tolist()
variable.assign([rank + 1.0, rank + 2.0])
tf.function(lambda: hvd.broadcast_variables([variable], mine.ranks[0], process_set=mine))()
report["broadcast_variables_graph"] = variable.numpy().tolist()
report["objects"] = [hvd.broadcast_object({"from": rank}, root_rank=mine.ranks[-1],
                                          process_set=mine),
                     hvd.allgather_object(rank, process_set=mine)]
hvd.barrier(process_set=mine)


# DistributedGradientTape within a set: a linear model, loss mean((x w - y)^2) on this rank's
# batch; the test computes every rank's gradient by hand and averages over the set.
def batch(r):
    state = np.random.RandomState(r)
    return state.randn(5, 3).astype(np.float32), state.randn(5, 1).astype(np.float32)


w = tf.Variable(np.array([[0.5], [-1.0], [2.0]], np.float32))
x, y = (tf.constant(a) for a in batch(rank))


@tf.function
def tape_gradient(process_set):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    return hvd.DistributedGradientTape(tape, process_set=process_set).gradient(loss, [w])[0]


report["tape_mine"] = tape_gradient(mine).numpy().tolist()
report["tape_first_three"] = tape_gradient(first_three).numpy().tolist()  # rank 3: local
report["tape_global"] = tape_gradient(hvd.global_process_set).numpy().tolist()

report["errors"] = {
    "eager": error_of(lambda: hvd.allreduce(value(rank), process_set=other)),
    "traced": error_of(tf.function(lambda: hvd.allgather(value(rank), process_set=other))),
    "broadcast_root": error_of(lambda: hvd.broadcast(value(rank), root_rank=other.ranks[0],
                                                     process_set=mine)),
    "size_op": error_of(lambda: hvd.size_op(99)),
    "add_static": error_of(lambda: hvd.add_process_set([0, 1])),
}
hvd.barrier()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
