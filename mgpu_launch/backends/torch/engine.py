"""PyTorch engine: bucketed gradient allreduce that overlaps the backward pass (DDP's design).

Keras's torch trainer runs eagerly: ``loss.backward()``, then ``optimizer.apply(grads)``. At
``build`` the DistributedOptimizer hands its variables to :meth:`TorchEngine.watch`, which
groups their gradients into buckets of ``MGPU_FUSION_MB`` (default 25) MB, last layers first,
and registers a post-accumulate-grad hook on every parameter. When the last gradient of a
bucket arrives during backward, the bucket is packed into one flat buffer and its allreduce is
launched asynchronously — buckets strictly in order, so every rank issues the same collectives
in the same order. ``apply`` then only waits. A parameter without a gradient on some rank
(unused in that rank's forward) takes part as zeros: its bucket is launched in ``apply``.

Set-up (``mgpu.init()``): rank 0 picks a TCP address, MPI shares it (after every rank proved it
can connect), rank 0 serves torch's TCPStore there, bound to that address only, and
``torch.distributed.init_process_group`` starts NCCL on GPU (the launcher has pinned one GPU
per process with CUDA_VISIBLE_DEVICES) or gloo on CPU. Under torchrun (the
``torch.distributed`` control plane, mgpu_launch.runtime.transport_torch) the transport has
started torch.distributed already, on torchrun's store: the engine adopts that default group
(gloo, with NCCL for CUDA tensors) and leaves it to the transport to end.

Process sets (``mgpu_launch.runtime.process_sets``): every set registered gets a
``torch.distributed.new_group`` of its ranks, on every rank in registration order (torch
requires every rank to create every group); ``allreduce`` / ``reduce_gradients`` with a set's
group reduce over it. A DistributedOptimizer with a process set reduces in ``apply`` (one
fused allreduce per dtype), without the backward hooks.

Keras >= 3.16 wraps the model in ``DistributedDataParallel`` by itself when torch.distributed
is initialized (``TorchTrainer._initialize_ddp``): gradients would then be reduced twice (once
by DDP, once here) and BatchNorm buffers broadcast from rank 0 every step.
Once mgpu.init() has started the process group, mgpu_launch.training.patches skips that
wrapping for every model (docs/backends.md, "PyTorch backend").
"""

import datetime
import os
import sys
import weakref
from typing import Any, List, Optional, Sequence

from mgpu_launch.backends import Engine, reduction, shared
from mgpu_launch.backends.torch import compiled as compiled_step, step_path as torch_step_path
from mgpu_launch.runtime import process_sets, transport_torch
from mgpu_launch.runtime.rendezvous import (host_and_port, interface_of, job_host_address,
                                            listen, rendezvous)
from mgpu_launch.config import settings


def _bind_gloo(host: str) -> None:
    """Make gloo use the interface that holds `host` (unless GLOO_SOCKET_IFNAME is set).

    Left alone, gloo binds to this host's own name resolved, which Debian's /etc/hosts maps to
    127.0.1.1: ranks on other hosts then dial their own loopback.
    """
    interface = interface_of(host)
    if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def _store(dist, state, address: str, timeout: datetime.timedelta):
    """torch's TCPStore at `address`; rank 0 serves it on a socket bound to that address.

    Given ``init_method="tcp://host:port"``, torch's store server (no authentication) listens
    on every interface; a socket bound here (rendezvous.listen: the address it is dialled at,
    or MGPU_BIND_ADDRESS) and handed over as ``master_listen_fd`` keeps it to the job's
    network. The store owns and closes the descriptor.
    """
    host, port = host_and_port(address)
    if state.rank != 0:
        return dist.TCPStore(host, port, state.size, False, timeout)
    listener = listen(address, job_host_address(state))  # known by now: no collective
    return dist.TCPStore(host, port, state.size, True, timeout,
                         master_listen_fd=listener.detach())


class TorchEngine(shared.KerasTrainStep, shared.HostBroadcast, shared.DenseReduction,
                  shared.HasProcessSets, shared.GroupCheck, shared.GatherBySum,
                  shared.DefaultReductionTiming, shared.CannotSkipAllreduce, shared.NoBuildInfo,
                  Engine):
    name = "torch"

    def __init__(self):
        self.size = 1
        self.initialized = False
        #: bytes per gradient bucket (DDP's bucket_cap_mb)
        self.fusion_bytes = int(settings.number("MGPU_FUSION_MB", fallback=25.0) * 2 ** 20)
        self._watched: Optional["GradientBuckets"] = None
        self._groups = {}  # process set id -> its torch.distributed group (None: not a member)
        self._owns_group = False  # whether setup() started torch.distributed (MPI jobs)
        #: model -> the train step wrap_train_function made for it last (what step_path reads)
        self._steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    # -- set-up -------------------------------------------------------------------------------
    def setup(self, state) -> None:
        import torch
        import torch.distributed as dist

        adopted = transport_torch.owns_torch_distributed(state.transport)
        if dist.is_initialized() and not adopted:
            raise RuntimeError(
                "torch.distributed is already initialized in this process; mgpu.init() sets it "
                "up itself (NCCL on GPU, gloo on CPU). Remove the init_process_group call.")
        self.size = state.size
        if "OMP_NUM_THREADS" not in os.environ:
            # Keras's torch step is host-bound; N processes with a pool of all cores each
            # oversubscribe the CPU (2x H200 box: 89.4% -> 94.6% scaling with 4 threads each).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // state.local_size))
        timeout = datetime.timedelta(seconds=settings.seconds("MGPU_TORCH_TIMEOUT"))
        if torch.cuda.is_available():
            # One visible GPU when the launcher pinned it (CUDA_VISIBLE_DEVICES), else all.
            device = torch.device("cuda", state.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            options = {"backend": "nccl", "device_id": device}
        else:
            options = {"backend": "gloo"}
            _bind_gloo(job_host_address(state))
        ours = sys.excepthook
        if not adopted:  # an MPI job; under torchrun the transport's group is the job's
            with rendezvous(state, "MGPU_TORCH_ADDRESS") as address:
                store = _store(dist, state, address, timeout)
            dist.init_process_group(store=store, rank=state.rank, world_size=state.size,
                                    timeout=timeout, **options)
        # torch wraps sys.excepthook to capture stderr while the old hook runs; ours aborts
        # the MPI job inside that hook, so the captured traceback would never be printed.
        sys.excepthook = ours
        self.initialized, self._owns_group = True, not adopted
        process_sets.add_listener(self._set_added, self._set_removed)

    def _set_added(self, group) -> None:
        """A process set registered (on every rank): its torch group, made by every rank."""
        import torch.distributed as dist
        made = dist.new_group(ranks=list(group.ranks))
        self._groups[group.process_set_id] = made if group.transport is not None else None

    def _set_removed(self, group) -> None:
        import torch.distributed as dist
        made = self._groups.pop(group.process_set_id, None)
        if made is not None and dist.is_initialized():
            dist.destroy_process_group(made)

    def _torch_group(self, group, what: str):
        """The torch.distributed group of process set `group` (None: the default group)."""
        if group is None or group.process_set_id == 0:
            return None
        process_sets.group_of(group, what)  # raises on a rank outside it
        return self._groups[group.process_set_id]

    # -- feeding --------------------------------------------------------------------------------
    def computes_on_accelerator(self) -> bool:
        import torch
        return torch.cuda.is_available()

    def prefetch_source(self, epoch_iterator, keras_get_iterator):
        return keras_get_iterator(epoch_iterator)

    def prefetch_transfer(self):
        return _to_device()

    def runs_epochs_ahead(self) -> bool:
        """No: every epoch's DataLoader draws a seed from torch's global generator as it
        starts (the order, when shuffled), and so does the validation's between epochs; begun
        early, the draws would leave Keras's order."""
        return False

    def runs_sharded_tf_data_ahead(self) -> bool:
        """No: no epoch runs ahead on torch (:meth:`runs_epochs_ahead`)."""
        return False

    # -- the train step -----------------------------------------------------------------------------
    def wrap_train_function(self, model, function, options: reduction.StepOptions):
        """With ``jit_compile`` (by default on a GPU, mgpu_launch.backends.torch.compiled): the
        step traced and compiled as one graph. With ``MGPU_TORCH_CUDA_GRAPH=1`` (or
        ``DistributedOptimizer(cuda_graph=True)``): the step -- compiled or eager -- captured
        in a CUDA graph and replayed (mgpu_launch.backends.torch.graph)."""
        from mgpu_launch import runtime
        from mgpu_launch.backends.torch import graph as torch_graph
        chief = runtime.state.rank == 0
        if model.jit_compile:  # Keras wrapped its own torch.compile around the step: unwrap
            function = getattr(function, "__wrapped__", function)  # torch.compile's wraps
            function = compiled_step.CompiledTrainStep(model, function, options,
                                                       is_chief=chief)
        if torch_graph.requested(options):
            function = torch_graph.GraphedTrainStep(model, function, options, is_chief=chief)
        self._steps[model] = function
        return function

    def keras_patches(self, hooks):
        """The torch patch set (``backends/torch/patches.py``)."""
        from mgpu_launch.backends.torch import patches
        return patches.patch_set(hooks)

    def step_path(self, model) -> reduction.StepPath:
        """What the step this engine made for `model` ran as (``step_path.path_of``)."""
        return torch_step_path.path_of(self._steps.get(model))

    def step_advice(self, model, options: reduction.StepOptions) -> str:
        """A step that runs eagerly: compile it (on a GPU also: capture it); nothing when it
        is compiled or captured already; the reason when it fell back (``step_path.advice``)."""
        return torch_step_path.advice(self._steps.get(model), model, options)

    def shutdown(self) -> None:
        process_sets.remove_listener(self._set_added, self._set_removed)
        self._groups.clear()  # destroy_process_group() below ends them all
        if self._watched is not None:
            self._watched.remove()
            self._watched = None
        if self.initialized:
            import torch.distributed as dist
            graphs = sys.modules.get("mgpu_launch.backends.torch.graph")
            if graphs is not None:
                graphs.release()  # else destroy_process_group can hang (see release())
            if dist.is_initialized() and self._owns_group:  # else the transport's to end
                dist.destroy_process_group()
            self.initialized = False

    # -- reductions -------------------------------------------------------------------------------
    def allreduce(self, tensors: Sequence[Any], *, average: bool, prescale: float = 1.0,
                  postscale: float = 1.0, compression=None, group=None) -> List[Any]:
        """Synchronous fused allreduce (one buffer per dtype), for gradients not watched;
        within process set `group` when given."""
        size = self.size if group is None else group.size
        reducer = Reduction(size, average, prescale, postscale, compression,
                            self._torch_group(group, "allreduce"))
        result: List[Any] = [None] * len(tensors)
        for bucket in reduction.plan(_specs(tensors)):
            chosen = [tensors[i] for i in bucket.indices]
            flat, work = reducer.launch(chosen, chosen)
            for i, value in zip(bucket.indices, reducer.finish(flat, work, chosen, bucket)):
                result[i] = value
        return result

    def reduces_in_step(self) -> bool:
        return self.initialized

    def sum_in_step(self, tensors: Sequence[Any]) -> List[Any]:
        """One fused, autograd-aware allreduce (its backward sums the incoming gradients the
        same way). Tensors on the meta device (Keras's shape inference) pass unchanged."""
        import torch

        tensors = list(tensors)
        if any(t.device.type == "meta" for t in tensors):
            return tensors
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if compiled_step.tracing():  # inside the compiled step's trace: functional collectives
            total = compiled_step.sum_across_ranks().apply(flat)
        else:
            total = _sum_across_ranks().apply(flat)
        return [piece.view_as(t) for piece, t in
                zip(torch.split(total, [t.numel() for t in tensors]), tensors)]

    def watch(self, variables, options: reduction.GradientReduction) -> None:
        """Reduce `variables`' gradients bucket by bucket while backward runs (see module doc).

        ``MGPU_TORCH_OVERLAP=0`` turns this off (one fused allreduce in ``apply``), to measure
        what the overlap saves.
        """
        if self._watched is not None:
            self._watched.remove()
            self._watched = None
        if not settings.flag("MGPU_TORCH_OVERLAP"):
            return
        reducer = Reduction(self.size, options.average, options.prescale, options.postscale,
                            options.compression)
        self._watched = GradientBuckets(list(variables), reducer, self.fusion_bytes)

    def overlaps_backward(self) -> bool:
        return self._watched is not None  # buckets launched by hooks during backward

    def reduce_gradients(self, grads, variables, options: reduction.GradientReduction,
                         group=None) -> List[Any]:
        if compiled_step.tracing():  # inside the compiled step's trace: collectives as ops
            reducer = Reduction(self.size, options.average, options.prescale, options.postscale,
                                options.compression, self._torch_group(group, "reduce_gradients"))
            return compiled_step.reduce_in_graph(list(grads), list(variables), reducer,
                                                 self.fusion_bytes)
        watched = self._watched
        within_a_set = getattr(group, "process_set_id", 0)
        if watched is not None and not within_a_set and watched.covers(variables):
            return watched.finish(grads)
        return super().reduce_gradients(grads, variables, options, group=group)


_SUM_FUNCTION = []


def _sum_across_ranks():
    """A ``torch.autograd.Function``: sum across ranks forward, and backward (made once)."""
    if _SUM_FUNCTION:
        return _SUM_FUNCTION[0]
    import torch
    import torch.distributed as dist

    class SumAcrossRanks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, flat):
            total = flat.detach().clone()
            dist.all_reduce(total)
            return total

        @staticmethod
        def backward(ctx, gradient):
            total = gradient.detach().clone()
            dist.all_reduce(total)
            return total

    _SUM_FUNCTION.append(SumAcrossRanks)
    return SumAcrossRanks


def _specs(tensors) -> List[reduction.TensorSpec]:
    return [reduction.TensorSpec(str(t.dtype), t.numel(), t.element_size()) for t in tensors]


class Reduction:
    """How one flat buffer is reduced: scale, compress, sum across ranks, undo (the factors
    and the buckets come from mgpu_launch.backends.reduction)."""

    def __init__(self, size, average, prescale, postscale, compression, group=None):
        self.prescale, self.scale = reduction.scales(average, size, prescale, postscale)
        self.compression = compression
        self.group = group  # a torch.distributed group (a process set's), None: every rank

    def launch(self, tensors, like):
        import torch
        import torch.distributed as dist

        flat = torch.cat([(t if t is not None else torch.zeros_like(r)).reshape(-1)
                          for t, r in zip(tensors, like)])
        if self.prescale != 1.0:
            flat.mul_(self.prescale)
        wire = self.compression.compress(flat) if self.compression else flat
        return wire, dist.all_reduce(wire, group=self.group, async_op=True)

    def finish(self, wire, work, like, bucket: reduction.Bucket) -> List[Any]:
        """The bucket's results, shaped like `like` (its tensors, in bucket order)."""
        work.wait()
        flat = self.compression.decompress(wire, like[0].dtype) if self.compression else wire
        if self.scale != 1.0:
            flat = flat * self.scale
        return [flat[offset:offset + size].view_as(reference)
                for reference, offset, size in zip(like, bucket.offsets, bucket.sizes)]


class GradientBuckets:
    """Per-parameter hooks that launch each bucket's allreduce as soon as it is complete."""

    def __init__(self, variables, reducer: Reduction, fusion_bytes: int):
        self.variables, self.reducer = variables, reducer
        self.params = [v.value for v in variables]
        self.ids = [id(v) for v in variables]
        # backward produces the last gradients first: fill buckets from the end
        self.buckets = reduction.plan(_specs(self.params), fusion_bytes, backward=True)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                        for i, p in enumerate(self.params)]
        self._reset()

    def _reset(self):
        self.arrived = [0] * len(self.buckets)
        self.launched: List[Any] = [None] * len(self.buckets)
        self.next_bucket = 0

    def _hook(self, index):
        def on_gradient(param):
            bucket = self.bucket_of[index]
            self.arrived[bucket] += 1
            while (self.next_bucket < len(self.buckets) and self.arrived[self.next_bucket]
                   == len(self.buckets[self.next_bucket].indices)):
                self._launch(self.next_bucket, lambda i: self.params[i].grad)
        return on_gradient

    def _launch(self, bucket, gradient_of):
        """Start bucket `bucket`'s allreduce; `gradient_of(i)` is parameter i's gradient."""
        indices = self.buckets[bucket].indices
        self.launched[bucket] = self.reducer.launch([gradient_of(i) for i in indices],
                                                    [self.params[i] for i in indices])
        self.next_bucket += 1

    def covers(self, variables) -> bool:
        return [id(v) for v in variables] == self.ids

    def finish(self, grads) -> List[Any]:
        """Launch what backward left, from `grads` (missing gradients as zeros), wait, return
        the results. `grads`, not ``.grad``: Keras >= 3.16's jit_compile=True step computes the
        gradients with torch.autograd.grad, which fills no ``.grad`` and runs no hook."""
        grads = list(grads)
        while self.next_bucket < len(self.buckets):
            self._launch(self.next_bucket, grads.__getitem__)
        result: List[Any] = [None] * len(self.params)
        for position, bucket in enumerate(self.buckets):
            wire, work = self.launched[position]
            like = [self.params[i] for i in bucket.indices]
            for i, value in zip(bucket.indices, self.reducer.finish(wire, work, like, bucket)):
                result[i] = value
        self._reset()
        return result

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _to_device():
    """The prefetch thread's copy: CPU tensors to pinned memory, then to the GPU on a side
    stream, finished before the batch reaches the step. On CPU the thread only works ahead."""
    import torch
    from keras import tree
    from mgpu_launch.keras_internals import torch_device as get_device

    device = torch.device(get_device())
    if device.type != "cuda":
        return lambda batch: batch
    side = torch.cuda.Stream(device)
    consumer = torch.cuda.current_stream(device)  # where Keras's step runs

    def move(x):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            return x.pin_memory().to(device, non_blocking=True)
        return x

    def put(batch):
        with torch.cuda.stream(side):
            moved = tree.map_structure(move, batch)
        side.synchronize()
        for x in tree.flatten(moved):
            if isinstance(x, torch.Tensor) and x.is_cuda:
                x.record_stream(consumer)  # the allocator must not reuse it under the step
        return moved

    return put
