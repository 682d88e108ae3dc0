"""Keras's whole torch train step as ONE compiled graph (issue 63; docs/torch-compile.md).

Keras's own ``jit_compile=True`` on torch hands ``one_step_on_data`` to ``torch.compile``, and
dynamo then traces Keras's Python: it breaks the graph in ``keras.tree`` (``is not`` on two
tuples), in ``inspect.signature`` binding, on a dict mutated behind a mapping proxy, at
``loss.backward()``, and every break makes the layers' shared ``forward`` / ``_setattr_hook`` /
``Functional.call`` frames compile once per layer class until the recompile limit (8).

This module traces the step the way Keras's JAX backend does, and never lets dynamo read Keras:

1. one eager step first (per process), so the optimizer's slots and the metrics exist and a
   ``DistributedOptimizer`` has copied rank 0's weights;
2. the step is traced once per batch signature with ``make_fx`` on fake tensors: every Keras
   variable's tensor (model, optimizer, metrics) is an input, handed to Keras through a
   ``keras.StatelessScope``; Keras's Python (``train_step``, ``loss.backward()``, the
   optimizer) runs once and only the aten ops it reaches are recorded -- forward, backward,
   the gradient allreduce (``torch.distributed._functional_collectives``, one op per bucket of
   the same plan as the eager engine), the optimizer update and the metric updates; the
   variables' new values are written back into their input tensors;
3. that graph -- plain aten ops, no Python of Keras -- goes to ``torch.compile(fullgraph=True)``
   (inductor), once; every later step of the signature runs the compiled graph on the
   variables' tensors in place.

A step that cannot be traced this way falls back to Keras's eager step, and rank 0 prints ONE
line naming the reason and the fix: a Python branch on a tensor (``.item()``, ``if tensor:``,
``ops.cond`` in a LossScaleOptimizer, a Dropout given a ``seed=``), a variable assigned that the model, optimizer and metrics do
not list, float64, more than ``MAX_SIGNATURES`` batch shapes, an error of the compiler.
"""

import collections
import sys
import threading
from typing import Callable, List, Optional

from mgpu_launch.backends.reduction import StepOptions
from mgpu_launch.config import settings

#: auto (default: on with a CUDA device, off on CPU), 1 or 0; model.compile(jit_compile=) wins
ENV = "MGPU_TORCH_COMPILE"
#: distinct batch signatures after which the shapes count as dynamic and compiling stops
MAX_SIGNATURES = 8
#: what the fallback line starts with (tests and users grep for it)
FALLBACK_PREFIX = "mgpu-launch: the torch train step runs eagerly (not compiled):"

_tracing = threading.local()


def tracing() -> bool:
    """Whether this thread is tracing a step now (the engine then reduces in the graph)."""
    return getattr(_tracing, "active", False)


class _Tracing:
    def __enter__(self):
        _tracing.active = True

    def __exit__(self, *exc):
        _tracing.active = False


def default_on() -> bool:
    """What ``jit_compile="auto"`` means for a DistributedOptimizer model on torch.

    ``MGPU_TORCH_COMPILE``: ``1`` on, ``0`` off, ``auto`` (default) on with a CUDA device and
    off on CPU, where inductor's C++ build of each new graph (~40-80 s for the tiny models of
    the tests on a 2-core box) costs more than a short job saves.
    """
    choice = settings.choice(ENV)
    if choice == "auto":
        import torch
        return torch.cuda.is_available()
    return choice == "1"


def static_reason(model, options: StepOptions) -> Optional[str]:
    """Why `model`'s step is never compiled here (None: it may be); each names the fix.
    `options`: its DistributedOptimizer's step options (handed down)."""
    import keras

    optimizer = getattr(model, "optimizer", None)
    chain = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    if any(isinstance(o, keras.optimizers.LossScaleOptimizer) for o in chain):
        return ("a LossScaleOptimizer decides on the host whether to skip a step; use "
                "mixed_bfloat16 (no loss scaling) to compile the step")
    if options.backward_passes_per_step > 1:
        return ("backward_passes_per_step > 1 decides on the host whether to apply; use "
                "backward_passes_per_step=1 to compile the step")
    if options.within_a_set:
        return ("a DistributedOptimizer with a process_set is not compiled (untested); "
                "reduce over every rank (process_set=None) to compile the step")
    if any(getattr(v, "dtype", "") == "float64" for v in model.trainable_variables):
        return "float64 weights (compiled kernels are float32/bfloat16/float16); use float32"
    return None


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


class CompiledTrainStep:
    """Keras's ``one_step_on_data``, traced once per batch signature and compiled.

    Args:
        model: the compiled Keras model (torch backend).
        eager_step: Keras's own train function (``data -> logs``), run for the first step,
            traced, and the fallback.
        options: the model's DistributedOptimizer's step options (handed down).
        is_chief: whether this process prints the fallback line (rank 0).
        mode: ``torch.compile``'s mode (None: inductor's default).

    Example:
        >>> model.train_function = CompiledTrainStep(model, model.train_function, StepOptions())
    """

    def __init__(self, model, eager_step: Callable, options: StepOptions,
                 is_chief: bool = True, mode=None):
        self.model, self.eager_step, self.is_chief, self.mode = model, eager_step, is_chief, mode
        self.steps: "collections.OrderedDict[tuple, _Step]" = collections.OrderedDict()
        #: eager steps, traces, compiled steps run (for benchmarks and tests)
        self.counts = collections.Counter()
        self.fallback: Optional[str] = static_reason(model, options)
        if self.fallback:
            self._say(self.fallback)
            return
        from mgpu_launch.backends.torch import graph as torch_graph
        # Keras's torch SGD passes the rate as alpha= (a host read); the same update with the
        # rate as a tensor (mgpu_launch.training.patches, as for CUDA graphs) can be traced
        torch_graph._allow_device_learning_rate(model.optimizer)

    def __call__(self, data):
        if self.fallback or not self.counts["eager"]:
            self.counts["eager"] += 1  # the first step builds slots and syncs from rank 0
            return self.eager_step(data)
        from keras import tree

        from mgpu_launch.backends.torch import graph as torch_graph
        leaves = [torch_graph._to_device(x) for x in tree.flatten(data)]
        key = torch_graph._signature(leaves, self.model.optimizer)
        step = self.steps.get(key)
        if step is None:
            if len(self.steps) >= MAX_SIGNATURES:
                return self._give_up(data, f"more than {MAX_SIGNATURES} batch signatures "
                                           f"(shapes, dtypes, optimizer numbers); pad batches "
                                           f"to a few shapes or drop the last partial batch")
            try:
                step = self._trace(data, leaves)
            except Exception as error:  # noqa: BLE001 - any failure: eager, with the reason
                return self._give_up(data, f"tracing failed ({_one_line(error)}){_HINT}")
            self.steps[key] = step
            self.counts["traced"] += 1
        try:
            logs = step.run(leaves)
        except Exception as error:  # noqa: BLE001
            if step.ran:
                raise  # it ran before: a real error of this step, not of compiling
            return self._give_up(data, f"torch.compile failed ({_one_line(error)})")
        self.counts["compiled"] += 1
        return logs

    def _give_up(self, data, reason: str):
        self.fallback = reason
        self.steps.clear()
        self._say(reason)
        self.counts["eager"] += 1
        return self.eager_step(data)

    def _say(self, reason: str) -> None:
        if self.is_chief:
            print(f"{FALLBACK_PREFIX} {reason}. Turn compiling off with "
                  f"model.compile(jit_compile=False) or {ENV}=0.", file=sys.stderr, flush=True)

    def _variables(self) -> list:
        """Every variable the step may read or write: the model's, the optimizer's (a
        DistributedOptimizer's own and its inner optimizer's), the metrics'."""
        model, seen, found = self.model, set(), []
        for v in (list(model.variables) + list(model.optimizer.variables)
                  + list(model.metrics_variables)):
            if id(v) not in seen:
                seen.add(id(v))
                found.append(v)
        return found

    def _trace(self, data, leaves) -> "_Step":
        import keras
        import torch
        from keras import tree
        from torch.fx.experimental.proxy_tensor import make_fx

        variables = self._variables()
        listed = {id(v) for v in variables}
        count = len(variables)
        tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        outputs = {}

        def step(*args):
            state, given = args[:count], list(args[count:])
            flat = list(leaves)
            for i, value in zip(tensor_at, given):
                flat[i] = value
            mapping = list(zip(variables, state))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                logs = self.eager_step(tree.pack_sequence_as(data, flat))
                assigned = [k for k in scope.state_mapping if k not in listed]
                if assigned:
                    raise RuntimeError(f"the step assigns {len(assigned)} variable(s) that "
                                       f"the model, optimizer and metrics do not list")
                with torch.no_grad():
                    for variable, tensor in mapping:
                        new = scope.get_current_value(variable)
                        if new is not None and new is not tensor:
                            tensor.copy_(new)  # the update, written back in place
            out = tree.flatten(logs)
            if not all(isinstance(x, torch.Tensor) for x in out):
                raise RuntimeError("the step returns logs that are not tensors")
            outputs["structure"] = logs
            return out

        # Fresh leaves on the variables' storage: no .grad from the eager step to accumulate into.
        inputs = [v.value.detach().requires_grad_(v.value.requires_grad) for v in variables]
        with _Tracing():
            graph = make_fx(step, tracing_mode="fake")(*inputs, *[leaves[i] for i in tensor_at])
        _check_graph(graph)
        for v in variables:  # the eager step's gradients are not needed any more
            if v.value.grad is not None:
                v.value.grad = None
        compiled = torch.compile(graph, fullgraph=True, dynamic=False, mode=self.mode)
        return _Step(compiled, variables, tensor_at, outputs["structure"])


#: added to a tracing failure: where such failures come from
_HINT = ("; a Python branch on a tensor (.item(), float(), if tensor:, ops.cond) or a "
         "Dropout given a seed= cannot be traced")


def _check_graph(graph) -> None:
    """Refuse a graph that holds a tensor the trace lost track of (a placeholder kept as a
    constant: it has no data). A variable not among the inputs cannot get this far: fake
    tracing refuses a real tensor that was not made inside the trace."""
    from torch._subclasses.fake_tensor import FakeTensor

    for name in dir(graph):
        if name.startswith("_tensor_constant") and isinstance(getattr(graph, name), FakeTensor):
            raise RuntimeError(f"the trace kept a placeholder tensor as a constant ({name})")


class _Step:
    """One compiled graph: which tensors it takes, and the logs' structure it returns."""

    def __init__(self, compiled, variables, tensor_at: List[int], structure):
        self.compiled, self.variables = compiled, variables
        self.tensor_at, self.structure = tensor_at, structure
        self.ran = False

    def run(self, leaves):
        import torch
        from keras import tree

        with torch.no_grad():
            out = self.compiled(*[v.value for v in self.variables],
                                *[leaves[i] for i in self.tensor_at])
        self.ran = True
        return tree.pack_sequence_as(self.structure, list(out))


def reduce_in_graph(grads, variables, reducer, fusion_bytes: int) -> List:
    """The gradients summed (averaged) across ranks by functional collectives, bucket by
    bucket as the eager engine's hooks reduce them (same plan, scaling and compression), as
    ops of the traced graph; a missing gradient (a variable this rank did not use) takes part
    as zeros. `reducer` is the engine's ``Reduction`` (its group: None for every rank)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    from mgpu_launch.backends import reduction

    specs = [reduction.TensorSpec(str(v.value.dtype), v.value.numel(), v.value.element_size())
             for v in variables]
    group = reducer.group or dist.group.WORLD
    result = [None] * len(grads)
    for bucket in reduction.plan(specs, fusion_bytes, backward=True):
        chosen = [grads[i] if grads[i] is not None else torch.zeros_like(variables[i].value)
                  for i in bucket.indices]
        flat = torch.cat([g.reshape(-1) for g in chosen])
        if reducer.prescale != 1.0:
            flat = flat * reducer.prescale
        wire = reducer.compression.compress(flat) if reducer.compression else flat
        wire = funcol.wait_tensor(funcol.all_reduce(wire, "sum", group))
        flat = reducer.compression.decompress(wire, chosen[0].dtype) if reducer.compression \
            else wire
        if reducer.scale != 1.0:
            flat = flat * reducer.scale
        for i, offset, size in zip(bucket.indices, bucket.offsets, bucket.sizes):
            result[i] = flat[offset:offset + size].view(variables[i].value.shape)
    return result


_SUM_FUNCTION = []


def sum_across_ranks():
    """A ``torch.autograd.Function`` summing across ranks forward and backward with functional
    collectives, which a trace records as ops (synchronized BatchNormalization's moments)."""
    if _SUM_FUNCTION:
        return _SUM_FUNCTION[0]
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    def total(tensor):
        return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", dist.group.WORLD))

    class SumAcrossRanksInGraph(torch.autograd.Function):
        @staticmethod
        def forward(ctx, flat):
            return total(flat)

        @staticmethod
        def backward(ctx, gradient):
            return total(gradient)

    _SUM_FUNCTION.append(SumAcrossRanksInGraph)
    return SumAcrossRanksInGraph
