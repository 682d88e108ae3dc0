"""Implementations an engine may choose, each a named mixin for one concern's methods.

The interfaces of ``api.py`` have no defaults, so an engine that forgets a method fails at
construction (``TypeError`` from ``abc``). What several engines share is here, and an engine
names what it takes in its own class statement, before ``Engine``, for example::

    class JaxEngine(shared.KerasTrainStep, shared.DenseReduction, ..., Engine):

so that reading one engine's class line says which parts of it are its own. Each mixin
implements methods of one interface only (``GroupCheck`` and ``EveryRankOnly`` split
``ProcessSetSupport``: the check is shared by engines that do have process sets).
"""

from typing import Any, List, Sequence

from mgpu_launch import runtime
from mgpu_launch.backends.reduction import GradientReduction

__all__ = ["KerasFeeding", "KerasTrainStep", "HostBroadcast", "DenseReduction", "GroupCheck", "EveryRankOnly", "HasProcessSets", "GatherBySum", "DefaultReductionTiming", "CannotSkipAllreduce", "NoBuildInfo", "NoCommunicator"]


class KerasFeeding:
    """Feeding as Keras does it: no device prefetch source of its own (the
    prefetcher then keeps Keras's feeding), epochs may be read ahead."""

    def computes_on_accelerator(self) -> bool:
        """Whether the backend computes on a GPU (device prefetch is then on by default)."""
        return False

    def prefetch_source(self, epoch_iterator, keras_get_iterator):
        """The batches to copy to the device ahead of the step from a background thread
        (``mgpu_launch.training.prefetch.Prefetcher``), or None to keep Keras's own feeding.

        Args:
            epoch_iterator: Keras's epoch iterator of this backend.
            keras_get_iterator: its original ``_get_iterator`` (unbound).
        """
        return None

    def prefetch_transfer(self):
        """The copy the prefetch thread applies to each batch (called in that thread)."""
        return lambda batch: batch

    def runs_epochs_ahead(self) -> bool:
        """Whether the next epoch's batches may be begun while this one ends (torch: no)."""
        return True

    def runs_sharded_tf_data_ahead(self) -> bool:
        """No: Keras's TF epoch iterator makes two tf.data iterators an epoch (JAX: yes)."""
        return False


class KerasTrainStep:
    """The train step as Keras builds it: the engine neither replaces nor wraps
    it, every value is this process's, updates are ``keras.ops.cond``."""

    def owns_train_step(self) -> bool:
        """Whether :meth:`train_function` replaces Keras's train function (JAX: shard_map)."""
        return False

    def train_function(self, model):
        """Keras's one-step function for `model`, built by the engine (see owns_train_step)."""
        raise NotImplementedError

    def wrap_train_function(self, model, function, options):
        """Keras's train function for `model` as the engine runs it (torch: CUDA graphs).

        Called when Keras makes the function, for models with a DistributedOptimizer; the
        default returns `function` unchanged.
        """
        return function

    def localize(self, tree):
        """This process's part of every value in `tree` the engine's step returned."""
        return tree

    def tracing(self) -> bool:
        """Whether the backend is tracing a compiled function now (tensors without values):
        Horovod's value collectives then go through the engine (TensorFlow) or are refused."""
        return False

    def cond_update(self, predicate, update, variables) -> None:
        """Run ``update()`` (which assigns some of `variables`) only where `predicate` holds.

        Inside the compiled step. The default is ``keras.ops.cond``; a backend whose step is a
        pure function (JAX) overrides it.
        """
        from keras import ops
        ops.cond(predicate, update, lambda: None)

    def readable_on_host(self, variables) -> bool:
        """Whether the variables' values can be read now (False: only inside the step)."""
        return True

    def step_path(self, model):
        """Keras's own step: eager under ``run_eagerly``, else compiled when the engine builds
        the step (JAX's shard_map under ``jit``) or ``model.jit_compile`` holds, eager otherwise
        (Keras's JAX trainer jits only then); built at the first call, so always ready."""
        from mgpu_launch.backends.reduction import StepPath

        if model.run_eagerly:
            return StepPath("eager")
        return StepPath("compiled" if self.owns_train_step() or model.jit_compile else "eager")

    def step_advice(self, model, options) -> str:
        """A setting of this engine that makes `model`'s train step itself faster here, in a
        few words for the efficiency report's advice when the step dominates ("" when none)."""
        return ""


class HostBroadcast:
    """``broadcast_variables`` through the host collectives (MPI on numpy copies)."""

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int, group=None) -> None:
        """Assign rank `root_rank`'s values to `variables` (Keras variables) on every rank (of
        process set `group`, a ``runtime.process_sets.Group``; on the host, so every backend
        takes one)."""
        import numpy as np

        from mgpu_launch.runtime import collectives

        for variable in variables:
            value = np.asarray(variable.numpy())
            variable.assign(collectives.broadcast(value, root_rank=root_rank, process_set=group))


class DenseReduction:
    """The optimizer's reduction as one dense :meth:`allreduce` (no sparse
    gradients, nothing started during backward)."""

    def watch(self, variables, options: GradientReduction) -> None:
        """Called at the optimizer's build: a backend may start reducing these variables'
        gradients during backward (torch). The default waits for ``reduce_gradients``."""

    def reduce_gradients(self, grads, variables, options: GradientReduction,
                         group=None) -> List[Any]:
        """The optimizer's reduction: missing gradients as zeros, sparse ones dense, then
        :meth:`allreduce` with `options` (or what :meth:`watch` already started). A backend
        with sparse gradients (TensorFlow) gathers them instead unless
        ``options.sparse_as_dense``. `group`: as in :meth:`allreduce`."""
        from keras import ops
        self.check_group(group, "reduce_gradients")
        dense = [ops.zeros_like(v) if g is None else self.densify(g)
                 for g, v in zip(grads, variables)]
        within = {} if group is None else {"group": group}
        return self.allreduce(dense, **options.allreduce_options(), **within)

    def densify(self, gradient):
        """A sparse gradient (e.g. TF IndexedSlices) as a dense tensor; others unchanged."""
        return gradient

    def is_sparse(self, value) -> bool:
        """Whether `value` is a sparse gradient of this backend (TensorFlow's IndexedSlices)."""
        return False


class GroupCheck:
    """The refusal of a process set's group by an engine without process sets."""

    def check_group(self, group, what: str) -> None:
        """Raise unless `group` is None, the global set, or this engine takes process sets.

        Raises:
            ValueError: the engine reduces over every rank only; the message says why.
        """
        if group is not None and group.process_set_id and not self.supports_process_sets():
            raise ValueError(
                f"{what}: the {self.name} engine cannot reduce within process set "
                f"{group.process_set_id} ({self.process_sets_reason()}). Reduce over every "
                f"rank (process_set=None), use the host collectives, or the TensorFlow backend.")


class EveryRankOnly:
    """No process sets: the engine reduces over every rank only."""

    def supports_process_sets(self) -> bool:
        """Whether :meth:`allreduce` and :meth:`reduce_gradients` take a process set's group."""
        return False

    def process_sets_reason(self) -> str:
        """Why this engine has no process sets, for the refusal's message."""
        return "its collectives have no groups here"


class HasProcessSets:
    """Process sets: :meth:`allreduce` and :meth:`reduce_gradients` take a set's group."""

    def supports_process_sets(self) -> bool:
        return True

    def process_sets_reason(self) -> str:
        """Never asked (the engine has process sets)."""
        return ""


class GatherBySum:
    """``gather_in_step`` as one :meth:`sum_in_step` of a row placed among zeros;
    the sum can run wherever the caller is."""

    def reduces_in_step(self) -> bool:
        """Whether :meth:`sum_in_step` can run where the caller is now. JAX: only inside the
        engine's train step (a symbolic build of the model outside it gets False)."""
        return True

    def gather_in_step(self, tensor):
        """Every rank's `tensor` stacked along a new first axis (row r from rank r), inside the
        compiled step and differentiable, like :meth:`sum_in_step`.

        The default is one :meth:`sum_in_step` of `tensor` placed in this rank's row of zeros:
        adding zeros is exact, so every rank gets the same rows bit for bit.
        """
        import numpy as np
        from keras import backend, ops

        own_row = np.zeros((runtime.size(),) + (1,) * len(tensor.shape),
                           dtype=backend.standardize_dtype(tensor.dtype))
        own_row[runtime.rank()] = 1
        placed = ops.multiply(ops.expand_dims(tensor, 0), ops.convert_to_tensor(own_row))
        return self.sum_in_step([placed])[0]


class DefaultReductionTiming:
    """The efficiency report's timing through :meth:`reduce_gradients`, run
    eagerly, with no advice and no overlap with backward."""

    def time_gradient_reduction(self, variables, options: GradientReduction, *,
                                repeats: int = 5) -> float:
        """Seconds one reduction of `variables`' gradients takes alone, through the path the
        optimizer's step uses (this engine's transport, fusion and compression), on zeros.

        A collective: call it on every rank alike, outside the train step. Each rank first
        prepares the reduction on its own (builds, traces, compiles: no collective yet); the
        ranks then agree that all of them could, so a rank that fails there fails on every
        rank before any of them enters the reduction. Then one warm-up and `repeats` timed
        reductions; the median.

        Args:
            variables: the trainable variables the optimizer reduces (its build's list).
            repeats: timed reductions (>= 1).
            options: the optimizer's reduction (its ``options.reduction``).

        Returns:
            The median seconds of one reduction on this rank.

        Raises:
            RuntimeError: some rank could not prepare it (the message names the first one);
                raised on every rank alike.

        Example:
            >>> engine.time_gradient_reduction(model.trainable_variables, GradientReduction())
            0.0061
        """
        import statistics
        import time

        from mgpu_launch.runtime import agreement

        try:
            once, failure = self.gradient_reduction_runner(list(variables), options), ""
        except Exception as error:  # told to every rank below, raised on each
            once, failure = None, f"{type(error).__name__}: {error}"
        agreement.raise_any_rank(
            runtime.state.transport, failure, lambda rank, why: RuntimeError(
                f"rank {rank} could not prepare the gradient reduction's timing: {why}"))
        once()  # warm-up: the first run of a collective sets up its connections
        times = []
        for _ in range(max(1, int(repeats))):
            start = time.perf_counter()
            once()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def gradient_reduction_runner(self, variables, options: GradientReduction):
        """A function that runs one reduction of zero gradients for `variables` with the
        optimizer's `options` and returns once it has finished on this rank (for
        :meth:`time_gradient_reduction`; local: it may trace and compile, but run nothing
        collective). The default: :meth:`reduce_gradients` as :meth:`compile_reduction`
        makes it, reading one value of the result."""
        from keras import ops
        zeros = [ops.zeros(tuple(v.shape), dtype=v.dtype) for v in variables]

        def reduce_all(values):
            reduced = self.reduce_gradients(list(values), variables, options)
            return reduced, ops.reshape(reduced[-1], (-1,))[:1]
        run = self.compile_reduction(reduce_all, zeros)
        return lambda: ops.convert_to_numpy(run(zeros)[1])

    def compile_reduction(self, function, example):
        """`function` (zero gradients like `example` -> their reduction) as the step runs it;
        the default runs it eagerly (torch)."""
        return function

    def reduction_advice(self) -> str:
        """A setting of this engine that makes its gradient allreduce faster here, in a few
        words for the efficiency report's advice ("" when none)."""
        return ""

    def overlaps_backward(self) -> bool:
        """Whether the step's gradient reduction can run while the backward pass still
        computes (then part of its time is hidden, and the time it takes alone is an upper
        bound of what the step loses to it)."""
        return False


class CannotSkipAllreduce:
    """The gradient allreduce cannot be left out for profiling (torch: it overlaps the
    backward pass, which a step without it would not measure)."""

    def set_skip_allreduce(self, skip: bool) -> bool:
        return False


class NoBuildInfo:
    """Horovod's ``*_built()`` queries: the build claims no CUDA, ROCm or NCCL."""

    def build_info(self) -> dict:
        """What this build of the backend can use: {"cuda", "rocm", "nccl"} -> bool (Horovod's
        ``*_built()`` queries). The default claims none of them."""
        return {"cuda": False, "rocm": False, "nccl": False}


class NoCommunicator:
    """A backend without a communicator of its own: nothing to set up or tear down."""

    def setup(self, state) -> None:
        """Called by ``mgpu.init()`` on a multi-process job, before the model is built."""

    def shutdown(self) -> None:
        """Called by ``mgpu.shutdown()``."""
