"""CUDA-graph capture of Keras's whole torch train step (``MGPU_TORCH_CUDA_GRAPH=1``).

Keras's torch backend runs each step eagerly, and on a fast GPU the Python that dispatches
its thousands of kernels is the bottleneck (ResNet-50: ~100 ms of host time per step against
~43 ms of GPU work). :class:`GraphedTrainStep` records one step -- forward, backward, the
bucketed NCCL allreduce launched from the gradient hooks, the optimizer update and the metric
updates -- into a ``torch.cuda.CUDAGraph`` and replays it every step after copying the batch
into the graph's static input buffers. It follows PyTorch's rules for whole-network capture:

- warm-up steps first (real training steps, eager, on a side stream), so NCCL communicators,
  cuBLAS/cuDNN handles and lazily built optimizer slots exist before capture;
- a private memory pool per graph; the graph's outputs are cloned before Keras sees them;
- no host synchronisation inside the step: the last warm-up step runs under
  ``torch.cuda.set_sync_debug_mode("warn")`` and any synchronising call (``.item()``, a
  Python branch on a tensor such as LossScaleOptimizer's finite check) means eager fallback;
- static shapes: one graph per batch signature (shapes, dtypes, and the optimizer's Python
  hyperparameters, which a graph bakes in), at most ``CACHE_SIZE`` kept, least recently used
  evicted; a job that keeps producing new signatures falls back to eager.

What reaches a replayed graph: everything Keras keeps in variables, because variables are
updated in place (``copy_``) -- the learning rate (LR callbacks, warm-up, schedules computed
from ``iterations``), momentum correction (it rescales the velocity slots), BatchNorm
statistics, metric accumulators and ``reset_metrics``. A Python float changed after capture
(``optimizer.momentum = 0.5``) changes the signature, so the step is captured again.

When capture is impossible the step stays eager and ONE ``CudaGraphFallbackWarning`` (rank 0)
names the reason: no CUDA device, a LossScaleOptimizer, ``backward_passes_per_step > 1``,
a host read found in the step, a failed capture, or dynamic shapes.
"""

import collections
import threading
import warnings
import weakref
from typing import Callable, Optional

from mgpu_launch.backends.reduction import StepOptions
from mgpu_launch.backends.torch import sync_check as torch_sync_check
from mgpu_launch.config import settings

#: the environment variable that turns capture on (``1``); DistributedOptimizer(cuda_graph=)
ENV = "MGPU_TORCH_CUDA_GRAPH"
#: eager steps per batch signature before it is captured (PyTorch's examples use 3 to 11)
WARMUP_ENV = "MGPU_TORCH_CUDA_GRAPH_WARMUP"
#: graphs kept at once (each holds its own memory pool)
CACHE_SIZE = 4
#: distinct signatures after which the shapes count as dynamic and capture stops
MAX_SIGNATURES = 16

_stepping = threading.local()  # set while this thread warms up or captures a step
_live: "weakref.WeakSet[GraphedTrainStep]" = weakref.WeakSet()  # for release()
# the Keras optimizers of captured steps: their SGD update takes the rate as a device tensor
_device_rate: "weakref.WeakSet" = weakref.WeakSet()


def scalars_on_device() -> bool:
    """Whether Python numbers should become device tensors without a host copy (see
    mgpu_launch.training.patches: only while a step is warmed up or captured, in that thread)."""
    return getattr(_stepping, "active", False)


#: the largest array of numbers a step may turn into a device tensor while it is captured
MAX_CONSTANT_ELEMENTS = 16


def device_constant(value, dtype=None):
    """A constant of the step (a Python number, a numpy scalar, or a short list, tuple or
    numpy array of numbers) as a tensor on Keras's device, made by fill kernels: no host
    copy, so it can be captured. None for anything else (tensors, variables, long arrays).

    The dtype follows Keras's ``convert_to_tensor``: `dtype` if given; for a Python number
    bool, int32 (int64 outside its range) or ``floatx()``; for a list or tuple Keras's
    ``result_type`` of its items; for numpy values their dtype.
    """
    import numpy as np
    import torch
    from keras.config import floatx

    from mgpu_launch.keras_internals import to_torch_dtype, torch_device as get_device

    kind = type(value)
    if kind in (bool, int, float):
        if dtype is not None:
            torch_dtype = to_torch_dtype(dtype)
        elif kind is bool:
            torch_dtype = torch.bool
        elif kind is int:
            torch_dtype = torch.int64 if value < -(2 ** 31) or value >= 2 ** 31 else torch.int32
        else:
            torch_dtype = to_torch_dtype(floatx())
        return torch.full((), value, dtype=torch_dtype, device=get_device())
    if not isinstance(value, (np.ndarray, np.generic, list, tuple)):
        return None
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        return None
    if array.dtype.kind not in "biuf" or array.size > MAX_CONSTANT_ELEMENTS or (
            array.dtype == np.uint32 or array.dtype.name == "bfloat16"):
        return None  # Keras converts these specially; leave them to it
    if dtype is None and isinstance(value, (list, tuple)):  # Keras: from the Python types
        from keras import tree
        from keras.backend import result_type
        dtype = result_type(*[getattr(item, "dtype", type(item)) for item in tree.flatten(value)])
    torch_dtype = to_torch_dtype(dtype if dtype is not None else array.dtype.name)
    out = torch.empty(array.shape, dtype=torch_dtype, device=get_device())
    flat = out.view(-1)
    for index, number in enumerate(array.reshape(-1).tolist()):
        flat[index].fill_(number)
    return out


class _Stepping:
    def __enter__(self):
        _stepping.active = True

    def __exit__(self, *exc):
        _stepping.active = False


class CudaGraphFallbackWarning(UserWarning):
    """The torch train step could not be captured and runs eagerly; the message says why."""


def requested(options: Optional[StepOptions] = None) -> bool:
    """Whether capture is asked for: ``DistributedOptimizer(cuda_graph=True)`` (its step
    options, handed down) or the env."""
    if options is not None and options.cuda_graph is not None:
        return bool(options.cuda_graph)
    return settings.flag(ENV)


def warmup_steps() -> int:
    """Eager steps per batch signature before capture (SettingError unless an integer >= 1:
    the step must run eagerly at least once before it can be captured)."""
    return settings.integer(WARMUP_ENV)


def _warn(reason: str, is_chief: bool) -> None:
    if is_chief:
        warnings.warn(f"{ENV}: the torch train step runs eagerly (no CUDA graph): {reason}.",
                      CudaGraphFallbackWarning, stacklevel=3)


def static_reason(model, options: StepOptions) -> Optional[str]:
    """Why `model`'s step can never be captured (None: it may be); `options`: its
    DistributedOptimizer's step options."""
    import keras
    import torch

    optimizer = getattr(model, "optimizer", None)
    chain = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    if any(isinstance(o, keras.optimizers.LossScaleOptimizer) for o in chain):
        return ("a LossScaleOptimizer skips non-finite steps with a Python branch on the "
                "gradients (a host read every step); use mixed_bfloat16, which needs no loss "
                "scaling, to capture the step")
    if options.backward_passes_per_step > 1:
        return ("backward_passes_per_step > 1 decides on the host whether to apply; use "
                "backward_passes_per_step=1 to capture the step")
    if not torch.cuda.is_available():
        return "no CUDA device, the step runs on CPU (CUDA graphs need a GPU)"
    return None


def _signature(flat, optimizer) -> tuple:
    shapes = tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else ("value", x)
                   for x in flat)
    return shapes + (_hyperparameters(optimizer),)


def _hyperparameters(optimizer) -> tuple:
    """The optimizer's Python numbers a graph bakes in (a change means a new capture)."""
    found = []
    for owner in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        for name in ("momentum", "nesterov", "beta_1", "beta_2", "epsilon", "rho",
                     "weight_decay", "clipnorm", "clipvalue", "global_clipnorm"):
            value = getattr(owner, name, None)
            if isinstance(value, (int, float, bool)):
                found.append((name, value))
    return tuple(found)


class _Captured:
    """One graph: its static inputs, its outputs, and the graph itself."""

    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs

    def replay(self, flat):
        import torch
        for static, value in zip(self.inputs, flat):
            if static is not None:
                static.copy_(value, non_blocking=True)
        self.graph.replay()
        return torch.utils._pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.outputs)


class GraphedTrainStep:
    """Keras's ``one_step_on_data``, captured per batch signature and replayed.

    Args:
        model: the compiled Keras model (torch backend).
        eager_step: Keras's own train function (``data -> logs``), used for warm-up steps,
            for capture and as the fallback.
        options: the model's DistributedOptimizer's step options (handed down).
        is_chief: whether this process prints the fallback warning (rank 0).

    Example:
        >>> model.train_function = GraphedTrainStep(model, model.train_function, StepOptions())
    """

    def __init__(self, model, eager_step: Callable, options: StepOptions,
                 is_chief: bool = True):
        import torch

        self.model, self.eager_step, self.is_chief = model, eager_step, is_chief
        self.warmup = warmup_steps()
        self.graphs: "collections.OrderedDict[tuple, _Captured]" = collections.OrderedDict()
        self.seen = collections.Counter()
        #: steps run eagerly, graphs captured, steps replayed (for benchmarks and tests)
        self.counts = collections.Counter()
        #: where the checked warm-up step synchronised with the host (when it did)
        self.sync_sites: list = []
        self.fallback: Optional[str] = static_reason(model, options)
        #: eager steps this model took before capture was asked for (they can break capture)
        self.steps_before = _steps_taken(model) if self.fallback is None else 0
        _live.add(self)
        if self.fallback:
            _warn(self.fallback, is_chief)
            return
        self.side = torch.cuda.Stream()
        _allow_device_learning_rate(model.optimizer)

    def __call__(self, data):
        if self.fallback:
            self.counts["eager"] += 1
            return self.eager_step(data)
        from keras import tree
        flat = [_to_device(x) for x in tree.flatten(data)]
        key = _signature(flat, self.model.optimizer)
        captured = self.graphs.get(key)
        if captured is not None:
            self.graphs.move_to_end(key)
            self.counts["replayed"] += 1
            return captured.replay(flat)
        self.seen[key] += 1
        if len(self.seen) > MAX_SIGNATURES:
            return self._give_up(data, f"dynamic shapes: more than {MAX_SIGNATURES} distinct "
                                       f"batch signatures (shapes, dtypes, optimizer numbers)")
        if self.seen[key] <= self.warmup:
            return self._warm_up(tree.pack_sequence_as(data, flat),
                                 check=self.seen[key] == self.warmup)
        try:
            captured = self._capture(data, flat)
        except Exception as error:  # noqa: BLE001 - any failure: eager, with the reason
            return self._give_up(data, f"capture failed ({type(error).__name__}: "
                                       f"{str(error).splitlines()[0] if str(error) else ''})"
                                       + (_EAGER_FIRST.format(self.steps_before)
                                          if self.steps_before else ""))
        self.graphs[key] = captured
        self.counts["captured"] += 1
        self.counts["replayed"] += 1
        while len(self.graphs) > CACHE_SIZE:
            self.graphs.popitem(last=False)
        return captured.replay(flat)  # capture records the step; replay runs it

    def _give_up(self, data, reason: str):
        self.fallback = reason
        self.graphs.clear()
        # A capture that broke off mid-backward left gradient buckets half counted.
        from mgpu_launch.backends import get_engine_or_default
        watched = getattr(get_engine_or_default(), "_watched", None)
        if watched is not None:
            watched._reset()
        _warn(reason, self.is_chief)
        self.counts["eager"] += 1
        return self.eager_step(data)

    def _warm_up(self, data, check: bool):
        import torch
        self.counts["eager"] += 1
        current = torch.cuda.current_stream()
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            with _Stepping():
                if check:
                    logs, syncs = torch_sync_check.run(lambda: self.eager_step(data))
                else:
                    logs, syncs = self.eager_step(data), []
        current.wait_stream(self.side)
        if syncs:
            self.sync_sites = sorted(set(syncs))
            self.fallback = (f"the step reads a device value on the host ({syncs[0]}; "
                             f"{len(self.sync_sites)} place(s) in all); a "
                             f"metric or loss that calls .item()/float(), or a Python branch "
                             f"on a tensor, cannot be captured")
            _warn(self.fallback, self.is_chief)
        return logs

    def _capture(self, data, flat):
        import torch
        from keras import tree

        inputs = [torch.empty_like(x) if isinstance(x, torch.Tensor) else None for x in flat]
        for static, value in zip(inputs, flat):
            if static is not None:
                static.copy_(value)
        static_data = tree.pack_sequence_as(
            data, [s if s is not None else v for s, v in zip(inputs, flat)])
        graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=self.side, capture_error_mode="thread_local"), \
                _Stepping():
            outputs = self.eager_step(static_data)
        return _Captured(graph, inputs, outputs)


#: added to a failed capture's reason when the model trained eagerly first (benchmarks/torch_speed:
#: ResNet-50 after 5 eager steps; backward then waits on the default stream the eager steps ran on)
_EAGER_FIRST = ("; this model took {} eager step(s) in this process before capture was turned on, "
                "which can make capture fail: turn it on before the first fit "
                "(DistributedOptimizer(cuda_graph=True) or MGPU_TORCH_CUDA_GRAPH=1 from the start)")


def _steps_taken(model) -> int:
    """The optimizer's step count (0 when it cannot be read)."""
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    try:
        return int(iterations.numpy()) if iterations is not None else 0
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return 0


def release() -> None:
    """Free every captured graph of this process (the torch engine's shutdown calls it).

    A graph that captured an NCCL allreduce keeps the communicator busy:
    ``destroy_process_group`` then hangs in ``ncclCommDestroy`` (pytorch/pytorch#115388; seen
    on 2x H200 at the end of benchmarks/torch_cuda_graph/check_same_weights.py). Waiting for
    the device and resetting the graphs first lets it return. Steps captured later start over.
    """
    holding = [step for step in list(_live) if step.graphs]
    if not holding:
        return  # nothing captured (e.g. CPU, where every step fell back to eager)
    import torch
    torch.cuda.synchronize()
    for step in holding:
        for captured in step.graphs.values():
            captured.graph.reset()
        step.graphs.clear()
        step.seen.clear()


def _to_device(value):
    """A batch leaf as the device tensor Keras would make of it (numpy included)."""
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    from mgpu_launch.keras_internals import torch_convert_to_tensor as convert_to_tensor
    return convert_to_tensor(value)


def _allow_device_learning_rate(optimizer) -> None:
    """Let the torch SGD update take the learning rate as a device tensor (no ``.item()``).

    Keras's torch SGD passes the rate as ``alpha=`` of ``_foreach_add_``, which reads it on the
    host every step; ``mgpu_launch.training.patches`` gives SGD a form without that read, used
    where this flag is set.
    """
    for owner in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if owner is not None:
            _device_rate.add(owner)


def uses_device_learning_rate(optimizer) -> bool:
    """Whether `optimizer`'s torch SGD update takes the rate as a device tensor (its step was
    wrapped for capture: the replacement in ``backends/torch/patches.py`` asks)."""
    return optimizer in _device_rate
