"""TensorFlow engine: gradient allreduce inside Keras's ``tf.function`` train step.

Default transport, ``collective``: TensorFlow's own in-graph collective ops
(``CollectiveReduceV2``) — NCCL on GPU, a gRPC ring on CPU — with no ``tf.distribute`` strategy.
At ``mgpu.init()`` every rank starts a TF server; the ranks exchange their addresses over MPI and
rank 0 becomes the collective group leader (without a leader the ops wait forever). This must
happen before TensorFlow creates any tensor or variable: call ``mgpu.init()`` first.

Opt-in transport, ``mpi`` (``MGPU_TF_TRANSPORT=mpi``, CPU only): each fused buffer leaves the
graph through ``tf.numpy_function`` and is summed by ``MPI_Allreduce``. On our 2-core CPU box it
was ~5x faster than the gRPC ring for 100 MB; it cannot run under XLA or on GPU tensors.

Gradients are fused into one flat buffer per dtype (Horovod's tensor fusion): one collective per
dtype per step. One ordering token keeps the collectives in program order on every rank.

Instance keys: TensorFlow keeps a record (~0.9 KB) for every instance key it has seen, forever,
and its per-collective latency rises as the table grows. So a collective whose buffer has a
static shape takes a key derived from what it is — dtype, shape, and its position among the
collectives of the same trace — and every execution of that step reuses it, as
``tf.distribute`` does with the constant keys in its graphs. The key depends on nothing a rank
counts at run time, so retracing on one rank only, or a new trace for another input shape,
still gives every rank the same key; the ordering token keeps two executions of one key from
overlapping. Memory and latency then stay flat (``benchmarks/tf_long_run.md``: 100k steps).
A buffer of unknown static shape (TF reuses a key only for the same shape) falls back to a
fresh key per execution from an in-graph counter, in a range of its own.

Collective implementation (``MGPU_TF_COLLECTIVE``, GPU tensors): ``nccl`` (GPU to GPU, one
GPU per rank), ``ring`` (TensorFlow's host ring over gRPC: works whatever the GPUs are, also
when several ranks share one GPU or the GPUs have no peer path, e.g. PCIe boxes without P2P),
``auto`` (the default: ``ring`` when this host's ranks were not pinned one GPU each
(``mgpu-train --no-pin`` with more than one local rank), else TensorFlow's own choice, which is
NCCL for GPU tensors). Ranks that share a GPU also get TensorFlow's memory growth, so the first
one does not take the whole device.

XLA: Keras's ``jit_compile="auto"`` resolves to no XLA on CPU-only machines, so the default step
works. An explicit ``jit_compile=True`` on CPU cannot compile collectives (TensorFlow:
"Collectives are not yet implemented for CPU devices when compiling with XLA"), nor can the
``ring`` implementation be compiled on GPU: there the engine turns XLA off for the step (see
:meth:`TensorFlowEngine.compiles_collectives`) or, for an explicit ``jit_compile=True``, raises a
clear error at trace time. NCCL between GPU processes under XLA needs a multi-GPU machine and
has not run here (docs/backends.md says what did).
"""

import sys
from typing import Any, List, Sequence

import numpy as np

from mgpu_launch.backends import Engine, api, reduction, shared
from mgpu_launch.backends.tensorflow import collectives as tensorflow_collectives, feeding as tensorflow_feeding, server as tensorflow_server
from mgpu_launch.backends.tensorflow.keys import CollectiveKeys
from mgpu_launch.runtime.rendezvous import reserved_port
from mgpu_launch.config import settings

_JOB = "worker"


def _elements(tensor) -> int:
    """Elements of `tensor` when its static shape says (the fused buffer is split by these
    counts), else 0: the plan only orders and groups, and :meth:`TensorFlowEngine.allreduce`
    splits such a buffer by the tensors' run-time sizes."""
    if not tensor.shape.is_fully_defined():
        return 0
    return int(np.prod(tensor.shape.as_list(), dtype=np.int64))


def _shaped_like(gradient, variable):
    """`gradient` with `variable`'s static shape where TensorFlow lost it.

    A Dense kernel's gradient on a 3-D input of unknown batch size (every transformer fed
    by ``Task.fit``, a ``tf.data`` without ``drop_remainder``, a PyDataset through Keras's
    adapter) has static shape ``(None, n)`` although it is always the kernel's ``(m, n)``.
    With the variable's shape the buffer keeps a static size: fixed instance keys, XLA.
    """
    import tensorflow as tf
    shape = getattr(variable, "shape", None)
    if gradient.shape.is_fully_defined() or shape is None or None in tuple(shape):
        return gradient
    return tf.reshape(gradient, tuple(shape))


class TensorFlowEngine(shared.KerasFeeding, shared.KerasTrainStep, shared.HostBroadcast,
                       shared.DenseReduction, shared.HasProcessSets, shared.GroupCheck,
                       shared.GatherBySum, shared.DefaultReductionTiming, Engine,
                       api.GraphCollectives):
    name = "tensorflow"

    def __init__(self):
        self.transport = settings.choice("MGPU_TF_TRANSPORT")
        self.implementation = settings.choice("MGPU_TF_COLLECTIVE")
        self.timeout = settings.seconds("MGPU_COLLECTIVE_TIMEOUT")
        self.sparse_gather = settings.choice("MGPU_TF_SPARSE_GATHER")
        #: profiling only (mgpu-bench --profile): the step without its gradient sum
        self.skip_allreduce = settings.flag("MGPU_PROFILE_SKIP_ALLREDUCE")
        self.size = 1
        self.control_plane = None  # the runtime's transport (MGPU_TF_TRANSPORT=mpi)
        #: the collectives' instance keys and ordering token (collectives.py uses them too)
        self.keys = CollectiveKeys()

    # -- set-up -------------------------------------------------------------------------------
    def setup(self, state) -> None:
        import tensorflow as tf
        from tensorflow.core.protobuf import tensorflow_server_pb2
        from tensorflow.python.eager import context

        if state.transport.name != "mpi":
            raise RuntimeError(
                f"{state.source} started this TensorFlow job (its ranks meet over "
                f"{state.transport.name}); on TensorFlow mgpu-launch runs over MPI only. Start "
                f"it with mgpu-train -np N (or mpirun / srun --mpi=pmix), or choose "
                f"KERAS_BACKEND=torch (torchrun) or jax (docs/torchrun.md).")
        self.size, self.control_plane = state.size, state.transport
        if self.transport == "mpi":
            return
        ctx = context.context()
        if ctx._context_handle is not None:
            raise RuntimeError(
                "mgpu.init() must run before TensorFlow creates any tensor or variable (its "
                "in-graph collectives can only be enabled at program start). Move mgpu.init() "
                "to the top of the script, right after the imports.")
        shared_gpu = self._share_gpus(tf, state)
        if self.implementation == "auto":
            self.implementation = "ring" if shared_gpu else "auto"
        with reserved_port() as port:  # held until TF's server listens on it
            addresses = state.transport.allgather_object(
                f"{tensorflow_server.reachable_host(state)}:{port}")
            ctx.configure_collective_ops(
                collective_leader=f"/job:{_JOB}/replica:0/task:0",
                scoped_allocator_enabled_ops=("CollectiveReduce",),
                device_filters=(f"/job:{_JOB}/task:{state.rank}",))
            server_def = tensorflow_server_pb2.ServerDef(
                cluster=tf.train.ClusterSpec({_JOB: addresses}).as_cluster_def(),
                default_session_config=ctx.config, job_name=_JOB, task_index=state.rank,
                protocol="grpc", port=port)
            ctx.enable_collective_ops(server_def)
            ctx.ensure_initialized()
        warning = tensorflow_server.grpc_exposure_warning(state, port)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        self.keys.create()

    @staticmethod
    def _share_gpus(tf, state) -> bool:
        """Memory growth when this host's ranks share GPUs (not pinned one each); returns
        whether they do. Must run before TensorFlow initializes its devices."""
        gpus = tf.config.list_physical_devices("GPU")  # does not initialize them
        if not gpus or settings.text("MGPU_GPU") is not None or state.local_size < 2:
            return False
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        return True

    # -- feeding --------------------------------------------------------------------------------
    def computes_on_accelerator(self) -> bool:
        import tensorflow as tf
        return bool(tf.config.list_logical_devices("GPU"))

    def prefetch_source(self, epoch_iterator, keras_get_iterator):
        """The tf.data batches, iterated in the prefetch thread (see
        :mod:`~mgpu_launch.backends.tensorflow.feeding`)."""
        return tensorflow_feeding.dataset_source(epoch_iterator)

    def prefetch_transfer(self):
        """Each batch copied to this rank's GPU, ``int32`` tensors made ``int64`` there
        (``MGPU_TF_WIDEN_INT32``; see :mod:`~mgpu_launch.backends.tensorflow.feeding`)."""
        return tensorflow_feeding.device_transfer()

    def keras_patches(self, hooks):
        """The tensorflow patch set (``backends/tensorflow/patches.py``)."""
        from mgpu_launch.backends.tensorflow import patches
        return patches.patch_set(hooks)

    def compiles_collectives(self) -> bool:
        """Whether the step's collectives can be compiled by XLA here: on GPU, with the
        in-graph transport and an implementation other than ``ring``."""
        import tensorflow as tf
        return (self.transport == "collective" and self.implementation != "ring"
                and bool(tf.config.list_physical_devices("GPU")))

    # -- the step -----------------------------------------------------------------------------
    def check_not_xla(self) -> None:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util

        if not control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
            return
        if not self.compiles_collectives():
            raise ValueError(
                "the gradient allreduce cannot be compiled with XLA here (TensorFlow has no "
                "XLA collectives on CPU, MGPU_TF_TRANSPORT=mpi leaves the graph, and "
                "MGPU_TF_COLLECTIVE=ring runs on the host). Compile the model with "
                "jit_compile=False, or leave the default 'auto': mgpu then turns XLA off "
                "where the collectives cannot be compiled.")

    def _sum_flat(self, flat, group):
        import tensorflow as tf

        if self.skip_allreduce:  # what the sum would give if every rank held this buffer
            return flat * tf.cast(group.size, flat.dtype)
        if self.transport == "mpi":  # 16-bit wires are summed in float32 (MPI has no fp16)
            return tensorflow_collectives.mpi_reduce(group.control_plane, flat, "sum")
        return self.collective_reduce(flat, members=group)

    def collective_reduce(self, tensor, *, kind: str = "reduce", merge_op: str = "Add",
                          members=None):
        """One in-graph ``CollectiveReduceV2`` of `tensor` over all ranks, or over `members`
        (a process set's ``tensorflow_collectives.Members``) (``merge_op``: Add, Min, Max or
        Mul), keyed by its signature within `kind` (``keys.CollectiveKeys.for_collective``) and ordered
        behind the step's other collectives."""
        import tensorflow as tf
        group = members or tensorflow_collectives.members(self)
        return tf.raw_ops.CollectiveReduceV2(
            input=tensor, group_size=group.size, group_key=group.key,
            instance_key=self.keys.for_collective(tensor, kind, members),
            ordering_token=[self.keys.ordering_token.handle],
            merge_op=merge_op, final_op="Id", communication_hint=self.implementation,
            timeout_seconds=self.timeout)

    def shutdown(self) -> None:
        """Nothing to close: the engine keeps no communicator object of its own."""

    def set_skip_allreduce(self, skip: bool) -> bool:
        """Set :attr:`skip_allreduce` (the next traced step follows it)."""
        self.skip_allreduce = bool(skip)
        return True

    def allreduce(self, tensors: Sequence[Any], *, average: bool, prescale: float = 1.0,
                  postscale: float = 1.0, compression=None, group=None) -> List[Any]:
        import tensorflow as tf

        self.check_not_xla()
        members = tensorflow_collectives.members(self, group, "allreduce")
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        prescale, scale = reduction.scales(average, members.size, prescale, postscale)
        specs = [reduction.TensorSpec(t.dtype.name, _elements(t), t.dtype.size) for t in tensors]
        result: List[Any] = [None] * len(tensors)
        # One buffer per dtype (no MGPU_FUSION_MB limit here), the same on every rank.
        for bucket in reduction.plan(specs):
            indices = bucket.indices
            flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], axis=0)
            if prescale != 1.0:
                flat = flat * tf.cast(prescale, flat.dtype)
            wire = compression.compress(flat) if compression else flat
            summed = self._sum_flat(wire, members)
            summed = compression.decompress(summed, flat.dtype) if compression else summed
            if scale != 1.0:
                summed = summed * tf.cast(scale, summed.dtype)
            if all(tensors[i].shape.is_fully_defined() for i in indices):
                pieces = tf.split(summed, list(bucket.sizes))
            else:  # a tensor of unknown static shape: split by the sizes it has at run time
                pieces = tf.split(summed, tf.stack([tf.size(tensors[i], out_type=tf.int32)
                                                    for i in indices]))
            for i, piece in zip(indices, pieces):
                result[i] = tf.reshape(piece, tf.shape(tensors[i]))
        return result

    def compile_reduction(self, function, example):
        """A ``tf.function`` of its own, traced here: the step's buffers, so the same instance
        keys (their signatures), transport and compression; compiled by XLA where the step's
        collectives are (GPUs, Keras's default "auto"): outside XLA TensorFlow's GPU collective
        took 326 ms for what XLA's all-reduce sums in 0.57 ms (2x H200,
        benchmarks/tf_gpu/results_2026-11-26-h200x2-second)."""
        import tensorflow as tf
        return tf.function(function, autograph=False, jit_compile=self.compiles_collectives()
                           or None).get_concrete_function(example)

    def step_path(self, model) -> reduction.StepPath:
        """Keras's TF step: a ``tf.function``, compiled by XLA under ``jit_compile`` (which
        mgpu turns off where the collectives cannot be compiled), else a TF graph."""
        if not model.run_eagerly and not model.jit_compile:
            return reduction.StepPath("graph")
        return super().step_path(model)

    def reduction_advice(self) -> str:
        if self.transport == "mpi" or self.computes_on_accelerator():
            return ""
        return "try MGPU_TF_TRANSPORT=mpi (CPU: 1.6x faster than gRPC at 50 MB here)"

    # -- collectives on tensors other than the gradient sum (collectives.py) --
    def build_info(self) -> dict:
        import tensorflow as tf
        cuda = tf.test.is_built_with_cuda()
        return {"cuda": cuda, "rocm": tf.test.is_built_with_rocm(),
                "nccl": cuda and self.transport == "collective" and self.implementation != "ring"}

    def is_sparse(self, value) -> bool:
        import tensorflow as tf
        return isinstance(value, tf.IndexedSlices)

    def tracing(self) -> bool:
        import tensorflow as tf
        return not tf.executing_eagerly()

    def allgather(self, tensors, group=None):
        """Each tensor of `tensors` (the same number of rows on this rank) gathered along
        axis 0 from every rank (of process set `group`), in rank order; the row count may
        differ between ranks."""
        return tensorflow_collectives.allgather_rows(self, tensors, group)

    def broadcast(self, tensor, root_rank: int, group=None):
        """Rank `root_rank`'s `tensor`, on every rank (of process set `group`)."""
        return tensorflow_collectives.broadcast(self, tensor, root_rank, group)

    def reduce(self, tensor, op: str, group=None):
        """`tensor` combined elementwise over the ranks (of process set `group`): op "sum",
        "min", "max" or "product"."""
        return tensorflow_collectives.reduce(self, tensor, op, group)

    def reduce_gradients(self, grads, variables, options: reduction.GradientReduction,
                         group=None) -> List[Any]:
        """Dense gradients through :meth:`allreduce`; with ``sparse_as_dense=False``,
        IndexedSlices through an allgather of their slices, which keeps single-process
        semantics (docs/training-recipe.md, sparse gradients). A dense gradient whose static
        shape TensorFlow lost (an unknown batch size) takes its variable's."""
        import tensorflow as tf
        grads = [g if g is None or (isinstance(g, tf.IndexedSlices)
                                    and not options.sparse_as_dense)
                 else _shaped_like(self.densify(g), v) for g, v in zip(grads, variables)]
        sparse = [] if options.sparse_as_dense else [
            i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        if not sparse:
            return super().reduce_gradients(grads, variables, options, group=group)
        dense = [i for i in range(len(grads)) if i not in sparse]
        result = list(grads)
        reduced = super().reduce_gradients(
            [grads[i] for i in dense], [variables[i] for i in dense], options, group=group)
        for i, value in zip(dense, reduced):
            result[i] = value
        size = tensorflow_collectives.members(self, group, "reduce_gradients").size
        scale = reduction.scale_once(options.average, size, options.prescale, options.postscale)
        for i in sparse:
            result[i] = tensorflow_collectives.reduce_sparse(self, grads[i], scale=scale,
                                                             compression=options.compression,
                                                             group=group)
        return result

    def sum_in_step(self, tensors: Sequence[Any]) -> List[Any]:
        """A sum across ranks in the forward pass, with its gradient: TensorFlow registers none
        for CollectiveReduceV2, so a custom gradient sums the incoming gradients the same way.
        Forward and backward buffers take keys like any other sum (signature and position in
        the trace, see the module docstring): the same on every rank, apart from the
        gradients'."""
        import tensorflow as tf

        @tf.custom_gradient
        def summed(*values):
            def backward(*upstream):
                upstream = [tf.zeros_like(v) if u is None else u
                            for u, v in zip(upstream, values)]
                return self.allreduce(upstream, average=False)
            return self.allreduce(list(values), average=False), backward

        return list(summed(*[tf.convert_to_tensor(t) for t in tensors]))

    def densify(self, gradient):
        """IndexedSlices (sparse embedding gradients) as a dense tensor; others unchanged."""
        import tensorflow as tf
        if isinstance(gradient, tf.IndexedSlices):
            return tf.convert_to_tensor(gradient)
        return gradient

    def readable_on_host(self, variables) -> bool:
        """False for variables created inside the step's trace (a lazily built model)."""
        import tensorflow as tf
        with tf.init_scope():
            try:
                return all(np.shape(v.numpy()) == tuple(v.shape) for v in variables)
            except (ValueError, TypeError, tf.errors.OpError):
                return False

    def broadcast_variables(self, variables, root_rank: int, group=None) -> None:
        import tensorflow as tf
        with tf.init_scope():  # host values even when called while a step is being traced
            super().broadcast_variables(variables, root_rank, group)
