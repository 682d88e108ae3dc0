"""The ``tf.data`` datasets ``mgpu.data.shard`` made, and what that lets the rest of mgpu do.

A dataset shard made is one mgpu knows the whole of: shuffled by tf.data's own seeded shuffle
(its order for each epoch decided inside tf.data, not by anything that runs between epochs),
split, batched and ``.prefetch(tf.data.AUTOTUNE)``-ed. Two things follow:

- on JAX the device feed may begin its next epoch while this one ends (``patches/fit.py``,
  which says why not on TensorFlow): starting a tf.data iterator and filling its shuffle
  buffer costs milliseconds to tens of ms an epoch, which a short epoch otherwise waits for
  at its first step;
- the efficiency report's input advice does not tell its user to add a ``.prefetch`` they
  cannot see (:func:`input_kind`).

A weak set: remembering a dataset keeps nothing alive. Leaf module (no mgpu imports), so the
data module, the fit patch and the report can all use it without an import circle.
"""

import weakref
from typing import Any, Optional

_TF_DATASETS: "weakref.WeakSet" = weakref.WeakSet()


def remember(dataset) -> Any:
    """Note `dataset` as one ``mgpu.data.shard`` returned; returns it."""
    _TF_DATASETS.add(dataset)
    return dataset


def is_sharded_tf_dataset(dataset) -> bool:
    """Whether `dataset` is a ``tf.data`` dataset that ``mgpu.data.shard`` returned."""
    try:
        return dataset is not None and dataset in _TF_DATASETS
    except TypeError:  # not weakly referable or not hashable: not one of ours
        return False


def input_kind(data) -> Optional[str]:
    """What ``fit`` was given, as the efficiency report's advice needs it: ``"shard tf.data"``
    (a ``tf.data`` that ``mgpu.data.shard`` made), ``"tf.data"`` (any other), ``"PyDataset"``,
    ``"arrays"``, or None (not known)."""
    if is_sharded_tf_dataset(data):
        return "shard tf.data"
    if type(data).__module__.startswith("tensorflow") and hasattr(data, "element_spec"):
        return "tf.data"
    if any(cls.__name__ == "PyDataset" for cls in type(data).__mro__):
        return "PyDataset"
    if hasattr(data, "shape") or isinstance(data, (tuple, list, dict)):
        return "arrays"
    return None
