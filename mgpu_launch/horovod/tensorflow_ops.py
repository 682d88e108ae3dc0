"""Horovod's collectives on TensorFlow tensors, in-graph (inside a ``tf.function``) and eagerly.

The value functions of ``mgpu_launch.tensorflow`` (Horovod's ``horovod.tensorflow`` names and
arguments), also used by ``mgpu_launch.keras`` inside a ``tf.function``. They call the
TensorFlow engine's collectives (``mgpu_launch.backends.tensorflow.engine``): sums and averages fused
per dtype (``CollectiveReduceV2``), min / max / product, a ragged allgather, a broadcast.
On one process each returns its input (scaled where asked).

``process_set=``: a registered ``hvd.ProcessSet`` runs the collective among its members, as
a TensorFlow collective group of their own (``mgpu_launch.backends.tensorflow.collectives``);
``root_rank`` stays a global rank, averages divide by the set's size, and reducescatter /
alltoall split by the members' positions in the set. A rank outside the set gets
``NotInProcessSetError`` (a ValueError) when it calls (or traces) the op.
"""

from typing import List

import keras
import numpy as np
from keras import ops

from mgpu_launch import backends, runtime
from mgpu_launch.backends.reduction import GradientReduction
from mgpu_launch.horovod import support
from mgpu_launch.horovod.support import global_process_set, process_set_group
from mgpu_launch.runtime.collectives import Average, Max, Min, Product
from mgpu_launch.backends.compression import Compression

_NAME = "mgpu_launch.tensorflow"
_MERGE = {Min: "min", Max: "max", Product: "product"}


def _engine():
    runtime.state.require()
    return backends.graph_collectives(_NAME)


def _integer(tensor) -> bool:
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    return "int" in dtype or dtype == "bool"


def _scaled(tensor, factor: float):
    if factor == 1.0:
        return tensor
    return ops.multiply(tensor, ops.cast(factor, tensor.dtype))


def _check_root(root_rank: int, group, what: str) -> int:
    """`root_rank` (global) as an int, checked against the job and the process set."""
    if not 0 <= int(root_rank) < runtime.size():
        raise ValueError(f"root_rank={root_rank} is not a rank of this job: expected "
                         f"0 <= root_rank < size() = {runtime.size()}")
    group.root_index(int(root_rank), what)
    return int(root_rank)


def _group(process_set, what: str):
    return process_set_group(_NAME, process_set, what, engine_needed=True)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None) -> List:
    """Reduce a list of tensors over the ranks, fused: one collective per dtype.

    Args:
        tensors: tf tensors, variables, numpy arrays or ``tf.IndexedSlices`` (those are
            gathered, Horovod's sparse allreduce); shapes and dtypes equal on every rank.
        average: Horovod's deprecated flag (True: ``op=Average``, False: ``op=Sum``).
        device_dense, device_sparse, name, ignore_name_scope: ignored (one device per process;
            TensorFlow names the ops).
        compression: ``Compression.none`` / ``.fp16`` / ``.bf16``: the dtype on the wire.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``. An integer tensor
            averaged is floor-divided (it keeps its dtype).
        prescale_factor, postscale_factor: multiply before / after the reduction.
        process_set: ``hvd.global_process_set`` (default) or a registered ``hvd.ProcessSet``:
            only its members call this; an average divides by its size.

    Returns:
        The reduced tensors, in order, same shapes and dtypes (IndexedSlices stay sparse).

    Raises:
        ValueError: Adasum, a process set not registered, or Min / Max / Product of
            IndexedSlices.
        NotInProcessSetError: this rank is not in `process_set`.
    """
    op = support.check_op(_NAME, op, average)
    group = _group(process_set, "allreduce")
    codec = Compression.get(compression)
    engine = _engine()
    tensors = [t if engine.is_sparse(t) else ops.convert_to_tensor(t) for t in tensors]
    if op in _MERGE and any(engine.is_sparse(t) for t in tensors):
        raise ValueError(f"op={op} of tf.IndexedSlices is not supported (Horovod neither): "
                         f"use op=hvd.Sum or hvd.Average, or convert with tf.convert_to_tensor")
    if group.size == 1:
        factor = prescale_factor * postscale_factor
        return [t if engine.is_sparse(t) or factor == 1.0 or op in _MERGE else _scaled(t, factor)
                for t in tensors]
    if op in _MERGE:
        return [_scaled(engine.reduce(_scaled(t, prescale_factor), _MERGE[op], group),
                        postscale_factor) for t in tensors]
    floor = [i for i, t in enumerate(tensors)
             if op is Average and not engine.is_sparse(t) and _integer(t)]
    rest = [i for i in range(len(tensors)) if i not in floor]
    result = [None] * len(tensors)
    options = dict(prescale=prescale_factor, postscale=postscale_factor, compression=codec)
    reduced = engine.reduce_gradients([tensors[i] for i in rest], [None] * len(rest),
                                      GradientReduction(average=op is Average, **options),
                                      group=group)
    for i, value in zip(rest, reduced):
        result[i] = value
    if floor:
        sums = engine.allreduce([tensors[i] for i in floor], average=False, group=group,
                                **options)
        for i, value in zip(floor, sums):
            result[i] = ops.floor_divide(value, ops.cast(group.size, value.dtype))
    return result


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """`tensor` reduced over the ranks (see :func:`grouped_allreduce` for the arguments).

    Example:
        >>> mean_loss = hvd.allreduce(loss)                    # inside a tf.function too
    """
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, process_set)[0]


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's `tensor` concatenated along axis 0, in rank order; the first dimension may
    differ between ranks, the others and the dtype may not. Not under XLA.

    Example:
        >>> hvd.allgather(tf.fill([hvd.rank() + 1], hvd.rank()))   # 2 ranks: [0, 1, 1]
    """
    group = _group(process_set, "allgather")
    return _engine().allgather([tensor], group)[0]


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set) -> List:
    """:func:`allgather` of each tensor (their first dimensions may differ)."""
    return [allgather(t, process_set=process_set) for t in tensors]


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Rank `root_rank`'s `tensor` (same shape and dtype everywhere), on every rank (of
    `process_set`; `root_rank` is a global rank, one of its members).

    Example:
        >>> seed = hvd.broadcast(tf.random.uniform([], maxval=2**30, dtype=tf.int32), 0)
    """
    group = _group(process_set, "broadcast")
    return _engine().broadcast(tensor, _check_root(root_rank, group, "broadcast"), group)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assign rank `root_rank`'s values to `variables` in place: one broadcast per dtype.

    Returns:
        `variables`.
    """
    group = _group(process_set, "broadcast_")
    root_rank = _check_root(root_rank, group, "broadcast_")
    engine = _engine()
    variables = list(variables)
    if group.size == 1:
        return variables
    groups = {}
    for variable in variables:
        groups.setdefault(keras.backend.standardize_dtype(variable.dtype), []).append(variable)
    for dtype in sorted(groups):  # the same collectives in the same order on every rank
        members = groups[dtype]
        flat = ops.concatenate([ops.reshape(ops.convert_to_tensor(v), [-1]) for v in members], 0)
        received = engine.broadcast(flat, root_rank, group)
        start = 0
        for variable in members:
            count = int(np.prod(variable.shape))
            variable.assign(ops.reshape(received[start:start + count], variable.shape))
            start += count
    return variables


def _my_rows(tensor, group):
    """This rank's slice of the first dimension: the first ``rows % size`` ranks (positions
    in the process set `group`) get one row more (Horovod's split)."""
    rows = ops.shape(tensor)[0]
    size, rank = group.size, group.index(runtime.rank(), "reducescatter")
    base, extra = rows // size, rows % size
    if isinstance(rows, int):  # a static shape: plain numbers
        start, count = rank * base + min(rank, extra), base + (1 if rank < extra else 0)
    else:
        start = rank * base + ops.minimum(rank, extra)
        count = base + ops.cast(ops.less(rank, extra), base.dtype)
    return tensor[start:start + count]


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, ignore_name_scope=False,
                          prescale_factor=1.0, postscale_factor=1.0, name=None) -> List:
    """Reduce each tensor over the ranks and keep this rank's rows of it.

    Done as an allreduce followed by a slice (each rank receives the whole reduction): the
    values are Horovod's; the traffic is an allreduce's. Rank r gets rows
    ``[r * (n // size) + min(r, n % size), ...)``: the first ``n % size`` ranks one row more.
    """
    reduced = grouped_allreduce(tensors, None, "", "", compression, op, prescale_factor,
                                postscale_factor, process_set)
    group = _group(process_set, "reducescatter")
    return [_my_rows(t, group) for t in reduced]


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """`tensor` reduced over the ranks, this rank's rows of it (:func:`grouped_reducescatter`).

    Example:
        >>> hvd.reducescatter(tf.ones([4, 3]), op=hvd.Sum)   # 2 ranks: a [2, 3] tensor of 2s
    """
    return grouped_reducescatter([tensor], device_dense, compression, op, process_set,
                                 ignore_name_scope, prescale_factor, postscale_factor)[0]


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Send ``splits[r]`` consecutive rows of `tensor` to rank r; receive every rank's rows
    for this one, in rank order (within `process_set`: r is a position in the set).

    Done with two allgathers (of the splits and of the tensors), each rank keeping its part:
    Horovod's values, more traffic than a true alltoall. Not under XLA.

    Args:
        tensor: rows to scatter; its first dimension may differ between ranks.
        splits: how many rows go to each rank (length ``size()``); None: equal parts (the
            first dimension must divide by ``size()``).

    Returns:
        The received rows; with `splits` given, also how many came from each rank.
    """
    group = _group(process_set, "alltoall")
    engine = _engine()
    tensor = ops.convert_to_tensor(tensor)
    size, rank = group.size, group.index(runtime.rank(), "alltoall")
    given = splits
    if splits is None:
        rows = tensor.shape[0]
        if rows is not None and rows % size:
            raise ValueError(f"alltoall: {rows} rows do not divide into {size} equal parts; "
                             f"pass splits=[rows for each rank]")
        splits = ops.repeat(ops.reshape(ops.shape(tensor)[0] // size, [1]), size)
    splits = ops.cast(ops.convert_to_tensor(splits), "int32")
    everyone = ops.reshape(engine.allgather([ops.reshape(splits, [1, size])], group)[0],
                           [size, size])
    data = engine.allgather([tensor], group)[0]
    sent = ops.sum(everyone, axis=1)
    sender_start = ops.cumsum(sent) - sent
    before_me = ops.sum(everyone[:, :rank], axis=1)
    pieces = [data[sender_start[s] + before_me[s]:sender_start[s] + before_me[s]
                   + everyone[s, rank]] for s in range(size)]
    received = ops.concatenate(pieces, axis=0)
    return received if given is None else (received, everyone[:, rank])
