"""What the torch train step ran as, and the efficiency report's word on it (issue 63).

The engine's ``wrap_train_function`` chooses: Keras's eager step, mgpu's compiled step
(``compiled.CompiledTrainStep``: ``jit_compile``, on by default on a GPU), either captured in a
CUDA graph (``graph.GraphedTrainStep``). A chosen path can fall back to a slower one at run
time, once, with one line saying why; :func:`path_of` reads which path the steps actually
took from the step objects themselves, so a benchmark row or a report says what was measured,
not what was asked for.
"""

from mgpu_launch.backends.reduction import StepOptions, StepPath
from mgpu_launch.backends.torch import compiled, graph


def _parts(step):
    """(the GraphedTrainStep or None, the CompiledTrainStep or None) of an engine's step."""
    captured = step if isinstance(step, graph.GraphedTrainStep) else None
    inner = captured.eager_step if captured is not None else step
    return captured, inner if isinstance(inner, compiled.CompiledTrainStep) else None


def path_of(step) -> StepPath:
    """What `step` (what ``TorchEngine.wrap_train_function`` returned; None: no step made)
    ran as so far.

    ``ready`` turns True at the end of the first step that ran the path as every later step
    will: the compiled step's second step (traced, compiled and run), the captured step's first
    replay, the step where a fallback was decided (it ran eagerly); an eager step at once.

    Example:
        >>> path_of(None)
        StepPath(name='eager', ready=True, fallback=None)
    """
    captured, compiling = _parts(step)
    name, ready, fallback = "eager", True, None
    if compiling is not None:
        fallback = compiling.fallback
        if fallback is None:
            name, ready = "compiled", compiling.counts["compiled"] > 0
    if captured is not None:
        if captured.fallback is None:
            name = "compiled+cuda_graph" if name == "compiled" else "cuda_graph"
            ready = captured.counts["replayed"] > 0
        else:
            fallback = "; ".join(filter(None, [fallback, f"capture: {captured.fallback}"]))
    return StepPath(name, ready, fallback)


def advice(step, model, options: StepOptions) -> str:
    """The efficiency report's word on a torch step that dominates (the engine's step_advice):
    compile it when it runs eagerly (any device), capture it on a GPU; nothing when it is
    compiled, or captured, already; the fallback's reason when compiling was asked for and
    fell back. `step`: what the engine made for `model` (None: none yet)."""
    captured, compiling = _parts(step)
    if compiling is not None:
        if not compiling.fallback:
            return ""
        return (f"on torch its compiled step fell back to eager ({compiling.fallback}); fix that "
                f"to compile it (docs/torch-compile.md)")
    found = ""
    if not model.jit_compile and compiled.static_reason(model, options) is None:
        found = ("on torch it runs eagerly, bound by the Python that launches its kernels: "
                 "model.compile(jit_compile=True) (or MGPU_TORCH_COMPILE=1; on by default on a "
                 "GPU) compiles the whole step, docs/torch-compile.md")
    if not (graph.requested(options) or graph.static_reason(model, options)):
        capture = ("DistributedOptimizer(cuda_graph=True) captures it in a CUDA graph "
                   "(ResNet-50 on an H200: 2.2-3.2x, docs/torch-cuda-graphs.md)")
        found = (f"{found}; or {capture}" if found else
                 f"on torch it runs eagerly, bound by the Python that launches its kernels: "
                 f"{capture}")
    return found

