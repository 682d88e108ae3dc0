"""How the TensorFlow engine feeds Keras's train function from mgpu's prefetch thread.

Two things decide whether TensorFlow's call of the compiled step returns before the step runs
(measured on H100/H200, ResNet-50; ``benchmarks/tf_gpu/README.md``):

- **The source.** On a ``tf.data`` iterator Keras reads an ``OptionalHasValue`` after every
  call, which waits for the whole step on the device before the host may prepare the next
  (64 ms a step through that path, 43 ms for the same compiled step fed directly). mgpu
  iterates the ``tf.data`` batches in its prefetch thread and hands Keras a Python iterator of
  batches already on the device (:func:`dataset_source`).
- **Where each tensor lives.** TensorFlow keeps an ``int32`` tensor in host memory even when it
  is placed on a GPU, so the XLA step copies it to the device on every call itself, and that
  copy waits for the previous step (TensorFlow's own H2D path synchronizes with the compute
  stream). int32 labels and token ids are such tensors. The prefetch thread therefore
  makes each ``int32`` tensor of the batch an ``int64`` on the GPU (``MGPU_TF_WIDEN_INT32``,
  on by default): ResNet-50 bf16 on 2x H200, 2 GPUs 6869 / 6759 -> 7645 img/s (int32 kept,
  widened, alternated; ``benchmarks/tf_gpu/results_2026-11-26-h200x2-fourth``); on 1 GPU no
  effect was resolved from the run-to-run spread. Keras's losses, metrics and ``Embedding``
  accept the wider labels and indices, and a Functional model casts an input
  it declared ``int32`` back inside the compiled step (``tests/backends/
  test_tensorflow_feeding.py``). A subclassed model or a custom ``train_step`` sees ``int64``:
  code there that combines an input with an explicit ``int32`` tensor fails with TensorFlow's
  "expected to be a int64 tensor" and needs ``MGPU_TF_WIDEN_INT32=0``.
"""
from typing import Any, Callable, Optional

from mgpu_launch import keras_internals
from mgpu_launch.config import settings


def dataset_source(epoch_iterator) -> Optional[Any]:
    """The ``tf.data`` dataset the prefetch thread iterates for each epoch of ``fit``.

    Args:
        epoch_iterator: Keras's ``EpochIterator`` of this ``fit``.

    Returns:
        The adapter's ``tf.data.Dataset``; ``None`` (Keras keeps its own feeding) when the
        epoch's length is unknown (Keras's direct path cannot tell an exhausted iterator from
        one step) or a ``tf.distribute`` strategy is in scope.
    """
    import tensorflow as tf
    if epoch_iterator.num_batches is None or tf.distribute.has_strategy():
        return None
    # The dataset Keras's own feeding re-iterates every epoch, made when fit began: making one
    # costs 25-70 ms on CPU (a PyDataset's from_generator), which was on the path of every
    # epoch's first batch when mgpu made its own each epoch.
    dataset = keras_internals.tf_epoch_dataset(epoch_iterator)
    if not isinstance(dataset, tf.data.Dataset):  # a distributed dataset, or a test's iterator
        dataset = epoch_iterator.__dict__.get("_mgpu_tf_dataset")
        if dataset is None:
            dataset = epoch_iterator._mgpu_tf_dataset = (
                epoch_iterator.data_adapter.get_tf_dataset())
    return dataset


def device_transfer(device: Optional[str] = None,
                    widen_int32: Optional[bool] = None) -> Callable[[Any], Any]:
    """The function the prefetch thread applies to each batch: a copy on the device.

    Args:
        device: the TensorFlow device name; default: this process's first logical GPU, and
            with none the batch is returned as it is (nothing to copy to).
        widen_int32: make every ``int32`` tensor of the batch ``int64`` on the device (see the
            module docstring); default: the ``MGPU_TF_WIDEN_INT32`` setting.

    Returns:
        A function of one batch (any nest of tensors) returning the same nest on ``device``.

    Example:
        >>> import tensorflow as tf
        >>> copy = device_transfer("/CPU:0", widen_int32=True)
        >>> copy((tf.zeros([2, 3]), tf.constant([1, 2])))[1].dtype
        tf.int64
    """
    import tensorflow as tf
    if device is None:
        gpus = tf.config.list_logical_devices("GPU")
        if not gpus:
            return lambda batch: batch
        device = gpus[0].name
    if widen_int32 is None:
        widen_int32 = settings.flag("MGPU_TF_WIDEN_INT32")

    def place(tensor):
        if widen_int32 and getattr(tensor, "dtype", None) == tf.int32:
            return tf.cast(tensor, tf.int64)
        return tf.identity(tensor)

    def to_device(batch):
        with tf.device(device):
            return tf.nest.map_structure(place, batch)
    return to_device
