"""Horovod's Keras collectives on values (``mgpu_launch.keras``'s ``allreduce``, ``allgather``,
``broadcast``, ``reducescatter``, ``broadcast_object``), on every backend.

Called eagerly they run on the host (MPI, ``mgpu_launch.runtime.collectives``) and return a
tensor of the Keras backend; inside a ``tf.function`` (TensorFlow backend) they are
TensorFlow's in-graph collectives (``mgpu_launch.horovod.tensorflow_ops``). Each takes
``process_set=`` (Horovod's Keras namespace has it on ``DistributedOptimizer`` only; here the
values follow ``horovod.tensorflow``'s): only the set's members call it.
"""

import keras
import numpy as np

from mgpu_launch import backends, runtime
from mgpu_launch.horovod import support, tensorflow_ops
from mgpu_launch.horovod.support import Average, global_process_set
from mgpu_launch.runtime import collectives
from mgpu_launch.backends.compression import Compression

_NAME = "mgpu_launch.keras"


def _check_op(op):
    return support.check_op(_NAME, op) if op is not None else op


def _host(value) -> np.ndarray:
    # Through a backend tensor first, so Python numbers get Keras's dtypes (float32, int32) as
    # they would under Horovod's tf.constant.
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(value)))


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none, process_set=global_process_set):
    """Average (or sum) `value` over all processes: on the host when called eagerly, as
    TensorFlow's in-graph collective inside a ``tf.function``.

    Args:
        value: a tensor, numpy array or number; the same shape and dtype on every rank.
        name: ignored (Horovod's op name).
        average: Horovod's deprecated flag: True is ``op=Average``, False is ``op=Sum``.
        prescale_factor: multiply `value` by this before the reduction.
        postscale_factor: multiply the result by this after it.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        compression: the wire dtype inside a ``tf.function``; host collectives (eager)
            always send full precision.
        process_set: ``hvd.global_process_set`` (default) or a registered ``hvd.ProcessSet``:
            only its members call this; an average divides by its size.

    Returns:
        The reduced value as a tensor of the Keras backend.

    Raises:
        ValueError: both `average` and `op` given, or ``op=hvd.Adasum``.
        mgpu.MismatchError: ranks passed different shapes or dtypes.
        mgpu.NotInProcessSetError: this rank is not in `process_set`.

    Example:
        >>> hvd.allreduce(float(val_loss))          # mean over the ranks
    """
    if _in_graph():
        return tensorflow_ops.allreduce(value, average=average, op=op, compression=compression,
                                        prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor,
                                        process_set=process_set)
    op = support.check_op(_NAME, op, average)
    Compression.get(compression)
    array = _host(value)
    if prescale_factor != 1.0:
        array = array * prescale_factor
    result = collectives.allreduce(array, op=op, process_set=process_set)
    if postscale_factor != 1.0:
        result = result * postscale_factor
    return keras.ops.convert_to_tensor(result)


def _in_graph() -> bool:
    """Inside a tf.function (TensorFlow backend): the values have no host copy."""
    return runtime.is_initialized() and backends.get_engine_or_default().tracing()


def allgather(value, name=None, process_set=global_process_set):
    """Every rank's (every member's of `process_set`) `value` concatenated along the first
    axis (ragged), as a backend tensor (in-graph inside a ``tf.function``).

    Example:
        >>> hvd.allgather(np.array([hvd.rank()]))   # [0, 1] on 2 processes
    """
    if _in_graph():
        return tensorflow_ops.allgather(value, process_set=process_set)
    return keras.ops.convert_to_tensor(collectives.allgather(_host(value),
                                                             process_set=process_set))


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """Rank `root_rank`'s `value` (same shape and dtype on every rank of `process_set`;
    `root_rank` is a global rank), as a backend tensor (in-graph inside a ``tf.function``).

    Example:
        >>> seed = hvd.broadcast(np.random.randint(1 << 30), root_rank=0)
    """
    if _in_graph():
        return tensorflow_ops.broadcast(value, root_rank, process_set=process_set)
    return keras.ops.convert_to_tensor(collectives.broadcast(_host(value), root_rank,
                                                             process_set=process_set))


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """`value` averaged (or summed) over the ranks (of `process_set`), and this rank's rows
    of the result: the first ``n % size`` ranks (positions in the set) get ``n // size + 1``
    rows, the others ``n // size`` (Horovod's split). An allreduce followed by a slice
    (in-graph inside a ``tf.function``).

    Example:
        >>> hvd.reducescatter(np.ones((4, 3)), op=hvd.Sum)   # 2 ranks: rows of 2.0, 2 each
    """
    if _in_graph():
        return tensorflow_ops.reducescatter(value, op=_check_op(op), process_set=process_set)
    reduced = collectives.allreduce(_host(value), op=support.check_op(_NAME, op),
                                    process_set=process_set)
    group = support.process_set_group(_NAME, process_set, "reducescatter")
    rows, ranks, me = reduced.shape[0], group.size, group.index(runtime.rank(), "reducescatter")
    start = me * (rows // ranks) + min(me, rows % ranks)
    return keras.ops.convert_to_tensor(
        reduced[start:start + rows // ranks + (1 if me < rows % ranks else 0)])


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Rank `root_rank`'s picklable Python object, on every rank (of `process_set`).

    Example:
        >>> start_epoch = hvd.broadcast_object(start_epoch, root_rank=0)
    """
    return collectives.broadcast_object(obj, root_rank, process_set=process_set)


__all__ = ["allreduce", "allgather", "broadcast", "reducescatter", "broadcast_object"]
