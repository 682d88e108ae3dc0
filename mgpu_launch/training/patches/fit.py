"""The replacements of how ``fit`` runs: its checks, the epoch iterators, the train functions.

Private to :mod:`mgpu_launch.training.patches`, which holds the registry (which Keras attribute
each factory here replaces, checked before it is installed) and the table of why. Each factory
takes Keras's original attribute and returns the replacement; none is installed from here.
Also the state those replacements read: the ``DistributedOptimizer`` class whose models they
act on (:func:`set_distributed_class`) and the position the next epoch resumes at
(:func:`set_resume`).
"""

import functools
import inspect
import weakref
from typing import Callable, Optional, Tuple

from mgpu_launch import backends, keras_internals, runtime
from mgpu_launch.training import efficiency_report, epoch_resume, fit_guard, prefetch, stall_probes

_distributed_class: Optional[type] = None
# (epochs done, batches done in the next epoch) for the next training epoch to start from.
_resume: Optional[Tuple[int, int]] = None
# The epochs of the fit starting now, for the first epoch iterator it asks for batches: the
# training data's (validation's iterator comes later), whose feed may then run ahead (see
# epoch_iterator). Taken by that first request; cleared when fit returns.
_fit_epochs: Optional[int] = None


def set_distributed_class(distributed_class: type) -> None:
    """Make the patches act on models compiled with `distributed_class` (patches.install)."""
    global _distributed_class
    _distributed_class = distributed_class


def set_resume(at: Optional[Tuple[int, int]]) -> None:
    """Start the next training epoch at `at`, (epochs done, batches done); None: at its start."""
    global _resume
    _resume = at


def is_distributed(optimizer) -> bool:
    """Whether `optimizer` is a DistributedOptimizer (False before any was made)."""
    return _distributed_class is not None and isinstance(optimizer, _distributed_class)


def uses_distributed_optimizer(model) -> bool:
    """Whether `model` was compiled with a DistributedOptimizer (also under a LossScaleOptimizer)."""
    optimizer = getattr(model, "optimizer", None)
    return is_distributed(optimizer) or is_distributed(getattr(optimizer, "inner_optimizer", None))


def fit(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        ours = uses_distributed_optimizer(self)
        guarded = ours and runtime.is_multi_process()
        probed = ours and stall_probes.wanted()
        reported = ours and efficiency_report.wanted()
        bound = signature.bind(self, *args, **kwargs)
        global _fit_epochs
        _fit_epochs = (bound.arguments.get("epochs", 1)
                       - bound.arguments.get("initial_epoch", 0))
        try:
            return _fit(self, bound, args, kwargs, guarded, probed, reported)
        finally:
            _fit_epochs = None

    def _fit(self, bound, args, kwargs, guarded, probed, reported):
        ordered = epoch_resume.keeps_its_order(bound.arguments.get("x"), bound.arguments)
        if not (guarded or probed or ordered):
            return original(self, *args, **kwargs)
        bound.apply_defaults()
        if ordered:  # shard() shuffles replayably; fit's shuffle could not be replayed
            bound.arguments["shuffle"] = False
        if guarded:
            fit_guard.add_agreement_check(bound.arguments)
        if reported:  # before the probes: the last probe stays last
            efficiency_report.add_report(bound.arguments)
        if probed:
            stall_probes.add_probes(bound.arguments)
        with epoch_resume.training_on(bound.arguments["x"]):
            return original(*bound.args, **bound.kwargs)
    return fit


def epoch_iterator(original):
    # Each epoch asks the engine for the batches to prefetch; None (or depth 0) keeps Keras's.
    # One EpochFeed per Keras epoch iterator: one thread for all its epochs, which begins the
    # next epoch's batches while this one ends where that gives Keras's batches exactly.
    def _get_iterator(self):
        global _fit_epochs
        epochs, _fit_epochs = _fit_epochs, None  # only the fit's first iterator is its training's
        feed = self.__dict__.get("_mgpu_feed")
        if feed is not None and feed.runs_ahead:
            return feed.next_pass()  # its thread makes the pass's batches (maybe already has)
        engine = backends.get_engine_or_default()
        depth = prefetch.prefetch_depth(engine.computes_on_accelerator())
        batches = engine.prefetch_source(self, original) if depth else None
        if batches is None:
            return original(self)
        if feed is None:
            self._mgpu_feed = feed = _feed(self, original, engine, depth, epochs)
        # made here, when Keras makes its own (a torch DataLoader draws its seed as it starts)
        return feed.next_pass(iter(batches))
    return _get_iterator


def _feed(epoch_iterator, original, engine, depth: int, epochs: Optional[int]):
    """A new EpochFeed for `epoch_iterator`; `epochs`: the fit's, when this is its training
    iterator (None: not, or unknown)."""
    per_epoch = epoch_iterator.num_batches
    planned = epochs * per_epoch if epochs and per_epoch else None
    run_ahead = (planned is not None and engine.runs_epochs_ahead()
                 and keras_internals.next_epoch_is_known_early(epoch_iterator.data_adapter))
    # a weak reference: the thread must not keep the epoch iterator (and so the feed) alive
    owner = weakref.ref(epoch_iterator)

    def make_source(number):
        epoch_iterator = owner()
        if epoch_iterator is None:
            return ()
        source = engine.prefetch_source(epoch_iterator, original)
        return () if source is None else source
    return prefetch.EpochFeed(make_source, engine.prefetch_transfer(), depth,
                              run_ahead=run_ahead, planned_batches=planned)


def jax_train_function(original):
    def make_train_function(self, force=False):
        engine = backends.get_engine()
        if not (uses_distributed_optimizer(self) and engine.owns_train_step()):
            return original(self, force)
        if self.train_function is not None and not force:
            return
        self.train_function = self._make_function(engine.train_function(self))
    return make_train_function


def jax_state_sync(original):
    def jax_state_sync(self):
        if getattr(self, "_jax_state", None) and not self._jax_state_synced:
            # Keras keeps these as TrackedLists, which jax.tree treats as leaves.
            localize = backends.get_engine().localize
            self._jax_state = {key: [localize(v) for v in values]
                               for key, values in self._jax_state.items()}
        original(self)
    return jax_state_sync


def owns_torch_process_group() -> bool:
    """Whether mgpu.init() started this process's torch.distributed (TorchEngine.setup refuses
    one started before it): then Keras's own collectives (DDP, metric sums) are not ours to run."""
    return runtime.is_multi_process() and backends.get_engine().reduces_in_step()


def torch_ddp(original):
    # Keras >= 3.16 wraps every model in DDP once torch.distributed is up. A DistributedOptimizer
    # model: mgpu reduces its gradients already. Any other model (a reference trained on one
    # rank, a rank-0 evaluation): it is local, and DDP's constructor is a collective the other
    # ranks never join (a deadlock).
    def _initialize_ddp(self):
        if uses_distributed_optimizer(self) or owns_torch_process_group():
            return
        original(self)
    return _initialize_ddp


def torch_metrics(original, base):
    # Keras >= 3.16 all-reduces every metric variable in get_metrics_result (each train and
    # test step): extra blocking collectives per step, and a hang when one rank alone runs
    # fit/evaluate. Under mgpu metrics stay per rank (MetricAverageCallback averages them).
    def get_metrics_result(self):
        if owns_torch_process_group():
            return base(self)
        return original(self)
    return get_metrics_result


def tf_auto_jit(original):
    # Keras resolves "auto" to XLA on any machine with a GPU; a step whose collectives XLA
    # cannot compile (the host ring) would then fail at its first trace.
    def _resolve_auto_jit_compile(self):
        if (uses_distributed_optimizer(self) and runtime.is_multi_process()
                and not backends.graph_collectives("jit_compile='auto'").compiles_collectives()):
            return False
        return original(self)
    return _resolve_auto_jit_compile


def torch_auto_jit(original, default_on: Callable[[], bool]):
    # Keras resolves "auto" to eager on torch. A DistributedOptimizer model gets mgpu's compiled
    # step instead where `default_on` says so (MGPU_TORCH_COMPILE; on by default on a GPU);
    # compile(jit_compile=False) still means eager, jit_compile=True compiled.
    def _resolve_auto_jit_compile(self):
        if uses_distributed_optimizer(self):
            return default_on()
        return original(self)
    return _resolve_auto_jit_compile


def torch_keras_compile(original):
    # Keras's jit_compile=True on torch is torch.compile of its step functions: dynamo traces
    # Keras's Python, hits the recompile limit and falls back (docs/torch-compile.md). For a
    # DistributedOptimizer model the train step is mgpu's compiled one (the engine wraps it);
    # evaluate and predict stay eager, as with jit_compile=False.
    def _should_torch_compile(self):
        if uses_distributed_optimizer(self):
            return False
        return original(self)
    return _should_torch_compile


def torch_train_function(original, on_capture: Callable[[], None]):
    # on_capture installs the patches a captured step needs (patches.FOR_CUDA_GRAPHS);
    # passed in, so this module need not import the registry, which imports it.
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        original(self, force)
        if uses_distributed_optimizer(self):
            wrapped = backends.get_engine().wrap_train_function(self, self.train_function)
            if wrapped is not self.train_function:  # capture asked for
                on_capture()
            self.train_function = wrapped
        return self.train_function
    return make_train_function


def torch_sgd_update(original):
    # Keras passes the rate as alpha= of _foreach_add_, a host read (.item()) every step,
    # which a CUDA graph cannot contain. The same update with the rate as a device tensor:
    # v <- m*v - lr*g; w <- w + v (nesterov: w <- w - lr*g + m*v). Only where the engine's
    # graph step set the optimizer's flag; the result may differ from Keras's in the last bit
    # (lr*g is rounded before the add instead of fused into it).
    def _parallel_update_step(self, grads, variables, learning_rate):
        if not getattr(self, "_mgpu_device_learning_rate", False):
            return original(self, grads, variables, learning_rate)
        import torch

        rate = getattr(learning_rate, "value", learning_rate)
        step = torch._foreach_mul(list(grads), -rate)
        params = [v.value for v in variables]
        if self.momentum == 0:
            torch._foreach_add_(params, step)
            return
        velocities = [self.momentums[self._get_variable_index(v)].value for v in variables]
        torch._foreach_mul_(velocities, self.momentum)
        torch._foreach_add_(velocities, step)
        if self.nesterov:
            torch._foreach_add_(params, step)
            torch._foreach_add_(params, velocities, alpha=self.momentum)
        else:
            torch._foreach_add_(params, velocities)
    return _parallel_update_step


def torch_scalars(original):
    # Keras makes a tensor of every Python number or shape tuple an op meets
    # (torch.as_tensor(x, device=...)): a CPU tensor and a synchronous copy, which a CUDA graph
    # cannot contain. While the engine warms up or captures a step, fill kernels make the same
    # small constant on the device instead (same dtype rule as Keras's); at any other time,
    # and for anything larger, Keras's own conversion runs.
    from mgpu_launch.backends.torch import graph as torch_graph

    def convert_to_tensor(x, dtype=None, sparse=None, ragged=None):
        if torch_graph.scalars_on_device() and not (sparse or ragged):
            made = torch_graph.device_constant(x, dtype)
            if made is not None:
                return made
        return original(x, dtype=dtype, sparse=sparse, ragged=ragged)
    return convert_to_tensor


def resume_iterator(original):
    def _enumerate_iterator(self):
        global _resume
        if _resume is None:
            yield from original(self)
            return
        (epochs, skip), _resume = _resume, None
        yield from epoch_resume.resumed_epoch(self, original, epochs, skip)
    return _enumerate_iterator
