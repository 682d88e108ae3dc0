"""This rank's part of a data set, with the same number of batches on every rank.

    train = mgpu.data.shard((x, y), batch_size=64, shuffle=True, seed=1)
    model.fit(train, epochs=10)

Why equal counts matter: every step is a collective, so a rank with one batch more waits
forever for the others (and BatchNorm on an empty remainder writes NaN into its statistics).
:func:`shard` therefore drops the remainder that cannot be split evenly — fewer than
``size x batch_size`` samples per epoch (fewer than ``size`` batches for a PyDataset) — and
checks over MPI that every rank ends up with the same number of batches.

The epoch's batches are laid out across the ranks, not in blocks: global batch i is the i-th
``size x batch_size`` samples of the epoch's order, rank r taking the r-th ``batch_size`` of
them. What the job has trained on is then a prefix of the order whatever the size, so a job
restarted with another number of processes continues an interrupted epoch at the same sample
(``BackupAndRestore``; docs/backup_and_resume.md, "Resuming with another number of processes").

Validation data sharded the same way gives, after ``MetricAverageCallback``, the metric over
the evaluated samples (all but the dropped remainder); for the exact whole-set figure evaluate
on rank 0 alone.

Device prefetch (:class:`mgpu_launch.training.prefetch.Prefetcher`): on the JAX and torch
backends, once a ``DistributedOptimizer`` exists, ``fit`` / ``evaluate`` / ``predict`` take their batches from a
background thread that produces them (slicing, shuffling, your PyDataset's ``__getitem__``)
and copies them to the device ``MGPU_PREFETCH`` (default 2 on GPU, off on CPU) batches ahead
of the step, so the host work overlaps the device's. ``MGPU_PREFETCH=0`` turns it off
(Keras's own feeding).
On TensorFlow the same thread iterates a ``tf.data`` input and copies its batches to the GPU
(``backends/tensorflow/feeding.py``). A ``tf.data`` that :func:`shard` returned is shuffled,
batched and ``.prefetch(tf.data.AUTOTUNE)``-ed already, and on JAX the device feed begins
its next epoch (a new tf.data iterator, its shuffle buffer filled) while the current one ends
(``training/sharded.py``).
"""

from typing import Any, Optional

import keras
import numpy as np

from mgpu_launch import runtime
from mgpu_launch.runtime import collectives
from mgpu_launch.training import patches, sharded
# Re-exported: the prefetcher lived here before it moved below the engines.
from mgpu_launch.training.prefetch import Prefetcher, prefetch_depth  # noqa: F401


def _placement():
    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    return 0, 1


def _agree(batches: int, what: str) -> int:
    if runtime.is_multi_process():
        everyone = collectives.allgather_object(int(batches))
        if len(set(everyone)) != 1:
            raise collectives.MismatchError(
                f"mgpu.data.shard: ranks would run different numbers of batches per epoch for "
                f"{what}: {everyone}. Give every rank the same data (same length) to shard.")
    return batches


class _Shard(keras.utils.PyDataset):
    """An epoch's order, read by all ranks in step: global batch i is the `per_step` units
    from ``start + i * per_step`` (a unit: a sample for arrays, a batch for a PyDataset), of
    which rank r reads the r-th part. The units done after i batches are therefore a prefix
    of the order, whatever the size: a job restarted with another size continues at the same
    global position (:meth:`start_at`, used by ``BackupAndRestore``)."""

    keeps_its_order = True  # fit does not reorder it (epoch_resume.keeps_its_order)
    units = per_step = batches = 0
    _start = 0  # the unit where batch 0 of this epoch starts; < 0 only in a resumed epoch

    def __len__(self):
        return self.batches

    def _first_unit(self, index: int) -> int:
        # Batches before a resumed epoch's first are read and dropped: any valid unit will do.
        return max(0, self._start + index * self.per_step)

    def position(self, batches_done: int) -> int:
        """Units of this epoch's order done after `batches_done` of its batches (all ranks)."""
        return self._start + int(batches_done) * self.per_step

    def start_at(self, position: int) -> int:
        """Continue this epoch at unit `position` of its order, with this job's size.

        The rest of the epoch is split into whole global batches of this size; what is left
        over (fewer than ``per_step`` units) is dropped, as every epoch drops its remainder.

        Returns:
            The batch index the epoch continues at: batches before it are not trained, and
            ``len(self)`` means nothing of this epoch is left.
        """
        left = max(0, self.units - int(position)) // self.per_step
        skip = self.batches - min(left, self.batches)
        self._start = int(position) - skip * self.per_step
        return skip

    def on_epoch_end(self):
        self._start = 0
        self.skip_epochs(1)

    def skip_epochs(self, count: int) -> None:  # noqa: D102 - see the subclasses
        raise NotImplementedError


class ShardedArrays(_Shard):
    """Batches of this rank's part of in-memory arrays; reshuffled every epoch, in step."""

    def __init__(self, data, batch_size: int, shuffle: bool, seed: int):
        super().__init__()
        self.data, self.batch_size, self.shuffle, self.seed = data, batch_size, shuffle, seed
        leaves = [np.asarray(a) for a in keras.tree.flatten(data)]
        lengths = {len(a) for a in leaves}
        if len(lengths) != 1:
            raise ValueError(f"mgpu.data.shard: the arrays have different lengths "
                             f"{sorted(lengths)}; expected one sample axis shared by all")
        self.samples = self.units = lengths.pop()
        self.unit = "sample"
        self.rank, self.size = _placement()
        self.per_step = self.size * batch_size
        self.batches = _agree(self.samples // self.per_step, "these arrays")
        if self.batches == 0:
            fix = (f"use batch_size={self.samples // self.size} or less" if
                   self.samples >= self.size else
                   "there are fewer samples than ranks, so no batch_size can help: use more "
                   "samples, or fewer processes (-np)")
            raise ValueError(
                f"mgpu.data.shard: {self.samples} samples cannot give each of {self.size} "
                f"ranks one batch of {batch_size}; {fix}")
        self.epoch = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        if self.shuffle:
            return np.random.default_rng([self.seed, self.epoch]).permutation(self.samples)
        return np.arange(self.samples)

    def __getitem__(self, index):
        first = self._first_unit(index) + self.rank * self.batch_size
        take = self._order[first:first + self.batch_size]
        return keras.tree.map_structure(lambda a: np.asarray(a)[take], self.data)

    def skip_epochs(self, count: int) -> None:
        """Jump `count` epochs ahead (a resumed job): the order is seeded by the epoch number."""
        self.epoch += count
        self._order = self._epoch_order()


class ShardedPyDataset(_Shard):
    """Every ``size``-th batch of a PyDataset, starting at this rank's index.

    Batches are split whole, so a last partial batch reaches one rank only: the ranks then run
    the same number of steps with batches of different sizes, which the TensorFlow and torch
    engines accept, but JAX's step needs equal shapes on every rank (a clear MismatchError):
    on JAX give a PyDataset whose batches are all full.
    """

    def __init__(self, dataset: keras.utils.PyDataset):
        super().__init__()
        self.dataset = dataset
        self.rank, self.size = _placement()
        self.units, self.per_step, self.unit = len(dataset), self.size, "batch"
        self.batches = _agree(self.units // self.size, f"a PyDataset of {self.units} batches")
        if self.batches == 0:
            raise ValueError(f"mgpu.data.shard: a PyDataset of {self.units} batches cannot "
                             f"give each of {self.size} ranks a batch")

    def __getitem__(self, index):
        return self.dataset[self._first_unit(index) + self.rank]

    def skip_epochs(self, count: int) -> None:
        """Call the PyDataset's ``on_epoch_end`` `count` times (a resumed job replays them)."""
        for _ in range(count):
            self.dataset.on_epoch_end()


def _shard_tf_dataset(dataset, batch_size, shuffle, seed, drop_remainder):
    import tensorflow as tf

    rank, size = _placement()
    samples = int(dataset.cardinality())
    if samples < 0:
        raise ValueError(
            "mgpu.data.shard: the tf.data.Dataset's length is unknown (or infinite), so the "
            "ranks cannot be given equal parts. Shard an unbatched dataset of known length, "
            "or use dataset.repeat() with fit(steps_per_epoch=...) equal on every rank.")
    per_rank = samples // size
    if shuffle:
        dataset = dataset.shuffle(samples, seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.shard(size, rank).take(per_rank)
    if batch_size:
        dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
        batches = per_rank // batch_size if drop_remainder else -(-per_rank // batch_size)
    else:
        batches = per_rank
    _agree(batches, "this tf.data.Dataset")
    # remembered: the device feed may start its next epoch early, and the efficiency report
    # knows this prefetch is here (training/sharded.py)
    return sharded.remember(dataset.prefetch(tf.data.AUTOTUNE))


def shard(data: Any, batch_size: Optional[int] = None, shuffle: bool = False, seed: int = 0,
          drop_remainder: bool = True):
    """This rank's part of `data`, with the same number of batches on every rank.

    Args:
        data: numpy arrays (or a tuple / dict of them, sharing the first axis), an unbatched
            ``tf.data.Dataset`` of known length, or a ``keras.utils.PyDataset``.
        batch_size: samples per batch on this rank. Required for arrays; for a tf.data
            dataset, batches it (None: you batch it yourself, after sharding); ignored for a
            PyDataset (its batches are split between the ranks whole).
        shuffle: a new order every epoch, the same on every rank (seeded), before splitting,
            so the ranks' parts stay disjoint.
        seed: the shared seed; give every rank the same one.
        drop_remainder: tf.data only — a last partial batch (equal on every rank either way).

    Returns:
        A ``keras.utils.PyDataset`` for arrays and PyDatasets, a ``tf.data.Dataset`` for
        tf.data input; pass it to ``model.fit`` without ``batch_size``.

    Raises:
        ValueError: unusable input (unknown length, arrays of different lengths, too small).
        mgpu.MismatchError: the ranks would get different numbers of batches.

    Example:
        >>> train = mgpu.data.shard((x_train, y_train), batch_size=64, shuffle=True)
        >>> model.fit(train, epochs=5, validation_data=mgpu.data.shard((x_val, y_val), 64))

        keras-hub's ``Task.fit`` takes a ``tf.data.Dataset`` (or arrays), not a PyDataset:
        shard a tf.data of the arrays (any backend; keras-hub brings TensorFlow)

        >>> dataset = tf.data.Dataset.from_tensor_slices((features, labels))
        >>> causal_lm.fit(mgpu.data.shard(dataset, batch_size=8, shuffle=True), epochs=3)
    """
    patches.install()  # fit keeps the order of what shard returns (mgpu.init() installed it)
    if isinstance(data, keras.utils.PyDataset):
        return ShardedPyDataset(data)
    if type(data).__module__.startswith("tensorflow") and hasattr(data, "shard"):
        return _shard_tf_dataset(data, batch_size, shuffle, seed, drop_remainder)
    if batch_size is None or int(batch_size) < 1:
        raise ValueError(f"mgpu.data.shard: batch_size={batch_size!r}; arrays need the number "
                         f"of samples per batch on each rank (>= 1)")
    if not keras.tree.flatten(data) or not all(hasattr(a, "__len__")
                                               for a in keras.tree.flatten(data)):
        raise ValueError(f"mgpu.data.shard: expected numpy arrays (or a tuple/dict of them), a "
                         f"tf.data.Dataset or a keras.utils.PyDataset; got "
                         f"{type(data).__name__}")
    return ShardedArrays(data, int(batch_size), shuffle, seed)


__all__ = ["shard", "ShardedArrays", "ShardedPyDataset", "Prefetcher", "prefetch_depth"]
