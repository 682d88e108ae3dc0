"""Where the keras-hub recipe's input time goes, on CPU (issue 63 item 4).

    KERAS_BACKEND=jax python benchmarks/transformers/recipe_feed_cpu.py > recipe_feed_cpu.txt

The recipe: ``mgpu.data.shard`` of a ``tf.data`` of token ids (GPT-2-small shapes: 32
sequences of 256 tokens a batch, ``token_ids`` + ``padding_mask`` + labels). Measured, one
process, no model: (1) CPU time per batch (``time.process_time``: every thread, tf.data's
included) of the two ways the JAX prefetch thread can turn it into numpy, Keras's
``TFDatasetAdapter.get_jax_iterator`` and tf.data's ``as_numpy_iterator``, against
``mgpu.data.shard`` of the arrays (a PyDataset); (2) what an epoch's start costs: making the
iterator and reading its first batch (the example's 2048 sequences of 64 tokens, and 2048 of
256). Each figure is the median of 5 repeats; the box is shared, so wall times are noisy and CPU
times are the figures to compare.
"""

import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
import numpy as np  # noqa: E402

import mgpu_launch as mgpu  # noqa: E402

mgpu.init()
import tensorflow as tf  # noqa: E402
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter  # noqa: E402
from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter  # noqa: E402

BATCH, BATCHES = 32, 200


def data(sequences, length):
    ids = np.random.default_rng(0).integers(1, 8192, (sequences, length + 1)).astype("int32")
    return {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}, ids[:, 1:]


def recipe(sequences=BATCH * BATCHES, length=256):
    dataset = tf.data.Dataset.from_tensor_slices(data(sequences, length))
    return mgpu.data.shard(dataset, batch_size=BATCH, shuffle=True, seed=1)


def per_batch(make, repeats=5):
    """(CPU ms, wall ms) per batch over BATCHES - 1 batches after the first, medians."""
    cpu, wall = [], []
    for _ in range(repeats):
        iterator = make()
        next(iterator)
        c, w = time.process_time(), time.perf_counter()
        for _ in range(BATCHES - 1):
            next(iterator)
        cpu.append(1000 * (time.process_time() - c) / (BATCHES - 1))
        wall.append(1000 * (time.perf_counter() - w) / (BATCHES - 1))
    return statistics.median(cpu), statistics.median(wall)


def epoch_start(dataset, repeats=5):
    """ms from making the iterator to its first batch (median)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        next(iter(dataset))
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


if __name__ == "__main__":
    print(f"tensorflow {tf.__version__}; {os.cpu_count()} CPUs; batch {BATCH} x 256 tokens")
    arrays = PyDatasetAdapter(mgpu.data.shard(data(BATCH * BATCHES, 256), batch_size=BATCH),
                              shuffle=False)
    for name, make in (
            ("recipe, Keras's TFDatasetAdapter.get_jax_iterator (the JAX feed's source)",
             lambda: TFDatasetAdapter(recipe()).get_jax_iterator()),
            ("recipe, tf.data's own as_numpy_iterator (for comparison)",
             lambda: recipe().as_numpy_iterator()),
            ("arrays, mgpu.data.shard((x, y)) through Keras's PyDatasetAdapter",
             arrays.get_jax_iterator)):
        cpu, wall = per_batch(make)
        print(f"{name}: {cpu:.3f} ms CPU, {wall:.3f} ms wall per batch")
    for sequences, length in ((2048, 64), (2048, 256)):
        print(f"epoch start, shard of {sequences} sequences x {length} tokens (shuffled): "
              f"{epoch_start(recipe(sequences, length)):.1f} ms to the first batch")
