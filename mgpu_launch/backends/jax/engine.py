"""JAX engine: one process per device, gradients averaged by ``psum`` inside the jitted step.

Route chosen (docs/backends.md, "JAX backend"): Keras's train step runs under ``jax.shard_map`` over a
one-axis mesh of every process's device. Each device computes the loss, gradients and
BatchNorm statistics of its *own* local batch (Horovod's semantics); the DistributedOptimizer's
``psum`` is the only collective in the step (plus, per synchronized BatchNormalization, an
``all_gather`` forward and its transpose backward: :meth:`JaxEngine.gather_in_step`), and XLA
lowers it to NCCL on GPU (gloo on CPU).
The alternative, ``keras.distribution.DataParallel``, lets GSPMD compute the loss over the
global batch: that also makes BatchNorm statistics global (one small allreduce per BN layer,
forward and backward) and measured slower at 2 GPUs.

Plumbing, all zero-copy: at each step the process-local state and batch are viewed as global
arrays (``jax.make_array_from_single_device_arrays``: state "replicated", batch split along
axis 0 across processes); the step's outputs go back to Keras as they are, and become local
arrays again only when Keras writes them into its variables (``jax_state_sync``). For this
``mgpu_launch.training.patches`` replaces two methods of Keras's ``JAXTrainer`` —
``make_train_function`` (which then asks :meth:`JaxEngine.train_function`) and
``jax_state_sync`` (:meth:`JaxEngine.localize`) — for a model compiled with a
``DistributedOptimizer`` in a multi-process job. Evaluation and prediction stay local.

Set-up (``mgpu.init()``): rank 0 picks the coordinator address, MPI broadcasts it, and every
rank calls ``jax.distributed.initialize`` with its device given by ``local_device_ids`` (pinning
by CUDA_VISIBLE_DEVICES hung JAX's topology exchange on our GPU machine). This must happen
before JAX touches a device. ``MGPU_JAX_COORDINATOR`` (host:port) overrides the address and
``MGPU_JAX_INIT_TIMEOUT`` (seconds, default 60) bounds the wait for the other processes. The
coordinator binds that address's host, not every interface (``MGPU_BIND_ADDRESS`` overrides).
"""

from typing import Any, List, Sequence

import numpy as np

from mgpu_launch.backends import Engine, reduction, shared
from mgpu_launch.runtime import transport_jax
from mgpu_launch.runtime.rendezvous import bind_address, job_host_address, rendezvous
from mgpu_launch.config import settings

AXIS = "mgpu"


def _create_cpu_backend(host: str) -> None:
    """Create JAX's CPU backend with its gloo collectives bound to `host`.

    Left alone, gloo binds to this host's own name resolved, which Debian's /etc/hosts maps to
    127.0.1.1: ranks on other hosts then dial their own loopback and the first collective
    fails. JAX's backend factory passes no address, so the gloo factory it calls gets one here,
    only while the backend is created (the first device query).
    """
    import functools

    import jax
    from jax._src import xla_bridge

    module = xla_bridge._jax
    original = module.make_gloo_tcp_collectives
    module.make_gloo_tcp_collectives = functools.partial(original, hostname=host)
    try:
        jax.local_devices()
    finally:
        module.make_gloo_tcp_collectives = original


def _initialize(state, timeout: int, options) -> None:
    """jax.distributed on a coordinator rank 0 serves, at an address every rank reached."""
    import jax

    with rendezvous(state, "MGPU_JAX_COORDINATOR", timeout) as address:
        bound = bind_address(address, job_host_address(state))  # known: no collective
        try:
            # Left alone, JAX's coordination service (no authentication) binds [::]:port.
            jax.distributed.initialize(address, num_processes=state.size,
                                       process_id=state.rank, initialization_timeout=timeout,
                                       coordinator_bind_address=bound, **options)
        except Exception as error:  # jaxlib raises its own XlaRuntimeError types
            raise RuntimeError(
                f"rank {state.rank} could not join the JAX coordinator at {address} within "
                f"{timeout} s ({type(error).__name__}: {error}). Raise "
                f"MGPU_JAX_INIT_TIMEOUT if the processes start slowly.") from error


class JaxEngine(shared.KerasFeeding, shared.KerasTrainStep, shared.HostBroadcast,
                shared.DenseReduction, shared.EveryRankOnly, shared.GroupCheck,
                shared.DefaultReductionTiming, shared.NoBuildInfo, Engine):
    name = "jax"

    def __init__(self):
        self.size = 1
        self.mesh = self.device = None
        self._owns_distributed = False  # whether setup() initialized jax.distributed
        self._in_step = False
        self._checked_batches = set()
        #: bytes per fused allreduce buffer; 0: one psum of the list, fused by XLA's combiner
        self.fusion_bytes = int(settings.number("MGPU_FUSION_MB", fallback=64.0) * 2 ** 20)
        #: profiling only: gradients are NOT averaged (each rank keeps size x its own)
        self.skip_allreduce = settings.flag("MGPU_PROFILE_SKIP_ALLREDUCE")

    def set_skip_allreduce(self, skip: bool) -> bool:
        """Set :attr:`skip_allreduce` (the next compiled step follows it)."""
        self.skip_allreduce = bool(skip)
        return True

    # -- set-up -------------------------------------------------------------------------------
    def setup(self, state) -> None:
        import jax
        from jax._src import xla_bridge

        from mgpu_launch.config import devices

        if xla_bridge.backends_are_initialized():
            raise RuntimeError(
                "mgpu.init() must run before JAX uses any device (jax.distributed can only be "
                "initialized first), but JAX's backends are already up in this process. Call "
                "mgpu.init() at the top of the script, before building a model or creating "
                "any array (importing keras and jax before it is fine).")
        self.size = state.size
        timeout = int(settings.seconds("MGPU_JAX_INIT_TIMEOUT"))
        options = {}
        gloo_host = None
        if devices.visible_gpus():
            local = settings.integer("MGPU_LOCAL_DEVICE", fallback=state.local_rank)
            options["local_device_ids"] = [local]
        else:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            gloo_host = job_host_address(state)
        # started with JAX's variables, the transport has initialized jax.distributed already
        self._owns_distributed = not transport_jax.owns_jax_distributed(state.transport)
        if self._owns_distributed:
            _initialize(state, timeout, options)
        if gloo_host is not None:
            _create_cpu_backend(gloo_host)
        if len(jax.local_devices()) != 1:
            raise RuntimeError(
                f"rank {state.rank} sees {len(jax.local_devices())} JAX devices; mgpu_launch "
                f"runs one process per device. Start one process per GPU (mgpu-train -np N).")
        ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.mesh = jax.sharding.Mesh(np.array(ordered), (AXIS,))
        self.device = jax.local_devices()[0]

    # -- feeding --------------------------------------------------------------------------------
    def computes_on_accelerator(self) -> bool:
        import jax
        return jax.default_backend() != "cpu"

    def prefetch_source(self, epoch_iterator, keras_get_iterator):
        import keras
        if keras.distribution.distribution() is not None:
            return None  # keras.distribution lays batches out itself
        return epoch_iterator.data_adapter.get_jax_iterator()

    def runs_sharded_tf_data_ahead(self) -> bool:
        """Yes: Keras's JAX iterator of a tf.data makes one tf.data iterator an epoch, when
        first read, as the feed's passes do, so running ahead keeps Keras's order."""
        return True

    def prefetch_transfer(self):
        return _to_device()

    def shutdown(self) -> None:
        if self.mesh is not None:
            import jax
            if self._owns_distributed:  # else the transport's, which shutdown() ends after
                jax.distributed.shutdown()
            self.mesh = None

    # -- inside the step ------------------------------------------------------------------------
    def process_sets_reason(self) -> str:
        return ("every process runs one program, traced alike, over a mesh of every device "
                "(shard_map): a psum within a set would make the members' programs differ "
                "from the others'")

    def allreduce(self, tensors: Sequence[Any], *, average: bool, prescale: float = 1.0,
                  postscale: float = 1.0, compression=None, group=None) -> List[Any]:
        import jax
        import jax.numpy as jnp

        self.check_group(group, "allreduce")

        if not self._in_step:
            raise RuntimeError(
                "the JAX gradient allreduce runs only inside model.fit / train_on_batch of a "
                "model compiled with mgpu.DistributedOptimizer (the train step mgpu_launch "
                "builds). A custom training loop must call model.train_on_batch or "
                "optimizer.apply inside it.")
        prescale, scale = reduction.scales(average, self.size, prescale, postscale)
        wires = []
        for tensor in tensors:
            if prescale != 1.0:
                tensor = tensor * jnp.asarray(prescale, tensor.dtype)
            wires.append(compression.compress(tensor) if compression else tensor)
        if self.skip_allreduce:
            summed = [w * jnp.asarray(self.size, w.dtype) for w in wires]
        elif self.fusion_bytes <= 0:
            summed = jax.lax.psum(wires, AXIS)  # XLA's all-reduce combiner decides
        else:
            summed = self._fused_psum(wires)
        result = []
        for tensor, total in zip(tensors, summed):
            total = compression.decompress(total, tensor.dtype) if compression else total
            result.append(total * jnp.asarray(scale, total.dtype) if scale != 1.0 else total)
        return result

    def reduces_in_step(self) -> bool:
        return self._in_step

    def sum_in_step(self, tensors: Sequence[Any]) -> List[Any]:
        """``psum`` over the step's axis; JAX differentiates it (inside shard_map without
        replication checks, its transpose is a psum of the incoming gradients)."""
        import jax
        self._require_step("a synchronized BatchNormalization's statistics")
        return list(jax.lax.psum(list(tensors), AXIS))

    def gather_in_step(self, tensor):
        """``all_gather`` over the step's axis (differentiable: its transpose is a
        ``psum_scatter``): no rank constant in the program, which every process must trace
        alike."""
        import jax
        self._require_step("a synchronized BatchNormalization's statistics")
        return jax.lax.all_gather(tensor, AXIS)

    def _require_step(self, what: str) -> None:
        if not self._in_step:
            raise RuntimeError(
                f"on JAX, {what} can be reduced across processes only inside model.fit / "
                f"train_on_batch of a model compiled with mgpu.DistributedOptimizer (the train "
                f"step mgpu_launch builds).")

    def _fused_psum(self, tensors):
        """psum of flat buffers of about ``fusion_bytes`` each (Horovod's tensor fusion).

        The buckets are mgpu_launch.backends.reduction's plan of the wire tensors (already
        compressed): filled from the last tensor to the first (the order backprop produces
        gradients), one dtype at a time; each bucket is one collective.
        """
        import jax
        import jax.numpy as jnp

        specs = [reduction.TensorSpec(str(t.dtype), t.size, t.dtype.itemsize) for t in tensors]
        result: List[Any] = [None] * len(tensors)
        for bucket in reduction.plan(specs, self.fusion_bytes, backward=True):
            flat = jnp.concatenate([jnp.ravel(tensors[i]) for i in bucket.indices])
            total = jax.lax.psum(flat, AXIS)
            for i, offset, size in zip(bucket.indices, bucket.offsets, bucket.sizes):
                result[i] = total[offset:offset + size].reshape(tensors[i].shape)
        return result

    def gradient_reduction_runner(self, variables, options: reduction.GradientReduction):
        """The reduction under shard_map and jit, as in the step (psum, the same fusion and
        compression), on replicated zeros; compiled here, each run waits for its result."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        def reduce_all(values):
            return self.reduce_gradients(list(values), variables, options)
        mapped = jax.shard_map(reduce_all, mesh=self.mesh, in_specs=(PartitionSpec(),),
                               out_specs=PartitionSpec(), check_vma=False)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        zeros = [jax.make_array_from_single_device_arrays(
            tuple(v.shape), replicated, [jax.device_put(jnp.zeros(v.shape, v.dtype), self.device)])
            for v in variables]
        self._in_step = True  # allreduce refuses to trace outside the step
        try:
            compiled = jax.jit(mapped).lower(zeros).compile()
        finally:
            self._in_step = False
        return lambda: jax.block_until_ready(compiled(zeros))

    def overlaps_backward(self) -> bool:
        return self.computes_on_accelerator()  # XLA's GPU scheduler may start it early

    def cond_update(self, predicate, update, variables) -> None:
        """``update()`` when `predicate`, else nothing, for code run in Keras's stateless step.

        ``update`` assigns some of `variables` (all it reads or writes must be among them);
        it is traced once as a pure function of their values inside ``jax.lax.cond``.
        """
        import jax
        from keras import StatelessScope

        variables = list(variables)

        def run(values):
            with StatelessScope(state_mapping=list(zip(variables, values))) as scope:
                update()
            return [scope.get_current_value(v) for v in variables]

        new = jax.lax.cond(predicate, run, lambda values: list(values),
                           [v.value for v in variables])
        for variable, value in zip(variables, new):
            variable.assign(value)

    # -- the distributed train function ------------------------------------------------------------
    def keras_patches(self, hooks):
        """The jax patch set (``backends/jax/patches.py``)."""
        from mgpu_launch.backends.jax import patches
        return patches.patch_set(hooks)

    def owns_train_step(self) -> bool:
        return self.mesh is not None  # set up for a multi-process job

    def localize(self, tree):
        return localize(tree)

    def train_function(self, model):
        """``(state, batch) -> (logs, state)`` for Keras's fit loop, the step under shard_map."""
        import jax
        from jax.sharding import PartitionSpec

        mapped = jax.shard_map(model.train_step, mesh=self.mesh,
                               in_specs=(PartitionSpec(), PartitionSpec(AXIS)),
                               out_specs=(PartitionSpec(), PartitionSpec()), check_vma=False)
        compiled = jax.jit(mapped, donate_argnums=0)
        replicated = jax.sharding.NamedSharding(self.mesh, PartitionSpec())
        split = jax.sharding.NamedSharding(self.mesh, PartitionSpec(AXIS))
        produced = []  # the state this function returned last: already global
        # The logs of the steps dispatched last, oldest first. Dispatch is asynchronous and
        # unbounded: on CPU rank 0 had queued 23 steps in 0.3 s that took 10 s to run, so the
        # host's step phases (stall inspector, timeline, efficiency report) said nothing of the
        # steps. At most two in flight: the host keeps pace with the device, which still has
        # the next step queued while the host dispatches (no idle device).
        in_flight = []

        def as_global(value, sharding, shape):
            if not isinstance(value, jax.Array) or value.devices() != {self.device}:
                value = jax.device_put(value, self.device)
            return jax.make_array_from_single_device_arrays(shape, sharding, [value])

        def step(state, batch):
            if not (produced and state is produced[0]):
                state = jax.tree.map(lambda v: as_global(v, replicated, np.shape(v)), state)
            self._check_batch(batch)
            if len(in_flight) == 2:
                jax.block_until_ready(in_flight.pop(0))
            batch = jax.tree.map(
                lambda v: as_global(v, split, (self.size * v.shape[0],) + tuple(v.shape[1:])),
                batch)
            self._in_step = True
            try:
                logs, state = compiled(state, batch)
            finally:
                self._in_step = False
            produced[:] = [state]
            in_flight.append(logs)
            return localize(logs), state

        return step

    def _check_batch(self, batch) -> None:
        """Once per batch structure: every rank must feed the same shapes (else XLA hangs)."""
        import jax

        from mgpu_launch.runtime import collectives

        signature = (jax.tree.structure(batch),
                     tuple((np.shape(v), str(v.dtype)) for v in jax.tree.leaves(batch)))
        if signature in self._checked_batches:
            return
        everyone = collectives.allgather_object(str(signature))
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise collectives.MismatchError(
                    f"ranks feed different batches to the train step: rank {rank} has "
                    f"{theirs}, rank 0 has {everyone[0]}. Every rank needs the same batch "
                    f"size and number of steps (shard the data into equal parts).")
        self._checked_batches.add(signature)


def localize(tree):
    """This process's copy of every global array in `tree` (other leaves unchanged)."""
    import jax

    def local(value):
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            return value.addressable_data(0)
        return value
    return jax.tree.map(local, tree)


def _to_device():
    """The prefetch thread's copy: Keras's ``jax.device_put``, to the device this thread sees
    as the default, finished before the batch is handed to the step."""
    import jax
    from keras import tree

    target = jax.config.jax_default_device  # a thread-local setting: read it here

    def put(batch):
        moved = tree.map_structure(
            lambda x: None if x is None else jax.device_put(x, target), batch)
        return jax.block_until_ready(moved)

    return put
