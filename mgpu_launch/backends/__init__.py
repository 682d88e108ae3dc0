"""One engine per Keras backend: the collectives that run inside the compiled train step.

The rest of mgpu_launch (optimizer, callbacks) is backend-agnostic Keras code; everything that
needs the backend's own collective machinery is an :class:`Engine` method. What an engine is
(one small interface per concern) is declared in ``engines/api.py``; :class:`Engine` here
implements those interfaces with defaults, and the dispatcher picks the backend's subclass
once, from ``keras.backend.backend()``, by :func:`get_engine`. Framework imports live only in
``engines/<backend>.py``. Adding a backend means adding a module and a line to ``ENGINES``.
"""

import importlib
from typing import Any, Dict, List, Optional, Sequence

from mgpu_launch import runtime
from mgpu_launch.backends import api
from mgpu_launch.backends.reduction import GradientReduction
from mgpu_launch.config import settings

#: backend name -> "module:Class"
ENGINES: Dict[str, str] = {
    "tensorflow": "mgpu_launch.backends.tensorflow.engine:TensorFlowEngine",
    "jax": "mgpu_launch.backends.jax.engine:JaxEngine",
    "torch": "mgpu_launch.backends.torch.engine:TorchEngine",
}


class UnknownBackend(ValueError):
    """The Keras backend has no engine (the message lists the supported ones)."""


class Engine(api.Lifecycle, api.Feeding, api.TrainStep, api.GradientReducer,
             api.ProcessSetSupport, api.InStepCollectives, api.ReductionTiming,
             api.HorovodQueries):
    """What every backend provides (every interface of ``engines/api.py`` but
    ``GraphCollectives``), with defaults. Methods are called on every rank, in the same order.

    ``broadcast_variables`` has a working host default (MPI on numpy copies); a backend
    overrides it when it has a better path.
    """

    name = ""

    def setup(self, state) -> None:
        """Called by ``mgpu.init()`` on a multi-process job, before the model is built."""

    def shutdown(self) -> None:
        """Called by ``mgpu.shutdown()``."""

    # -- feeding (the epoch-iterator patch in mgpu_launch.training.patches asks these) -------------
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

    # -- the train step -----------------------------------------------------------------------------
    def owns_train_step(self) -> bool:
        """Whether :meth:`train_function` replaces Keras's train function (JAX: shard_map)."""
        return False

    def train_function(self, model):
        """Keras's one-step function for `model`, built by the engine (see owns_train_step)."""
        raise NotImplementedError

    def wrap_train_function(self, model, function):
        """Keras's train function for `model` as the engine runs it (torch: CUDA graphs).

        Called when Keras makes the function, for models with a DistributedOptimizer; the
        default returns `function` unchanged.
        """
        return function

    def localize(self, tree):
        """This process's part of every value in `tree` the engine's step returned."""
        return tree

    def allreduce(self, tensors: Sequence[Any], *, average: bool, prescale: float = 1.0,
                  postscale: float = 1.0, compression=None, group=None) -> List[Any]:
        """Sum (or average) a list of tensors across ranks, inside the compiled step.

        Args:
            tensors: the backend's tensors (no None); shapes and dtypes equal on every rank.
            average: divide the sum by the number of ranks.
            prescale: multiply each tensor by this before the sum (Horovod's predivide).
            postscale: multiply each result by this after the sum (and the average).
            compression: a ``mgpu_launch.backends.compression`` codec for the wire, or None.
            group: None (every rank) or a process set's ``runtime.process_sets.Group``
                (only where :meth:`supports_process_sets`): its members reduce among
                themselves, an average divides by its size.

        Returns:
            The reduced tensors, in the same order, shapes and dtypes.
        """
        raise NotImplementedError

    # -- process sets (mgpu_launch.runtime.process_sets) -------------------------------------
    def supports_process_sets(self) -> bool:
        """Whether :meth:`allreduce` and :meth:`reduce_gradients` take a process set's group."""
        return False

    def process_sets_reason(self) -> str:
        """Why this engine has no process sets, for the refusal's message."""
        return "its collectives have no groups here"

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

    # -- small differentiable collectives in the forward pass (synchronized BatchNorm) -----------
    def reduces_in_step(self) -> bool:
        """Whether :meth:`sum_in_step` can run where the caller is now. JAX: only inside the
        engine's train step (a symbolic build of the model outside it gets False)."""
        return True

    def sum_in_step(self, tensors: Sequence[Any]) -> List[Any]:
        """Sum a few small tensors across ranks inside the compiled step, differentiably.

        Unlike :meth:`allreduce` (gradients, after the backward pass), this runs in the forward
        pass and the backward pass goes through it: the gradient of a sum across ranks is the
        sum across ranks of the incoming gradients, so each rank gets the exact gradient of
        the sum of every rank's loss.

        Args:
            tensors: the backend's tensors; shapes and dtypes equal on every rank.

        Returns:
            The sums, in the same order, shapes and dtypes.
        """
        raise NotImplementedError

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

    # -- what the gradient reduction costs alone (the efficiency report) -----------------------
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

    def densify(self, gradient):
        """A sparse gradient (e.g. TF IndexedSlices) as a dense tensor; others unchanged."""
        return gradient

    def build_info(self) -> dict:
        """What this build of the backend can use: {"cuda", "rocm", "nccl"} -> bool (Horovod's
        ``*_built()`` queries). The default claims none of them."""
        return {"cuda": False, "rocm": False, "nccl": False}

    def is_sparse(self, value) -> bool:
        """Whether `value` is a sparse gradient of this backend (TensorFlow's IndexedSlices)."""
        return False

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

    def step_advice(self, model) -> str:
        """A setting of this engine that makes `model`'s train step itself faster here, in a
        few words for the efficiency report's advice when the step dominates ("" when none)."""
        return ""

    def readable_on_host(self, variables) -> bool:
        """Whether the variables' values can be read now (False: only inside the step)."""
        return True

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int, group=None) -> None:
        """Assign rank `root_rank`'s values to `variables` (Keras variables) on every rank (of
        process set `group`, a ``runtime.process_sets.Group``; on the host, so every backend
        takes one)."""
        import numpy as np

        from mgpu_launch.runtime import collectives

        for variable in variables:
            value = np.asarray(variable.numpy())
            variable.assign(collectives.broadcast(value, root_rank=root_rank, process_set=group))


_engine: Optional[Engine] = None


def get_engine(backend: Optional[str] = None) -> Engine:
    """The engine for `backend` (default: Keras's current backend), created once.

    Raises:
        UnknownBackend: the backend has no engine; the message lists the supported ones.
        mgpu_launch.config.settings.SettingError: an ``MGPU_*`` variable the engine reads is bad.
    """
    global _engine
    if backend is None:
        import keras
        backend = keras.backend.backend()
    if _engine is not None and _engine.name == backend:
        return _engine
    if backend not in ENGINES:
        raise UnknownBackend(
            f"mgpu_launch has no engine for the Keras backend {backend!r}; supported: "
            f"{', '.join(sorted(ENGINES))}. Set KERAS_BACKEND to one of them.")
    module_name, class_name = ENGINES[backend].split(":")
    _engine = getattr(importlib.import_module(module_name), class_name)()
    return _engine


def graph_collectives(what: str) -> api.GraphCollectives:
    """The backend's engine, as the in-graph collectives beyond the sum (TensorFlow's).

    Args:
        what: the caller, for the message.

    Raises:
        ValueError: the backend's engine has none; the message names the backend and the fix.
    """
    engine = get_engine()
    if not isinstance(engine, api.GraphCollectives):
        raise ValueError(f"{what} needs in-graph allgather / broadcast / reduce, which only the "
                         f"TensorFlow engine has; the Keras backend is {engine.name!r}. Set "
                         f"KERAS_BACKEND=tensorflow, or use the host collectives "
                         f"(mgpu.allgather, mgpu.broadcast, mgpu.allreduce).")
    return engine


def get_engine_or_default(backend: Optional[str] = None) -> Engine:
    """The backend's engine, or the base Engine's defaults for a backend without one.

    Only a backend without an engine falls back: an engine that cannot be made (a bad
    ``MGPU_FUSION_MB``, ...) raises, as :func:`get_engine` does.
    """
    try:
        return get_engine(backend)
    except UnknownBackend:
        return Engine()


def reset() -> None:
    """Forget the engine (after shutdown)."""
    global _engine
    if _engine is not None:
        _engine.shutdown()
    _engine = None
