"""Horovod's ``horovod.tensorflow`` names, for TensorFlow custom training loops.

    import mgpu_launch.tensorflow as hvd        # was: import horovod.tensorflow as hvd

    hvd.init()
    @tf.function
    def train_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)
        return loss

The collectives are TensorFlow's own in-graph collective ops, issued through the TensorFlow
engine (``mgpu_launch.backends.tensorflow.engine``): they run inside a ``tf.function`` and eagerly,
in program order (every rank must call them in the same order, as with Horovod). Under XLA
(``jit_compile=True``) they compile where the engine's allreduce does (GPU with NCCL, not on
CPU); ``allgather``, ``alltoall`` and sparse gradients never compile (their shapes depend on
other ranks). TensorFlow backend only: ``KERAS_BACKEND`` must be ``tensorflow`` (or unset).

Differences from Horovod (all in docs/horovod-migration.md): ``DistributedGradientTape``
wraps the tape instead of generating a subclass; ``reducescatter`` and ``alltoall`` are an
allreduce / allgather followed by a slice (correct, more traffic); process sets are
registered by lists of ranks (not MPI communicators); Adasum and TF1 session hooks are not
provided. ``hvd.elastic`` (``TensorFlowKerasState``, ``TensorFlowState``, ``ObjectState``,
``run``) is restart-based: a commit is also written to disk
(``mgpu_launch.horovod.tensorflow_elastic``); ``start_timeline``
records mgpu's timeline of step phases and host collectives, not Horovod's per-tensor one.
"""

import sys

from mgpu_launch import runtime
from mgpu_launch.horovod import support, tensorflow_elastic as elastic
from mgpu_launch.horovod.support import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,
                                         add_process_set, ccl_built, cuda_built, ddl_built,
                                         global_process_set, gloo_built, gloo_enabled, mpi_built,
                                         mpi_enabled, mpi_threads_supported, nccl_built,
                                         remove_process_set, rocm_built)
from mgpu_launch.horovod.tensorflow_ops import (allgather, allreduce, alltoall, broadcast,
                                                broadcast_, grouped_allgather, grouped_allreduce,
                                                grouped_reducescatter, reducescatter)
from mgpu_launch.runtime import (collectives, cross_rank, cross_size, is_initialized, local_rank,
                                 local_size, process_sets, rank, shutdown, size)
from mgpu_launch.backends.compression import Compression
from mgpu_launch.training.layers import SyncBatchNormalization

_NAME = "mgpu_launch.tensorflow"
# `hvd.elastic.run` and `import mgpu_launch.tensorflow.elastic`, as with Horovod.
sys.modules[f"{_NAME}.elastic"] = elastic
__getattr__ = support.namespace_getattr(_NAME, {
    "broadcast_global_variables": "TensorFlow 2 has no global variables (Horovod raises too "
                                  "when eager); use hvd.broadcast_variables(model.variables, 0)",
    "BroadcastGlobalVariablesHook": "TF1 session hooks do not exist in TensorFlow 2; call "
                                    "hvd.broadcast_variables after the first step",
    "broadcast_object_fn": "it builds TF1 placeholders; use hvd.broadcast_object",
    "join": "every rank must run the same number of steps: mgpu.data.shard gives each rank "
            "the same number of batches",
    "LocalGradientAggregationHelper": "a Horovod internal; use DistributedGradientTape and "
                                      "accumulate gradients in your loop",
    "handle_average_backwards_compatibility": "a Horovod internal; pass op=hvd.Average or "
                                              "op=hvd.Sum (average= is still accepted)",
    "check_num_rank_power_of_2": "a Horovod internal for Adasum, which is not implemented",
})
start_timeline, stop_timeline = support.timeline_functions(_NAME)
_homogeneous = None


def init(comm=None, process_sets=None) -> None:
    """Join the job and set up TensorFlow's in-graph collectives (``mgpu.init()``).

    Call it first, before TensorFlow creates any tensor. Also lets Keras 3 optimizers answer
    Keras 2's ``opt.variables()`` (a property in Keras 3), as Horovod's TF2 scripts call it.

    Args:
        comm: must be None (the job is every process the launcher started).
        process_sets: None, a list of ``hvd.ProcessSet`` to register (the same on every
            rank), or ``"dynamic"`` (also ``HOROVOD_DYNAMIC_PROCESS_SETS=1``): sets added
            later with ``hvd.add_process_set``.

    Raises:
        ValueError: `comm` given, bad `process_sets`, or the Keras backend is not TensorFlow.
        mgpu.MismatchError: the ranks passed different `process_sets`.

    Example:
        >>> import mgpu_launch.tensorflow as hvd
        >>> even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
        >>> hvd.init(process_sets=[even, odd])
    """
    global _homogeneous
    import keras
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"mgpu_launch.tensorflow needs the TensorFlow backend, but "
                         f"KERAS_BACKEND is {keras.backend.backend()!r}. Unset it or set "
                         f"KERAS_BACKEND=tensorflow (mgpu_launch.keras works on every backend).")
    support.init_runtime(_NAME, comm, process_sets, keras_2=("optimizer_variables",))
    everyone = collectives.allgather_object(runtime.local_size())
    _homogeneous = len(set(everyone)) == 1


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes (known after ``init()``)."""
    runtime.state.require()
    return bool(_homogeneous)


def _constant(value):
    import keras
    return keras.ops.convert_to_tensor(value, dtype="int32")


def rank_op(name=None):
    """``rank()`` as an int32 tensor (a constant: the rank does not change in a job)."""
    return _constant(rank())


def local_rank_op(name=None):
    """``local_rank()`` as an int32 tensor."""
    return _constant(local_rank())


def _registered(process_set_id: int):
    for group in process_sets.registered():
        if group.process_set_id == process_set_id:
            return group
    raise ValueError(f"process_set_id={process_set_id} is not a registered process set: pass "
                     f"a ProcessSet's process_set_id (0: every rank)")


def size_op(process_set_id=0, name=None):
    """The size of process set `process_set_id` (0, default: ``size()``) as an int32 tensor."""
    runtime.state.require()
    return _constant(_registered(int(process_set_id)).size)


def local_size_op(name=None):
    """``local_size()`` as an int32 tensor."""
    return _constant(local_size())


def process_set_included_op(process_set_id=0, name=None):
    """1 if this process is in process set `process_set_id` (0: every rank), else 0, as an
    int32 tensor (a constant: sets change only through add / remove_process_set)."""
    runtime.state.require()
    return _constant(int(rank() in _registered(int(process_set_id)).ranks))


def barrier(process_set=global_process_set):
    """Wait until every rank (of `process_set`) has reached this call (on the host: not inside
    a tf.function)."""
    collectives.barrier(process_set=process_set)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Rank `root_rank`'s picklable object, on every rank of `process_set` (on the host;
    `root_rank` is a global rank)."""
    return collectives.broadcast_object(obj, root_rank, process_set=process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's (of `process_set`) picklable object, as a list in rank order (on the
    host)."""
    return collectives.allgather_object(obj, process_set=process_set)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign rank `root_rank`'s values to `variables` on every rank, inside a ``tf.function``
    or eagerly (one fused broadcast per dtype).

    Args:
        variables: tf / Keras variables, the same shapes and dtypes on every rank.
        root_rank: the (global) rank whose values everyone gets.
        process_set: ``hvd.global_process_set`` (default) or a registered ``hvd.ProcessSet``
            holding `root_rank`: only its members call this.
        inplace: accepted (Horovod's memory option); the assignment is in place either way.

    Example:
        >>> hvd.broadcast_variables(model.variables, root_rank=0)
    """
    broadcast_(list(variables), root_rank, process_set=process_set)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Horovod's ``hvd.DistributedOptimizer`` for a Keras optimizer (``mgpu_launch.keras``'s).

    TF1 optimizers (``tf.compat.v1.train.Optimizer``) do not exist on Keras 3; `use_locking`
    is ignored. The other arguments are ``mgpu_launch.keras.DistributedOptimizer``'s.
    """
    from mgpu_launch.horovod import keras_api as _keras
    return _keras.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


# Below the names above: the tape module reads this module's topology at call time.
from mgpu_launch.horovod.tensorflow_tape import (DistributedGradientTape,  # noqa: E402
                                                 PartialDistributedGradientTape)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "rank_op", "local_rank_op", "size_op",
    "local_size_op", "process_set_included_op", "barrier", "allreduce", "grouped_allreduce",
    "allgather", "grouped_allgather", "broadcast", "broadcast_", "reducescatter",
    "grouped_reducescatter", "alltoall", "broadcast_variables", "broadcast_object",
    "allgather_object", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "SyncBatchNormalization", "Compression", "Average", "Sum", "Min",
    "Max", "Product", "Adasum", "elastic", *support.PROCESS_SET_NAMES, *support.QUERIES,
    "start_timeline", "stop_timeline",
]
