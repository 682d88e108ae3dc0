"""The efficiency report's callback: records a fit, times its gradient allreduce alone at the
end, and prints the report on rank 0 (the analysis and the words: ``efficiency``).

Added by the ``fit`` patch (``mgpu_launch.training.patches``) on every rank alike, for a model
compiled with a DistributedOptimizer, unless ``MGPU_EFFICIENCY_REPORT=0``. Its
``on_train_begin`` and ``on_train_end`` are collectives.

The allreduce timing (:func:`time_communication`) runs on every rank, decided from what every
rank has alike (the fewest train steps any rank recorded in this fit, agreed over MPI), never
from ``verbose``, which scripts often set on rank 0 only. It costs one warm-up and
:data:`REPEATS` reductions of the model's gradients, about six steps' allreduce, so a fit of
fewer than ``efficiency.TIMED_STEPS`` analysed steps skips it, as does a fit with the report
off. A failure there never ends the fit: the report says the share was not measured, and why.
"""

import statistics
import sys
from typing import Any, Dict, List, Optional

import keras
import numpy as np

from mgpu_launch import backends, runtime
from mgpu_launch.runtime import collectives, timeline
from mgpu_launch.training import sharded
from mgpu_launch.training.efficiency import TIMED_STEPS, analyse, render
from mgpu_launch.training import optimizer_options
from mgpu_launch.config import settings

#: timed reductions at the end of a fit (after one warm-up); the report takes their median
REPEATS = 5


def batch_size_of(arguments: Dict[str, Any]) -> Optional[int]:
    """Samples per step of a ``fit`` call (its bound arguments), where Keras's own rule gives
    it: arrays (``batch_size``, default 32) and a tf.data set with a static batch dimension."""
    data = arguments.get("x")
    if isinstance(data, keras.utils.PyDataset) or data is None:
        return None
    spec = getattr(data, "element_spec", None)
    if spec is not None:
        leaves = keras.tree.flatten(spec)
        dim = leaves[0].shape[0] if leaves and len(leaves[0].shape) else None
        return int(dim) if dim is not None else None
    leaves = keras.tree.flatten(data)
    if leaves and hasattr(leaves[0], "shape") and len(leaves[0].shape):
        return min(arguments.get("batch_size") or 32, int(leaves[0].shape[0]))
    return None


def add_report(arguments: Dict[str, Any]) -> None:
    """Append an :class:`EfficiencyReport` to the callbacks of a ``fit`` call (its bound
    arguments; called by the ``fit`` patch on every rank when ``MGPU_EFFICIENCY_REPORT`` is
    on), unless the caller passed one (to read its ``figures``: mgpu-bench does)."""
    callbacks = arguments.get("callbacks")
    listed = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) \
        else callbacks or []
    if any(isinstance(callback, EfficiencyReport) for callback in listed):
        return
    report = EfficiencyReport(batch_size_of(arguments), sharded.input_kind(arguments.get("x")))
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.append(report)
    else:
        arguments["callbacks"] = list(callbacks or []) + [report]


def wanted() -> bool:
    """``MGPU_EFFICIENCY_REPORT`` (default on), after ``mgpu.init()`` (a fit before it has no
    job to report on)."""
    return runtime.is_initialized() and settings.flag("MGPU_EFFICIENCY_REPORT")


def _nbytes(variable) -> int:
    dtype = keras.backend.standardize_dtype(variable.dtype)
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    return int(np.prod(variable.shape, dtype=np.int64)) * itemsize


def time_communication(model, own: List[tuple]) -> Optional[Dict[str, Any]]:
    """The gradient allreduce of `model`'s optimizer timed alone, for the report (on every
    rank; a collective in a job of several ranks).

    Args:
        model: the model being fit, compiled with a DistributedOptimizer.
        own: this rank's slices of the fit (``timeline.since``): its train steps are counted.

    Returns:
        None on one rank (no allreduce); else ``{"seconds": per step, "every": steps per
        reduction, "bytes": of the gradients, "overlaps", "engine", "compression", "hint":
        the engine's own advice}``, or
        ``{"note": why not}`` when the fit is too short, the gradients are reduced within a
        process set, or the timing failed. A failure ends nothing else: every rank goes on to
        the report. Where it can happen on one rank alone (building or tracing the
        reduction), the engine has the ranks agree before any enters the collective
        (``Engine.time_gradient_reduction``); a reduction that fails on one rank midway is a
        broken transport, which the next collective would meet as well.
    """
    state = runtime.state
    if state.transport is None or state.size < 2:
        return None
    steps = sum(1 for entry in own if entry[0] == 0 and entry[1] == "train step")
    fewest = min(collectives.allgather_object(steps))  # the same decision on every rank
    if fewest - 2 < TIMED_STEPS:  # the first step and the closing one are not analysed
        return {"note": f"a fit of fewer than {TIMED_STEPS + 2} steps is not timed"}
    optimizer = optimizer_options.distributed_optimizer(model)
    if optimizer is None:
        return {"note": "the model's optimizer is no DistributedOptimizer"}
    if optimizer.process_set is not None:
        return {"note": "the gradients are reduced within a process set"}
    variables = optimizer.shared_variables(model.trainable_variables)
    try:
        engine = backends.get_engine()
        with timeline.span("gradient allreduce timed alone", "collective"):
            seconds = engine.time_gradient_reduction(variables, optimizer.options.reduction,
                                                     repeats=REPEATS)
    except Exception as error:  # the report's share is lost, not the job
        return {"note": f"its timing failed on rank {state.rank} ({type(error).__name__}: "
                        f"{error})"}
    every = optimizer.backward_passes_per_step
    return {"seconds": seconds / every, "every": every, "engine": engine.name,
            "bytes": sum(_nbytes(v) for v in variables), "overlaps": engine.overlaps_backward(),
            "compression": optimizer.compression.name, "hint": engine.reduction_advice()}


def combined(outcomes: List[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """One figure from every rank's :func:`time_communication`: the median of the ranks'
    times, or the first rank's note when any rank has one."""
    if outcomes[0] is None:
        return None
    notes = [outcome for outcome in outcomes if "note" in outcome]
    if notes:
        return notes[0]
    return dict(outcomes[0], seconds=statistics.median(o["seconds"] for o in outcomes))


class EfficiencyReport(keras.callbacks.Callback):
    """Records this fit on every rank, times its gradient allreduce alone at its end (every
    rank); rank 0 prints the report (verbose >= 1). See the module docstring.

    Args:
        batch_size: samples per step on one rank, when fit knows it (None: steps/s are shown).
        input_kind: what fit was given (``sharded.input_kind``), for the input advice.
    """

    def __init__(self, batch_size: Optional[int] = None, input_kind: Optional[str] = None):
        super().__init__()
        self.batch_size = batch_size
        self.input_kind = input_kind
        self.bookmark = 0
        self.figures: Optional[Dict[str, Any]] = None

    def on_train_begin(self, logs=None):
        timeline.ensure_recording(runtime.state)
        self.bookmark = timeline.appended()

    def on_train_end(self, logs=None):
        state = runtime.state
        own = timeline.since(self.bookmark)
        mine = (own, time_communication(self.model, own))
        ranks = (state.transport.gather_object(mine, 0) if state.transport is not None
                 else [mine])
        if state.rank != 0:
            return
        self.figures = analyse([slices for slices, _ in ranks], self.batch_size,
                               combined([timed for _, timed in ranks]))
        if self.figures is None:
            return
        # the engine's word on a step that dominates; what the input was, for its advice
        self.figures["step_hint"] = backends.get_engine().step_advice(
            self.model, optimizer_options.step_options(self.model))
        self.figures["input_kind"] = self.input_kind
        if self.params.get("verbose", 0):
            print(render(self.figures), file=sys.stdout, flush=True)
