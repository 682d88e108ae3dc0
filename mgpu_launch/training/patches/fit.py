"""The replacements of how ``fit`` runs that every backend shares: its checks, the epoch
iterators' prefetching feed, resuming.

Private to :mod:`mgpu_launch.training.patches`, which holds the registry (which Keras attribute
each factory here replaces, checked before it is installed) and the table of why; the epoch
iterator's factory is also handed to the backends' patch sets (``keras_patching.Hooks``),
since each backend has its own epoch iterator class. Each factory takes Keras's original
attribute and returns the replacement; none is installed from here. Also the state those
replacements read: the position the next epoch resumes at (:func:`set_resume`).
"""

import functools
import inspect
import weakref
from typing import Optional, Tuple

from mgpu_launch import backends, keras_internals, runtime
from mgpu_launch.training import (efficiency_report, epoch_resume, fit_guard, optimizer_options,
                                  prefetch, sharded, stall_probes)

# (epochs done, batches done in the next epoch) for the next training epoch to start from.
_resume: Optional[Tuple[int, int]] = None
# The epochs of the fit starting now, for the first epoch iterator it asks for batches: the
# training data's (validation's iterator comes later), whose feed may then run ahead (see
# epoch_iterator). Taken by that first request; cleared when fit returns.
_fit_epochs: Optional[int] = None


def set_resume(at: Optional[Tuple[int, int]]) -> None:
    """Start the next training epoch at `at`, (epochs done, batches done); None: at its start."""
    global _resume
    _resume = at


def uses_distributed_optimizer(model) -> bool:
    """Whether `model` was compiled with a DistributedOptimizer (also under a LossScaleOptimizer),
    recognised by its options (``optimizer_options.distributed_optimizer``)."""
    return optimizer_options.distributed_optimizer(model) is not None


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
    iterator (None: not, or unknown).

    A ``tf.data`` that ``mgpu.data.shard`` made runs ahead where the engine says so (JAX). Its order for an epoch
    is decided inside tf.data, by how many iterators of it were made before (each draws the
    next reshuffle seed). On JAX, Keras's iterator of it is a generator that makes its tf.data
    iterator when first read, one an epoch, as the feed's passes do. On TensorFlow, Keras
    makes two an epoch (one at its start, one it never reads at its end), which the feed
    without run-ahead repeats, as it is asked; run ahead, it would make one and leave Keras's
    order (``tests/training/test_epoch_feed.py``).
    """
    per_epoch = epoch_iterator.num_batches
    planned = epochs * per_epoch if epochs and per_epoch else None
    adapter = epoch_iterator.data_adapter
    run_ahead = (planned is not None and engine.runs_epochs_ahead()
                 and (keras_internals.next_epoch_is_known_early(adapter)
                      or (engine.runs_sharded_tf_data_ahead() and sharded.is_sharded_tf_dataset(
                          keras_internals.tf_dataset_of(adapter)))))
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


def resume_iterator(original):
    def _enumerate_iterator(self):
        global _resume
        if _resume is None:
            yield from original(self)
            return
        (epochs, skip), _resume = _resume, None
        yield from epoch_resume.resumed_epoch(self, original, epochs, skip)
    return _enumerate_iterator
