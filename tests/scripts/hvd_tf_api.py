"""Test worker for mgpu_launch.tensorflow (horovod.tensorflow's names): OUT_DIR/rank<r>.json.

    mgpu-train -np 2 hvd_tf_api.py OUT_DIR

Every collective once eagerly and once inside a tf.function, a DistributedGradientTape train
step against one process with both ranks' batches (computed here on every rank with a plain
tape), a local source that must stay per rank, and the refusals.
"""

import json
import os
import sys

import numpy as np
from reported import plain

import mgpu_launch.tensorflow as hvd

hvd.init()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

out_dir = sys.argv[1]
rank, size = hvd.rank(), hvd.size()
report = {"topology": [rank, size, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                       hvd.cross_size(), hvd.is_homogeneous(),
                       int(hvd.rank_op()), int(hvd.size_op())],
          "process_set": [hvd.global_process_set.size(), hvd.global_process_set.ranks],
          "queries": {name: getattr(hvd, name)() for name in
                      ("mpi_built", "mpi_enabled", "gloo_built", "nccl_built", "cuda_built")},
          # TensorFlow's own answer: the `tensorflow` wheel (keras-hub brings it) has CUDA
          "built_with_cuda": tf.test.is_built_with_cuda()}


def collectives():
    """The same calls eagerly and traced; returns {name: tensor}."""
    mine = tf.fill([rank + 1, 2], float(rank + 1))             # uneven first dimension
    rows = tf.reshape(tf.range(4 * 3, dtype=tf.float32), [4, 3]) * (rank + 1)
    slices = tf.IndexedSlices(tf.fill([rank + 1, 2], float(rank + 1)),
                              tf.fill([rank + 1], rank), tf.constant([3, 2]))
    sparse = hvd.allreduce(slices, op=hvd.Sum)
    return {
        "allreduce": hvd.allreduce(tf.constant([rank + 1.0, 10.0])),
        "allreduce_sum_int": hvd.allreduce(tf.constant([rank + 1]), op=hvd.Sum),
        "allreduce_avg_int": hvd.allreduce(tf.constant([rank + 2])),   # (2 + 3) // 2
        "allreduce_min": hvd.allreduce(tf.constant([rank + 1.0]), op=hvd.Min),
        "allreduce_max": hvd.allreduce(tf.constant([rank + 1.0]), op=hvd.Max),
        "allreduce_scaled": hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, prescale_factor=2.0,
                                          postscale_factor=3.0),
        "allreduce_fp16": hvd.allreduce(tf.constant([rank + 0.5]),
                                        compression=hvd.Compression.fp16),
        "grouped": hvd.grouped_allreduce([tf.constant([rank + 1.0]), tf.constant([[rank * 2.0]]),
                                          tf.constant([rank], tf.int64)], op=hvd.Sum),
        "allgather": hvd.allgather(mine),
        "allgather_int": hvd.allgather(tf.range(rank + 2)),
        "broadcast": hvd.broadcast(tf.constant([rank + 7.0, -1.0]), root_rank=1),
        "reducescatter": hvd.reducescatter(rows, op=hvd.Sum),
        "reducescatter_odd": hvd.reducescatter(tf.ones([3, 1]) * (rank + 1)),  # 3 rows, 2 ranks
        "alltoall": hvd.alltoall(tf.range(4) + 10 * rank),
        "alltoall_splits": hvd.alltoall(tf.range(3) + 10 * rank, splits=[1, 2] if rank == 0
                                        else [2, 1]),
        "sparse_values": sparse.values, "sparse_indices": sparse.indices,
    }


report["eager"] = plain(collectives())
report["graph"] = plain(tf.function(collectives)())

variable = tf.Variable([rank + 1.0, rank + 2.0])
hvd.broadcast_variables([variable], root_rank=1)
report["broadcast_variables_eager"] = variable.numpy().tolist()
counter = tf.Variable(rank, dtype=tf.int64)
tf.function(lambda: hvd.broadcast_variables([variable, counter], root_rank=0))()
report["broadcast_variables_graph"] = [variable.numpy().tolist(), int(counter.numpy())]
report["broadcast_object"] = hvd.broadcast_object({"from": rank}, root_rank=1)
report["allgather_object"] = hvd.allgather_object(rank)

# DistributedGradientTape in a tf.function == one process with both ranks' batches.
keras.utils.set_random_seed(7)                        # the same start on every rank
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(3)])
reference = keras.models.clone_model(model)
reference.set_weights(model.get_weights())
local_head = keras.layers.Dense(1)                    # a per-rank layer: never averaged
local_head.build((None, 3))
local_head.set_weights([np.full((3, 1), rank + 1.0, "float32"), np.zeros(1, "float32")])
opt, ref_opt = keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01)
data = np.random.default_rng(3).normal(size=(4, size * 6, 5)).astype("float32")
target = np.random.default_rng(4).normal(size=(4, size * 6, 3)).astype("float32")
loss_fn = keras.losses.MeanSquaredError()


@tf.function
def train_step(x, y, first_batch):
    with tf.GradientTape() as tape:
        out = model(x, training=True)
        loss = loss_fn(y, out) + tf.reduce_mean(local_head(tf.stop_gradient(out))) * 1e-3
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local_head])
    variables = model.trainable_variables + local_head.trainable_variables
    grads = tape.gradient(loss, variables)
    opt.apply_gradients(zip(grads, variables))
    if first_batch:  # Horovod's TF2 examples: rank 0's state everywhere after the first update
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)   # Keras 2's call form
    return loss


@tf.function
def reference_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, reference(x, training=True))
    grads = tape.gradient(loss, reference.trainable_variables)
    ref_opt.apply_gradients(zip(grads, reference.trainable_variables))


for step in range(4):
    train_step(data[step, rank * 6:(rank + 1) * 6], target[step, rank * 6:(rank + 1) * 6],
               step == 0)
    reference_step(data[step], target[step])
report["tape_max_diff"] = max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6)))
                              for a, b in zip(model.get_weights(), reference.get_weights()))
report["tape_allclose"] = all(np.allclose(a, b, rtol=1e-5, atol=1e-6)
                              for a, b in zip(model.get_weights(), reference.get_weights()))
report["local_kernel"] = local_head.get_weights()[0].ravel().tolist()

errors = {}
for label, call in {
        "adasum": lambda: hvd.allreduce(tf.ones([1]), op=hvd.Adasum),
        "process_set": lambda: hvd.allreduce(tf.ones([1]), process_set=object()),
        "groups": lambda: hvd.DistributedGradientTape(tf.GradientTape(), groups=2),
        "timeline": lambda: hvd.start_timeline("timeline.json", mark_cycles=True),
        "join": lambda: hvd.join(),
        "sparse_min": lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]),
                                                             tf.constant([3, 2])), op=hvd.Min),
        # tf2xla lowers TF's collective reduce for Add and Mul merges only
        "xla_max": lambda: tf.function(lambda x: hvd.allreduce(x, op=hvd.Max),
                                       jit_compile=True)(tf.ones([2])),
}.items():
    try:
        call()
        errors[label] = None
    except (ValueError, AttributeError) as error:
        errors[label] = [type(error).__name__, str(error)]
report["errors"] = errors

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
    json.dump(report, file)
