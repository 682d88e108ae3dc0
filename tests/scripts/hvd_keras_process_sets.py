"""Test worker for process sets under mgpu_launch.keras, any backend: OUT_DIR/rank<r>.json.

    HOROVOD_DYNAMIC_PROCESS_SETS=1 mgpu-train -np 4 hvd_keras_process_sets.py OUT_DIR

Sets added after init() (Horovod's switch in the environment): {0, 2} and {1, 3}, each rank
using the one it is in, and {0, 1, 2}. The host collectives of Horovod's Keras names within
a set, and two `fit`s of a linear model whose DistributedOptimizer reduces within a set: the
test replays both by hand (rank 3 is outside {0, 1, 2}: it trains on its own batches). On JAX
the first fit's refusal is reported instead.
"""

import json
import os
import sys

import numpy as np

import mgpu_launch.keras as hvd

hvd.init()
import keras  # noqa: E402

out_dir = sys.argv[1]
rank = hvd.rank()
even, odd = hvd.add_process_set([0, 2]), hvd.add_process_set(hvd.ProcessSet([1, 3]))
first_three = hvd.add_process_set([0, 1, 2])
mine = even if rank % 2 == 0 else odd


def plain(value):
    return np.asarray(keras.ops.convert_to_numpy(value)).tolist()


report = {
    "ids": [even.process_set_id, odd.process_set_id, first_three.process_set_id],
    "allreduce": plain(hvd.allreduce(np.array([rank + 1.0, -rank]), op=hvd.Sum,
                                     process_set=mine)),
    "average": plain(hvd.allreduce(np.array([rank + 1.0]), process_set=mine)),
    "allgather": plain(hvd.allgather(np.array([rank, rank]), process_set=mine)),
    "broadcast": plain(hvd.broadcast(np.array([rank * 10.0]), root_rank=mine.ranks[-1],
                                     process_set=mine)),
    "reducescatter": plain(hvd.reducescatter(np.ones((4, 1)) * (rank + 1), op=hvd.Sum,
                                             process_set=mine)),
    "broadcast_object": hvd.broadcast_object(rank, root_rank=mine.ranks[-1], process_set=mine),
}


def batches(r):
    state = np.random.RandomState(r)
    return state.randn(10, 3).astype("float32"), state.randn(10, 1).astype("float32")


def fit(process_set):
    """Two SGD steps of a linear model (every rank starts from its own kernel, rank + 1)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(rank + 1.0))])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                     process_set=process_set), loss="mse")
    x, y = batches(rank)
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    return plain(model.layers[0].kernel)


try:
    report["fit_mine"] = fit(mine)
    report["fit_first_three"] = fit(first_three)
except ValueError as error:  # the JAX engine reduces over every rank only
    report["fit_error"] = str(error)
report["removed"] = hvd.remove_process_set(first_three)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
