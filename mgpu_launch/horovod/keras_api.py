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
- ``allreduce``, ``allgather``, ``broadcast`` and ``reducescatter`` run on the host (MPI)
  when called eagerly, on every backend, and return a tensor of the Keras backend; inside a
  ``tf.function`` (TensorFlow backend) they are TensorFlow's in-graph collectives
  (``mgpu_launch.tensorflow``).
- ``elastic`` (``KerasState``, its callbacks, ``ObjectState``, ``run``) is restart-based: a
  commit is also written to disk (``mgpu_launch.elastic`` says what differs from Horovod's
  rollback).
- ``start_timeline`` / ``stop_timeline`` record mgpu's timeline (every rank's step phases
  and host collectives, ``mgpu_launch.runtime.timeline``), not Horovod's per-tensor one.
- Process sets (``ProcessSet``, ``init(process_sets=...)``, ``add_process_set``): registered
  by lists of ranks, not MPI communicators. ``allreduce``, ``allgather``, ``broadcast``,
  ``reducescatter`` and ``broadcast_object`` take ``process_set=`` here too (Horovod's Keras
  namespace has it on ``DistributedOptimizer`` only).
- Not provided: Adasum, explicit gradient groups.
  Every such name raises ``HorovodNotSupported`` (an
  AttributeError) saying what to do instead (``mgpu_launch.horovod.support``); refused arguments a
  ValueError.
"""

import gc
import shlex
import sys

import keras

from mgpu_launch import backends, keras_internals, runtime
from mgpu_launch.horovod import elastic, keras_callbacks as callbacks, support
from mgpu_launch.horovod.keras_values import (allgather, allreduce, broadcast, broadcast_object,
                                              reducescatter)
from mgpu_launch.horovod.support import (Adasum, Average, ProcessSet, Sum, add_process_set,
                                         ccl_built, cuda_built, ddl_built, global_process_set,
                                         gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                                         mpi_threads_supported, nccl_built, remove_process_set,
                                         rocm_built)
from mgpu_launch.runtime import cross_rank, cross_size, is_initialized, local_rank, local_size, rank, shutdown, size
from mgpu_launcher import python_api as _launch
from mgpu_launch.backends.compression import Compression
from mgpu_launch.training import optimizer as _optimizer, saving
from mgpu_launch.training.callbacks import model_state_variables
from mgpu_launch.training.layers import SyncBatchNormalization

_NAME = "mgpu_launch.keras"
__getattr__ = support.namespace_getattr(_NAME, {})
start_timeline, stop_timeline = support.timeline_functions(_NAME)
# `hvd.callbacks.X`, `from mgpu_launch.keras.callbacks import X` and `hvd.elastic.run`, as with
# Horovod.
sys.modules[f"{_NAME}.callbacks"] = callbacks
sys.modules[f"{_NAME}.elastic"] = elastic


def _reject(argument: str, value, fix: str):
    support.reject(_NAME, argument, value, fix)


def _check_op(op):
    return support.check_op(_NAME, op) if op is not None else op


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
        process_sets: None, a list of ``hvd.ProcessSet`` to register (the same on every
            rank), or ``"dynamic"`` (also ``HOROVOD_DYNAMIC_PROCESS_SETS=1``): sets added
            later with ``hvd.add_process_set``.

    Raises:
        ValueError: `comm` was given, or `process_sets` is not one of those.
        mgpu.MismatchError: the ranks passed different `process_sets`.

    Example:
        >>> import mgpu_launch.keras as hvd
        >>> hvd.init()
        >>> hvd.rank(), hvd.size()
        (0, 2)
    """
    # Horovod scripts pass compile(experimental_run_tf_function=False), a Keras 2 argument,
    # and call opt.variables(): init() installs those two patches with the others
    support.init_runtime(_NAME, comm, process_sets, keras_2=("compile", "optimizer_variables"))


# -- collectives on values: mgpu_launch.horovod.keras_values (allreduce, allgather, ...) -----
def broadcast_global_variables(root_rank):
    """Every live Keras model's weights and optimizer state get rank `root_rank`'s values.

    Keras 3 has no registry of global variables (Horovod's TF1 collection): this walks the
    live objects for built Keras models, in the order of their names, after checking that
    every rank holds the same variables. Seed-generator states stay per rank. Call it eagerly
    on every rank; with ``fit`` prefer ``hvd.callbacks.BroadcastGlobalVariablesCallback``.

    Raises:
        mgpu.MismatchError: the ranks hold different models or variables.
        ValueError: two live models share a name (e.g. a model and its reloaded copy), so
            the ranks could pair them differently: ``del`` the one you no longer use, or
            use the callback.

    Example:
        >>> hvd.broadcast_global_variables(0)
    """
    gc.collect()  # what is left must not depend on when a rank last collected
    models = {}
    for obj in gc.get_objects():
        if isinstance(obj, keras.Model) and obj.built:
            models.setdefault(obj.name, []).append(obj)
    shared = sorted(name for name, found in models.items() if len(found) > 1)
    if shared:
        raise ValueError(f"broadcast_global_variables: {len(shared)} live models share the "
                         f"name {shared[0]!r}, so the ranks could pair their variables "
                         f"differently. Delete the one you no longer use (del model), or use "
                         f"hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit.")
    variables = [v for name in sorted(models) for v in model_state_variables(models[name][0])]
    if runtime.is_multi_process():
        _optimizer.check_same_variables(variables, "the live Keras models' variables")
        backends.get_engine().broadcast_variables(variables, root_rank)


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
            here, as in Horovod; ``mgpu.DistributedOptimizer`` defaults to True). With
            ``backward_passes_per_step > 1``, ``iterations`` counts backward passes, as
            Horovod's (``iterations_count="passes"``; ``mgpu.DistributedOptimizer`` counts
            updates, as Keras's ``gradient_accumulation_steps``).
        device_dense, device_sparse: ignored: each process has one device, chosen by the
            launcher.
        num_groups, groups: must be 0 / None: gradients are fused into buffers by the engine
            (``MGPU_FUSION_MB``), not by explicit groups.
        process_set: ``hvd.global_process_set`` (default) or a registered ``hvd.ProcessSet``:
            the gradients are reduced over its members only; on a rank outside it they stay
            local (Horovod's). Its first rank's weights go to the other members at the first
            step. Needs an engine with process sets (TensorFlow, torch).
        scale_local_gradients: divide the gradients of variables registered with the
            optimizer's ``register_local_var`` by ``size()`` (the set's size; Horovod's
            default, True).

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
    if process_set is not None and not isinstance(process_set, ProcessSet):
        _reject("process_set", process_set, "pass hvd.global_process_set or an hvd.ProcessSet "
                "registered with hvd.init(process_sets=[...]) or hvd.add_process_set.")
    distributed = _optimizer.DistributedOptimizer(
        optimizer, compression=compression, op=_check_op(op),
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense,
        iterations_count="passes", process_set=process_set,
        scale_local_gradients=scale_local_gradients, name=name)
    return distributed


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """Horovod's: a :func:`DistributedOptimizer` whose `local_layers` keep their weights per
    rank (not averaged, not copied from rank 0); the other arguments are DistributedOptimizer's.

    Example:
        >>> opt = hvd.PartialDistributedOptimizer(keras.optimizers.Adam(0.001),
        ...                                       local_layers=[model.layers[-1]])
    """
    distributed = DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for weight in support.local_layer_weights(local_layers):
        distributed.register_local_var(weight)
    return distributed


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
    model = saving.load_model(filepath, custom_objects=objects or None)
    codec, loaded = Compression.get(compression), model.optimizer
    if loaded is not None and loaded.compression is not codec:
        # A new wrapper around the same (state-holding) inner optimizer, as mgpu.load_model
        # does: engines may read the compression when the wrapper is built. Every other
        # option is the loaded one's.
        inner = loaded.inner_optimizer
        rate = keras_internals.raw_learning_rate(inner)
        if isinstance(rate, _optimizer._MultipliedSchedule):  # the new wrapper adds its own
            keras_internals.swap_learning_rate(inner, rate.schedule)
        model.optimizer = _optimizer.DistributedOptimizer.wrapping(
            inner, loaded.options.replace(compression=codec), name=loaded.name)
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


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "allreduce", "allgather", "broadcast", "broadcast_object",
    "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "Compression",
    "Average", "Sum", "Adasum", *support.PROCESS_SET_NAMES, "callbacks", "run", "reducescatter",
    "broadcast_global_variables", *support.QUERIES, "SyncBatchNormalization",
    "start_timeline", "stop_timeline",
]
