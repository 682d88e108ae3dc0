"""Horovod's ``horovod.tensorflow.keras`` names on mgpu-launch: port a script by its import line.

    import mgpu_launch.keras as hvd        # was: import horovod.tensorflow.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(dataset, steps_per_epoch=500 // hvd.size(),
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(),
                         hvd.callbacks.LearningRateWarmupCallback(0.001 * hvd.size())],
              verbose=1 if hvd.rank() == 0 else 0)

Each name has Horovod's meaning and keyword arguments and is a thin layer over ``mgpu_launch``'s
own runtime, optimizer and callbacks. Differences, all listed in docs/horovod-migration.md:

- ``init()`` also lets ``Model.compile`` accept Keras 2's ``experimental_run_tf_function``
  (Keras 3 raises TypeError on it); the argument is dropped with a warning (see
  :func:`init`). It does not pin GPUs: the launcher already gives each process one GPU, so
  Horovod's ``set_visible_devices(gpus[hvd.local_rank()], 'GPU')`` lines must be deleted.
- ``allreduce``, ``allgather`` and ``broadcast`` are host collectives (for metrics and small
  state): call them eagerly, outside a ``tf.function``. They return a tensor of the Keras backend.
- Not provided: Adasum, process sets other than the global one, explicit gradient groups,
  ``reducescatter``, ``elastic``, the timeline. Using one raises an error that says what to do.
"""

import shlex
import sys
import types

import keras
import numpy as np

from mgpu_launch import collectives, keras_patches, optimizer as _optimizer, runtime
from mgpu_launch import callbacks as _callbacks, launch as _launch
from mgpu_launch.collectives import Average, Sum
from mgpu_launch.compression import Compression
from mgpu_launch.layers import SyncBatchNormalization
from mgpu_launch.runtime import (cross_rank, cross_size, is_initialized, local_rank, local_size,
                                 rank, shutdown, size)

#: Horovod's Adasum reduction. Not implemented here: passing it raises ValueError.
Adasum = "adasum"
#: Horovod's default process set: every process of the job (the only one supported).
global_process_set = types.SimpleNamespace(process_set_id=0, ranks=None)

_WHY_MISSING = {
    "reducescatter": "use hvd.allreduce and keep this rank's slice",
    "elastic": "elastic training is not supported; restart the job with "
               "mgpu.callbacks.BackupAndRestore to resume",
    "start_timeline": "use the backend's profiler (e.g. keras.callbacks.TensorBoard)",
    "stop_timeline": "use the backend's profiler (e.g. keras.callbacks.TensorBoard)",
    "ProcessSet": "only the global process set exists: run a separate job per group",
    "add_process_set": "only the global process set exists: run a separate job per group",
    "broadcast_global_variables": "Keras 3 has no global variables (TF1 sessions); use "
                                  "hvd.callbacks.BroadcastGlobalVariablesCallback(0)",
}


def __getattr__(name):
    if name in _WHY_MISSING:
        raise AttributeError(f"mgpu_launch.keras does not provide Horovod's {name!r}: "
                             f"{_WHY_MISSING[name]}. See docs/horovod-migration.md.")
    raise AttributeError(f"module 'mgpu_launch.keras' has no attribute {name!r}")


def _reject(argument: str, value, fix: str):
    raise ValueError(f"{argument}={value!r} is not supported by mgpu_launch.keras: {fix}")


def _check_op(op):
    if isinstance(op, str) and op.lower() == Adasum:
        _reject("op", "hvd.Adasum", "Adasum is not implemented. Use op=hvd.Average (the "
                "default) with a learning rate scaled by hvd.size(), or op=hvd.Sum.")
    return op


# -- runtime -----------------------------------------------------------------------------------
def init(comm=None, process_sets=None) -> None:
    """Join the job (``mgpu.init()``), and accept Horovod's Keras 2 ``compile`` argument.

    Keras 2 needed ``compile(..., experimental_run_tf_function=False)`` so that Horovod's
    optimizer ran inside the traced step. Keras 3 always runs the optimizer inside its step and
    raises TypeError on the argument, so ``init()`` wraps Keras's ``Model.compile`` once to drop
    that one keyword (with a warning on rank 0); every other argument passes through unchanged.

    Args:
        comm: must be None: the job is every process the launcher started (Horovod accepted an
            MPI communicator or a list of ranks here).
        process_sets: must be None (only the global process set is supported).

    Raises:
        ValueError: `comm` or `process_sets` was given.

    Example:
        >>> import mgpu_launch.keras as hvd
        >>> hvd.init()
        >>> hvd.rank(), hvd.size()
        (0, 2)
    """
    if comm is not None:
        _reject("comm", comm, "the job is every process the launcher started. Call hvd.init() "
                "and start the processes you want with mgpu-train -np N.")
    if process_sets is not None:
        _reject("process_sets", process_sets, "only the global process set exists. Call "
                "hvd.init() without it.")
    runtime.init()
    # Horovod scripts pass compile(experimental_run_tf_function=False), a Keras 2 argument.
    keras_patches.install_horovod_compile()


# -- collectives on values -----------------------------------------------------------------------
def _host(value) -> np.ndarray:
    # Through a backend tensor first, so Python numbers get Keras's dtypes (float32, int32) as
    # they would under Horovod's tf.constant.
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(value)))


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """Average (or sum) `value` over all processes, eagerly, on the host.

    Args:
        value: a tensor, numpy array or number; the same shape and dtype on every rank.
        name: ignored (Horovod's op name).
        average: Horovod's deprecated flag: True is ``op=Average``, False is ``op=Sum``.
        prescale_factor: multiply `value` by this before the reduction.
        postscale_factor: multiply the result by this after it.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        compression: accepted; host collectives always send full precision.

    Returns:
        The reduced value as a tensor of the Keras backend.

    Raises:
        ValueError: both `average` and `op` given, or ``op=hvd.Adasum``.
        mgpu.MismatchError: ranks passed different shapes or dtypes.

    Example:
        >>> hvd.allreduce(float(val_loss))          # mean over the ranks
    """
    if average is not None and op is not None:
        raise ValueError("allreduce: pass op=hvd.Average or op=hvd.Sum, not both op and the "
                         "deprecated average=")
    op = _check_op(op) or (Average if average is None or average else Sum)
    Compression.get(compression)
    array = _host(value)
    if prescale_factor != 1.0:
        array = array * prescale_factor
    result = collectives.allreduce(array, op=op)
    if postscale_factor != 1.0:
        result = result * postscale_factor
    return keras.ops.convert_to_tensor(result)


def allgather(value, name=None):
    """Every rank's `value` concatenated along the first axis (ragged), as a backend tensor.

    Example:
        >>> hvd.allgather(np.array([hvd.rank()]))   # [0, 1] on 2 processes
    """
    return keras.ops.convert_to_tensor(collectives.allgather(_host(value)))


def broadcast(value, root_rank, name=None):
    """Rank `root_rank`'s `value` (same shape and dtype on every rank), as a backend tensor.

    Example:
        >>> seed = hvd.broadcast(np.random.randint(1 << 30), root_rank=0)
    """
    return keras.ops.convert_to_tensor(collectives.broadcast(_host(value), root_rank))


def broadcast_object(obj, root_rank=0, name=None):
    """Rank `root_rank`'s picklable Python object, on every rank.

    Example:
        >>> start_epoch = hvd.broadcast_object(start_epoch, root_rank=0)
    """
    return collectives.broadcast_object(obj, root_rank)


# -- optimizer and model -------------------------------------------------------------------------
def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Horovod's ``DistributedOptimizer``: an ``mgpu.DistributedOptimizer`` wrapping `optimizer`.

    Args:
        optimizer, name, compression, sparse_as_dense, gradient_predivide_factor, op,
            backward_passes_per_step, average_aggregated_gradients: as in Horovod, passed to
            ``mgpu.DistributedOptimizer`` (``average_aggregated_gradients`` defaults to False
            here, as in Horovod; ``mgpu.DistributedOptimizer`` defaults to True).
        device_dense, device_sparse: ignored: each process has one device, chosen by the
            launcher.
        num_groups, groups: must be 0 / None: gradients are fused into buffers by the engine
            (``MGPU_FUSION_MB``), not by explicit groups.
        process_set: must be the global process set.
        scale_local_gradients: ignored: there are no per-rank (local) variables; every gradient
            is reduced.

    Returns:
        An ``mgpu.DistributedOptimizer``, a ``keras.optimizers.Optimizer``.

    Raises:
        ValueError: an argument that cannot be honoured; the message names it and the fix.

    Example:
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()),
        ...                                compression=hvd.Compression.fp16)
    """
    if num_groups or groups is not None:
        argument = "num_groups" if num_groups else "groups"
        _reject(argument, num_groups or groups, f"the engine fuses gradients into buffers of "
                f"MGPU_FUSION_MB megabytes. Remove {argument} (or set MGPU_FUSION_MB).")
    if process_set is not None and process_set is not global_process_set:
        _reject("process_set", process_set, "gradients are always reduced over every process "
                "of the job. Leave process_set out (or pass hvd.global_process_set).")
    return _optimizer.DistributedOptimizer(
        optimizer, compression=compression, op=_check_op(op),
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
        name=name)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
    """Load a Keras model and give it a DistributedOptimizer around its saved optimizer.

    Args:
        filepath: a ``.keras`` file (or a legacy ``.h5``).
        custom_optimizers: optimizer classes of your own that the file uses.
        custom_objects: other custom classes or functions, as for ``keras.models.load_model``.
        compression: the gradient compression of the returned optimizer (as in Horovod, it
            replaces whatever compression the model was saved with).

    Returns:
        The model, its optimizer an ``mgpu.DistributedOptimizer``.

    Example:
        >>> model = hvd.load_model("checkpoint-10.keras")
    """
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = _optimizer.load_model(filepath, custom_objects=objects or None)
    codec, loaded = Compression.get(compression), model.optimizer
    if loaded is not None and loaded.compression is not codec:
        # A new wrapper around the same (state-holding) inner optimizer, as mgpu.load_model
        # does: engines may read the compression when the wrapper is built.
        inner = loaded.inner_optimizer
        if isinstance(inner._learning_rate, _optimizer._MultipliedSchedule):
            inner._learning_rate = inner._learning_rate.schedule  # the new wrapper adds its own
        model.optimizer = _optimizer.DistributedOptimizer(
            inner, compression=codec, op=loaded.op, name=loaded.name,
            backward_passes_per_step=loaded.backward_passes_per_step,
            average_aggregated_gradients=loaded.average_aggregated_gradients,
            gradient_predivide_factor=loaded.gradient_predivide_factor,
            sparse_as_dense=loaded.sparse_as_dense)
    return model


# -- launching from Python ---------------------------------------------------------------------
def run(func, args=(), kwargs=None, np=1, hosts=None, hostfile=None, mpi_args=None,
        verbose=None, use_gloo=None, use_mpi=None, **unsupported):
    """Horovod's ``horovod.run``: ``func(*args, **kwargs)`` on `np` processes, every result.

    Over :func:`mgpu_launch.run` (same launcher as ``mgpu-train -np N``). Horovod's
    ``tensorflow2_keras_mnist.py`` runs with ``import mgpu_launch.keras as horovod`` in place
    of ``import horovod``.

    Args:
        func, args, kwargs, np, hosts, hostfile: as in Horovod.
        mpi_args: extra mpirun arguments, one string.
        verbose, use_gloo, use_mpi: accepted and ignored: the job always starts through
            mpirun, and collectives use the backend's engine (NCCL on GPUs).
        **unsupported: Horovod's elastic and ssh options are refused with a ValueError.

    Returns:
        The list of every rank's result, in rank order (Horovod's).

    Raises:
        mgpu_launch.RemoteError: a rank failed; the message has its traceback.

    Example:
        >>> models = hvd.run(train, np=2, hosts="localhost:2")
    """
    given = {name: value for name, value in unsupported.items() if value is not None}
    if given:
        name = sorted(given)[0]
        _reject(name, given[name], "mgpu_launch.keras.run takes func, args, kwargs, np, "
                "hosts, hostfile and mpi_args; elastic training and ssh settings are not "
                "supported (configure ssh for mpirun itself). Remove it.")
    return _launch.run(func, args=args, kwargs=kwargs, np=np, hosts=hosts, hostfile=hostfile,
                       mpirun_args=shlex.split(mpi_args or ""), all_ranks=True)


# -- callbacks -----------------------------------------------------------------------------------
class BroadcastGlobalVariablesCallback(_callbacks.BroadcastGlobalVariablesCallback):
    """Horovod's: every rank starts from `root_rank`'s weights and optimizer state.

    Args:
        root_rank: the rank whose state everyone starts from.
        device: ignored (each process has one device).
        local_variables: must be empty: DistributedOptimizer copies every trainable weight from
            rank 0 and averages every gradient, so per-rank variables cannot be kept.
    """

    def __init__(self, root_rank, device="", local_variables=None):
        if local_variables:
            _reject("local_variables", local_variables, "every variable is copied from rank 0. "
                    "Remove local_variables.")
        super().__init__(root_rank)


class MetricAverageCallback(_callbacks.MetricAverageCallback):
    """Horovod's: average the epoch's metric logs over the ranks (`device` is ignored)."""

    def __init__(self, device=""):
        super().__init__()


# `hvd.callbacks.X` and `from mgpu_launch.keras.callbacks import X`, as with Horovod.
callbacks = types.ModuleType(f"{__name__}.callbacks", "Horovod's Keras callbacks.")
callbacks.BroadcastGlobalVariablesCallback = BroadcastGlobalVariablesCallback
callbacks.MetricAverageCallback = MetricAverageCallback
callbacks.LearningRateWarmupCallback = _callbacks.LearningRateWarmupCallback
callbacks.LearningRateScheduleCallback = _callbacks.LearningRateScheduleCallback
sys.modules[callbacks.__name__] = callbacks

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "allreduce", "allgather", "broadcast", "broadcast_object",
    "DistributedOptimizer", "load_model", "Compression", "Average", "Sum", "Adasum",
    "global_process_set", "callbacks", "run", "SyncBatchNormalization",
]
