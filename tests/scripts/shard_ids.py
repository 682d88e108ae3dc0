"""Test worker for mgpu.data.shard: which sample ids each rank sees, epoch by epoch.

    mgpu-train -np 2 shard_ids.py OUT_DIR

1001 samples whose feature is their id, batch 32, two epochs, for in-memory arrays (shuffled),
tf.data (shuffled) and a PyDataset; then one real fit on sharded arrays. Writes rank.N.json.
"""

import json
import os
import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

ids = np.arange(1001, dtype="float32").reshape(-1, 1)
labels = (np.arange(1001) % 2).astype("int32")


class Batches(keras.utils.PyDataset):
    def __init__(self):
        super().__init__()

    def __len__(self):
        return 32  # 31 full batches of 32 and one of 9

    def __getitem__(self, index):
        return ids[index * 32:(index + 1) * 32], labels[index * 32:(index + 1) * 32]


def epochs_of(dataset, iterate):
    seen = []
    for _ in range(2):
        seen.append([int(v) for batch in iterate(dataset) for v in np.ravel(batch[0])])
        if hasattr(dataset, "on_epoch_end"):
            dataset.on_epoch_end()
    return seen


by_index = lambda ds: [ds[i] for i in range(len(ds))]  # noqa: E731
by_iteration = lambda ds: [(b[0].numpy(),) for b in ds]  # noqa: E731
result = {
    "arrays": epochs_of(mgpu.data.shard((ids, labels), batch_size=32, shuffle=True, seed=3),
                        by_index),
    "tfdata": epochs_of(mgpu.data.shard(tf.data.Dataset.from_tensor_slices((ids, labels)),
                                        batch_size=32, shuffle=True, seed=3), by_iteration),
    "pydataset": epochs_of(mgpu.data.shard(Batches()), by_index),
}
model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)])
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(1e-4)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(mgpu.data.shard((ids, labels), batch_size=32, shuffle=True), epochs=2,
                    verbose=0)
result["fit_epochs"] = len(history.history["loss"])
with open(os.path.join(sys.argv[1], f"rank.{mgpu.rank()}.json"), "w") as f:
    json.dump(result, f)
