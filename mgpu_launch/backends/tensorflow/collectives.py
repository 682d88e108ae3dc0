"""TensorFlow collectives beyond the gradient sum: allgather, broadcast, min / max / product,
and the allgather of sparse gradients (``tf.IndexedSlices``).

Used through :class:`mgpu_launch.backends.tensorflow.engine.TensorFlowEngine`; every function takes the
engine (set up: group, ordering token, instance keys) as its first argument, works eagerly and
inside a ``tf.function``, and issues its collectives in program order on every rank (the
engine's ordering token), so ranks must call them in the same order, as every collective.

Allgather with a first dimension that differs per rank: the ranks first gather their row
counts (a static ``[1]`` buffer), pad their rows to a shared padded count, gather
(``CollectiveGatherV2``), and drop the padding. TensorFlow ties an instance key to one buffer
shape for good (reusing a key with another shape fails with "Shape mismatch in the collective
instance"), and keeps every key it has seen; so the padded count is rounded up to one of a
few buckets (at most 12.5% more rows: 8 buckets per power of two) and each bucket has its own
fixed key, in a range of its own. A long run with varying sizes then uses a bounded set of
keys (the engine module's docstring says why that matters).

Under XLA (``jit_compile=True``, and Keras's default ``"auto"`` on GPUs) that allgather cannot
compile: its output shape depends on the values exchanged. Broadcast, sum and product compile
where the engine's allreduce does; min and max do not (XLA's lowering of ``CollectiveReduceV2``,
tf2xla's ``all_reduce_op.cc``, takes only Add and Mul merges), so :func:`reduce` refuses them
there with the fix. Sparse gradients therefore take another path under XLA
(:func:`gather_static`, ``MGPU_TF_SPARSE_GATHER``): each rank pads its slices to a bucket of its
own row count (a compile-time constant under XLA) with zero-valued rows at index 0, places them
at its rank's offset in a zero buffer of ``size`` such blocks, and one ``CollectiveReduceV2``
sum of that buffer is the gather (x + 0 = x: exact). The zero rows add nothing to any
optimizer's update. Ranks must then feed batches of the same size at each step, as
``mgpu.data.shard`` does: ranks whose row counts fall in different buckets wait on different
collectives, which the stall inspector reports.

Process sets: every function takes ``group``, a registered process set
(``mgpu_launch.runtime.process_sets.Group``; None: every rank). Its members form a TensorFlow
collective group of their own (:func:`members`: group key ``1 + id``, the set's size), so two
sets run their collectives at the same time; its instance keys are derived as the global
ones, from signatures tagged with the set's id, and TensorFlow keeps them per group key.

Dtypes: the gather takes float16/32/64 and int32/64 as they are; bfloat16 travels as its
16 bits (bitcast), bool and 8/16-bit integers as int32. The broadcast is a sum of the root's
value and zeros from everyone else (one CollectiveReduceV2, the cost of an allreduce,
whatever the number of ranks): values arrive exactly, except that a root's -0.0 arrives as 0.0.
"""

import functools
from typing import Any, List, NamedTuple, Sequence

import numpy as np

from mgpu_launch import runtime

#: dtypes CollectiveGatherV2 takes as they are (TensorFlow 2.21, CPU)
_GATHERABLE = ("float32", "float16", "float64", "int32", "int64")
_REDUCIBLE = _GATHERABLE + ("bfloat16",)
_MERGE_OPS = {"sum": "Add", "min": "Min", "max": "Max", "product": "Mul"}


def _tf():
    import tensorflow as tf
    return tf


class Members(NamedTuple):
    """Who takes part in a collective: every rank, or one process set's members.

    Attributes:
        size: the collective group's size.
        key: its TensorFlow group key (1: every rank; ``1 + id`` for process set ``id``).
        control_plane: its group of the runtime's transport (``MGPU_TF_TRANSPORT=mpi``).
        rank: this process's position in the group.
        tag: prefix of its instance keys' signatures ("" for every rank).
        process_set_id: 0 for every rank.
    """

    size: int
    key: int
    control_plane: Any
    rank: int
    tag: str
    process_set_id: int


def members(engine, group=None, what: str = "collective") -> Members:
    """The TensorFlow group of `group` (a runtime process-set Group; None or id 0: every rank).

    Raises:
        mgpu_launch.runtime.process_sets.NotInProcessSetError: this rank is not in `group`.
    """
    rank = runtime.state.rank
    if group is None or group.process_set_id == 0:
        return Members(engine.size, 1, engine.control_plane, rank, "", 0)
    return Members(group.size, 1 + group.process_set_id, group.transport,
                   group.index(rank, what),
                   f"set{group.process_set_id}:", group.process_set_id)


def _to_wire(tensor, allowed):
    """(tensor in a dtype the collective takes, function bringing a result back)."""
    tf = _tf()
    dtype = tensor.dtype
    if dtype.name in allowed:
        return tensor, lambda result: result
    if dtype == tf.bfloat16:  # a copy keeps the bits: travel as float16's 16 bits
        return (tf.bitcast(tensor, tf.float16),
                lambda result: tf.bitcast(result, tf.bfloat16))
    if dtype in (tf.bool, tf.int8, tf.int16, tf.uint8, tf.uint16):
        return tf.cast(tensor, tf.int32), lambda result: tf.cast(result, dtype)
    if dtype in (tf.uint32, tf.uint64):
        wide = tf.int64
        return tf.cast(tensor, wide), lambda result: tf.cast(result, dtype)
    raise TypeError(f"mgpu: no TensorFlow collective for dtype {dtype.name}: expected a float, "
                    f"integer or bool tensor. Cast it (e.g. tf.cast(x, tf.float32)) first.")


def _check_dynamic_ok(what: str) -> None:
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise ValueError(
            f"mgpu: {what} cannot be compiled with XLA (its result's shape depends on the "
            f"other ranks' sizes). Call it from a tf.function without jit_compile=True, or "
            f"use allreduce / broadcast, whose shapes are static.")


def _bucket(rows):
    """(padded row count >= rows, bucket number < keys.BLOCK) for an int64 scalar `rows`."""
    tf = _tf()
    powers = tf.constant([1 << k for k in range(63)], tf.int64)
    bit_length = tf.reduce_sum(tf.cast(rows >= powers, tf.int64))
    shift = tf.maximum(bit_length - 4, 0)  # below 16 rows: exact; above: 8..16 units of 2**shift
    unit = tf.bitwise.left_shift(tf.constant(1, tf.int64), shift)
    units = (rows + unit - 1) // unit
    return units * unit, shift * 17 + units


def _gather_equal(engine, tensor, key, group: Members):
    tf = _tf()
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=group.size, group_key=group.key, instance_key=key,
        ordering_token=[engine.keys.ordering_token.handle],
        communication_hint=engine.implementation, timeout_seconds=engine.timeout)


def allgather_rows(engine, tensors: Sequence[Any], group=None) -> List[Any]:
    """Every rank's (every member's of `group`) `tensors` concatenated along axis 0, in rank
    order.

    All `tensors` have the same number of rows on one rank (it may differ between ranks); their
    other dimensions and dtypes must agree across ranks. One gather of the row counts serves
    them all. Scalars count as one row.
    """
    tf = _tf()
    group = members(engine, group, "allgather")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    tensors = [tf.reshape(t, [1]) if t.shape.rank == 0 else t for t in tensors]
    if group.size == 1:
        return [tf.identity(t) for t in tensors]
    if engine.transport == "mpi":
        return [_mpi_allgather(group.control_plane, t) for t in tensors]
    _check_dynamic_ok("allgather")
    rows = tf.shape(tensors[0], out_type=tf.int64)[:1]
    counts = _gather_equal(engine, rows, engine.keys.for_collective(rows, "rows", group), group)
    padded, bucket = _bucket(tf.reduce_max(counts))
    results = []
    for tensor in tensors:
        wire, back = _to_wire(tensor, _GATHERABLE)
        rest = wire.shape[1:]
        signature = f"{group.tag}gather:{wire.dtype.name}:{rest.as_list()}"
        base = engine.keys.bucket_base(f"{signature}:{engine.keys.position(signature)}")
        key = tf.cast(base + bucket, tf.int32)
        pad = tf.concat([[padded - rows[0]], tf.zeros([rest.rank], tf.int64)], axis=0)
        wire = tf.pad(wire, tf.stack([tf.zeros_like(pad), pad], axis=1))
        gathered = _gather_equal(engine, wire, key, group)
        gathered = tf.reshape(gathered, tf.concat(
            [[group.size, padded], tf.shape(wire, out_type=tf.int64)[1:]], axis=0))
        kept = tf.boolean_mask(gathered, tf.sequence_mask(counts, padded))
        results.append(back(tf.ensure_shape(kept, [None] + rest.as_list())))
    return results


def _elementwise(engine, tensor, group: Members, on_host, in_graph):
    """The path broadcast and reduce share: identity on one rank, `on_host(tensor)` on the MPI
    transport, else `in_graph` on the tensor in a dtype the collectives take, cast back."""
    tf = _tf()
    tensor = tf.convert_to_tensor(tensor)
    if group.size == 1:
        return tf.identity(tensor)
    if engine.transport == "mpi":
        return on_host(tensor)
    engine.check_not_xla()
    wire, back = _to_wire(tensor, _REDUCIBLE)  # value-preserving casts: the op is unchanged
    return back(in_graph(wire))


def broadcast(engine, tensor, root_rank: int, group=None):
    """Rank `root_rank`'s `tensor` on every rank (of `group`; `root_rank` is a global rank,
    one of its members); the same shape and dtype everywhere."""
    root = root_rank if group is None else group.root_index(root_rank, "broadcast")
    group = members(engine, group, "broadcast")

    def in_graph(wire):
        mine = wire if runtime.state.rank == root_rank else _tf().zeros_like(wire)
        return engine.collective_reduce(mine, kind="bcast", members=group)
    return _elementwise(engine, tensor, group, lambda t: _mpi_broadcast(group.control_plane, t, root),
                        in_graph)


def reduce(engine, tensor, op: str, group=None):
    """`tensor` combined over the ranks (of `group`) elementwise by `op`: "sum", "min", "max"
    or "product".

    Raises:
        ValueError: "min" or "max" inside an XLA-compiled function (XLA's all-reduce of
            TensorFlow's collective takes only sum and product).
    """
    if op in ("min", "max") and _in_xla():
        raise ValueError(f"mgpu: a {op} allreduce cannot be compiled with XLA (TensorFlow lowers "
                         f"its collective reduce only for sum and product). Call it from a "
                         f"tf.function without jit_compile=True, or outside the compiled step.")
    group = members(engine, group, op)
    return _elementwise(engine, tensor, group, lambda t: mpi_reduce(group.control_plane, t, op),
                        lambda wire: engine.collective_reduce(wire, kind=op,
                                                              merge_op=_MERGE_OPS[op],
                                                              members=group))


def _in_xla() -> bool:
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util
    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


def _static_gather_wanted(engine) -> bool:
    """MGPU_TF_SPARSE_GATHER: static under XLA by default, where the dynamic gather cannot
    compile; always with ``static`` (how CPU tests run the XLA path), never with ``dynamic``."""
    choice = engine.sparse_gather
    if engine.transport == "mpi" or choice == "dynamic":
        return False
    return choice == "static" or _in_xla()


def gather_static(engine, tensors: Sequence[Any], group=None) -> List[Any]:
    """Every rank's (every member's of `group`) `tensors` side by side along axis 0, through
    fixed-size buffers only, so that XLA can compile it (the module docstring says how).

    All `tensors` have the same number of rows on this rank. Each result has ``size x padded``
    rows, rank r's at ``[r x padded, r x padded + rows)``, zeros after them (``padded``: the
    row count rounded up to its bucket, the same on every rank whose count is in that bucket).

    Returns:
        The gathered tensors, padding rows zero.
    """
    tf = _tf()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    rows = tf.shape(tensors[0], out_type=tf.int64)[0]
    padded, bucket = _bucket(rows)
    group = members(engine, group, "allgather")
    rank, size = group.rank, group.size
    xla = _in_xla()
    results = []
    for tensor in tensors:
        if tensor.dtype.is_integer and not xla:
            # TensorFlow's NCCL sum outside XLA takes no integers ("Collective all-reduce does
            # not support datatype DT_INT32 on DEVICE_GPU"; XLA's does): float64 holds every
            # index exactly (below 2**53), and x + 0.0 = x
            wire, back = tf.cast(tensor, tf.float64), functools.partial(tf.cast, dtype=tensor.dtype)
        else:
            wire, back = _to_wire(tensor, _REDUCIBLE)
        rest = wire.shape[1:]
        signature = f"{group.tag}static-gather:{wire.dtype.name}:{rest.as_list()}"
        base = engine.keys.bucket_base(f"{signature}:{engine.keys.position(signature)}")
        # this rank's block, padded with zero rows, at its offset among size blocks of zeros
        before = tf.cast(rank, tf.int64) * padded
        after = tf.cast(size - 1 - rank, tf.int64) * padded + (padded - rows)
        spans = tf.concat([[[before, after]], tf.zeros([rest.rank, 2], tf.int64)], axis=0)
        placed = tf.pad(wire, spans)
        summed = tf.raw_ops.CollectiveReduceV2(
            input=placed, group_size=size, group_key=group.key,
            instance_key=tf.cast(base + bucket, tf.int32),
            ordering_token=[engine.keys.ordering_token.handle], merge_op="Add", final_op="Id",
            communication_hint=engine.implementation, timeout_seconds=engine.timeout)
        results.append(back(tf.ensure_shape(summed, [None] + rest.as_list())))
    return results


def reduce_sparse(engine, gradient, *, scale: float, compression=None, group=None):
    """An ``IndexedSlices`` gradient summed over the ranks (of `group`) the way one process
    would hold it: every rank's slices side by side (values and indices gathered, values times
    `scale`).

    The inner optimizer then sees what a single process with the ranks' batches together
    would: Adam squares each slice before summing duplicates, so summing first (densifying)
    gives another result. Under XLA (or ``MGPU_TF_SPARSE_GATHER=static``) the slices travel in
    fixed-size buffers (:func:`gather_static`), with zero-valued padding slices at index 0.
    """
    tf = _tf()
    values = gradient.values
    wire = compression.compress(values) if compression else values
    if members(engine, group).size > 1 and _static_gather_wanted(engine):
        # zero-valued padding rows at index 0: nothing added to any row's update
        gathered, indices = gather_static(engine, [wire, gradient.indices], group)
    else:
        gathered, indices = allgather_rows(engine, [wire, gradient.indices], group)
    if compression:
        gathered = compression.decompress(gathered, values.dtype)
    if scale != 1.0:
        gathered = gathered * tf.cast(scale, gathered.dtype)
    return tf.IndexedSlices(gathered, indices, dense_shape=gradient.dense_shape)


# -- MGPU_TF_TRANSPORT=mpi: the buffers leave the graph for MPI (CPU, no XLA) ------------------
def _host_call(function, tensor, dtype, shape):
    tf = _tf()
    result = tf.numpy_function(function, [tensor], dtype, stateful=True)
    result.set_shape(shape)
    return result


def _mpi_allgather(transport, tensor):

    def gather(array):
        array = np.ascontiguousarray(array)
        return transport.allgather_array(array, transport.allgather_object(array.shape[0]))

    return _host_call(gather, tensor, tensor.dtype, [None] + tensor.shape[1:].as_list())


def _mpi_broadcast(transport, tensor, root_rank):

    def bcast(array):
        return transport.broadcast_array(np.ascontiguousarray(array), root_rank)

    return _host_call(bcast, tensor, tensor.dtype, tensor.shape)


def mpi_reduce(transport, tensor, op):
    """`tensor` reduced over `transport` (the runtime's MPI transport or a process set's
    group of it; op: sum, min, max, product), out of the graph; 16-bit floats travel as
    float32."""

    def host_reduce(array):
        wire = array if array.dtype.itemsize >= 4 else array.astype(np.float32)
        out = transport.allreduce_array(np.ascontiguousarray(wire), op)
        return out.astype(array.dtype, copy=False)

    return _host_call(host_reduce, tensor, tensor.dtype, tensor.shape)
