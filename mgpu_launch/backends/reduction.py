"""The gradient reduction plan the three engines share: which tensors travel in one buffer, in
what order, and the factors they are scaled by around the sum.

Every engine reduces a list of tensors the same way (Horovod's tensor fusion):

1. group the tensors by dtype and cut each group into buckets of about ``bucket_bytes``
   (:func:`plan`);
2. for each bucket, in plan order: concatenate its tensors into one flat buffer, multiply by
   ``Scales.pre``, compress, sum across ranks, decompress, multiply by ``Scales.post``
   (:func:`scales`: the postscale factor, divided by the number of ranks for an average);
3. split the summed buffer back at ``Bucket.offsets`` into the tensors' shapes.

How a buffer is concatenated, sent and split is the engine's business (``torch.cat`` and an
async ``all_reduce``, ``jax.lax.psum``, ``CollectiveReduceV2``); this module only decides, on
plain numbers, and imports no framework (its unit tests run without TensorFlow, JAX or torch).

Cross-rank contract: a collective sums the buffers the ranks issue in the same position, so
every rank must issue the same buffers, of the same dtype and length, in the same order.
:func:`plan` guarantees that for equal inputs: its result depends only on the sequence of
``(dtype, size, itemsize)`` it is given and on ``bucket_bytes`` -- never on a rank, a clock,
object identities or hash order. The order is:

- dtypes in ascending order of their names (plain string comparison of the names the engine
  passes, e.g. ``"float16" < "float32"``, or ``"torch.float16" < "torch.float32"``);
- within one dtype, the tensors in list order, or last to first with ``backward=True`` (the
  order in which backprop produces gradients, so the first bucket is ready first);
- a bucket is closed as soon as its bytes reach ``bucket_bytes``; a tensor is never split,
  so a bucket may hold more than ``bucket_bytes`` (a large tensor joins the partly filled
  bucket before it, then closes it).

The engines therefore need the same tensor list on every rank (the optimizer's variables, in
their order), which is what the model's equal structure on every rank gives them.
"""

import dataclasses
import numbers
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["GradientReduction", "StepOptions", "StepPath", "STEP_PATHS", "TensorSpec", "Bucket",
           "Scales", "plan", "scales", "scale_once"]


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a model's ``DistributedOptimizer`` asks of the train step the engine runs: handed
    to ``Engine.wrap_train_function`` and ``Engine.step_advice`` as a value (made by
    ``DistributedOptions.step_options``), so no engine reads options off a Keras optimizer.

    Attributes:
        cuda_graph: capture the torch step in a CUDA graph (True / False), or None to follow
            ``MGPU_TORCH_CUDA_GRAPH``.
        backward_passes_per_step: gradients of this many batches make one update (a step
            that decides on the host whether to apply cannot be captured).
        within_a_set: the gradients are reduced within a process set (torch's compiled step
            is not: it stays eager).
    """

    cuda_graph: Optional[bool] = None
    backward_passes_per_step: int = 1
    within_a_set: bool = False


#: what a train step can run as (:class:`StepPath`'s ``name``)
STEP_PATHS = ("eager", "graph", "compiled", "cuda_graph", "compiled+cuda_graph")


@dataclasses.dataclass(frozen=True)
class StepPath:
    """What a model's train step ran as: the engine's actual choice (``Engine.step_path``),
    which a fallback can make differ from what the options asked for.

    Attributes:
        name: one of :data:`STEP_PATHS`. ``eager``: Python dispatches every op (Keras's
            ``run_eagerly``; Keras-torch without compiling); ``graph``: TensorFlow's
            ``tf.function`` without XLA; ``compiled``: one compiled program (JAX's ``jit``,
            TensorFlow's XLA, the torch engine's compiled step through inductor);
            ``cuda_graph``: the torch eager step captured in a CUDA graph and replayed;
            ``compiled+cuda_graph``: the compiled torch step captured.
        ready: every step from now on runs `name` as it is: its tracing, compiling and
            capturing are done (or were given up). Keras's compiled functions are built at the
            first call; the torch engine compiles at the second step, captures after its
            warm-up steps.
        fallback: why the step runs a slower path than the one asked for or chosen by default
            (the reason its one fallback line printed), else None.
    """

    name: str
    ready: bool = True
    fallback: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """How a list of gradients is combined across ranks: the one value the engines take
    (``Engine.reduce_gradients``, ``watch``, ``time_gradient_reduction``).

    A ``DistributedOptimizer`` makes it from its options
    (``DistributedOptions.reduction``); ``DistributedGradientTape`` and Horovod's
    ``grouped_allreduce`` make their own.

    Attributes:
        average: divide the sum by the number of ranks (``op=Average``), or keep the sum.
        prescale: multiply each gradient by this before the sum (Horovod's predivide).
        postscale: multiply each result by this after the sum (and the average).
        compression: a ``mgpu_launch.backends.compression`` codec for the wire, or None.
        sparse_as_dense: TensorFlow's sparse gradients summed as dense tensors (True) or
            gathered (False).

    Example:
        >>> GradientReduction(average=True, prescale=0.5, postscale=2.0).allreduce_options()
        {'average': True, 'prescale': 0.5, 'postscale': 2.0, 'compression': None}
    """

    average: bool = True
    prescale: float = 1.0
    postscale: float = 1.0
    compression: Any = None
    sparse_as_dense: bool = False

    def allreduce_options(self) -> dict:
        """The keywords of ``Engine.allreduce`` this reduction stands for."""
        return {"average": self.average, "prescale": self.prescale,
                "postscale": self.postscale, "compression": self.compression}


class TensorSpec(NamedTuple):
    """What the plan needs to know of one tensor.

    Attributes:
        dtype: the engine's name of the dtype (``str(tensor.dtype)``); only compared, so any
            spelling works as long as every rank uses the same one.
        size: number of elements.
        itemsize: bytes per element.
    """

    dtype: str
    size: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


class Bucket(NamedTuple):
    """Tensors reduced together as one flat buffer.

    Attributes:
        dtype: the dtype name they share.
        indices: their positions in the list given to :func:`plan`, in buffer order.
        sizes: their element counts, in buffer order.
        offsets: where each starts in the flat buffer (elements), in buffer order.
    """

    dtype: str
    indices: Tuple[int, ...]
    sizes: Tuple[int, ...]
    offsets: Tuple[int, ...]

    @property
    def size(self) -> int:
        """Elements in the flat buffer."""
        return self.offsets[-1] + self.sizes[-1]


class Scales(NamedTuple):
    """Factors around the sum: ``buffer * pre`` before it, ``sum * post`` after it.

    An engine skips a multiplication whose factor is exactly 1.0.
    """

    pre: float
    post: float


def plan(specs: Sequence[TensorSpec], bucket_bytes: Optional[int] = None, *,
         backward: bool = False) -> List[Bucket]:
    """The buckets for tensors described by `specs`, in the order every rank issues them.

    Args:
        specs: one :class:`TensorSpec` (or ``(dtype, size, itemsize)`` tuple) per tensor.
        bucket_bytes: close a bucket once it holds this many bytes. None: no limit, one
            bucket per dtype. 0 or less: no fusion, one bucket per tensor.
        backward: fill each dtype's buckets from the last tensor to the first (the order
            backprop produces gradients) instead of first to last.

    Returns:
        The buckets: dtypes by ascending name, and within a dtype in fill order (see the
        module docstring). Every index appears in exactly one bucket; an empty `specs` gives
        an empty list.

    Raises:
        ValueError: a spec with a negative size or itemsize.

    Example:
        >>> [b.indices for b in plan([("float32", 10, 4), ("float16", 4, 2),
        ...                           ("float32", 30, 4)], bucket_bytes=64, backward=True)]
        [(1,), (2,), (0,)]
    """
    by_dtype = {}
    order = reversed(range(len(specs))) if backward else range(len(specs))
    for index in order:
        dtype, size, itemsize = specs[index]
        if size < 0 or itemsize < 0:
            raise ValueError(
                f"tensor {index} of the reduction has size={size!r} and itemsize={itemsize!r}: "
                f"expected element and byte counts >= 0 (pass TensorSpec(dtype, number of "
                f"elements, bytes per element)).")
        by_dtype.setdefault(dtype, []).append(index)
    buckets: List[Bucket] = []
    for dtype in sorted(by_dtype):
        indices: List[int] = []
        filled = 0
        for index in by_dtype[dtype]:
            indices.append(index)
            filled += specs[index][1] * specs[index][2]
            if bucket_bytes is not None and filled >= bucket_bytes:
                buckets.append(_bucket(dtype, indices, specs))
                indices, filled = [], 0
        if indices:
            buckets.append(_bucket(dtype, indices, specs))
    return buckets


def _bucket(dtype: str, indices: List[int], specs: Sequence[TensorSpec]) -> Bucket:
    sizes = tuple(specs[i][1] for i in indices)
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += size
    return Bucket(dtype, tuple(indices), sizes, tuple(offsets))


def scales(average: bool, size: int, prescale: float = 1.0, postscale: float = 1.0) -> Scales:
    """The factors of a reduction: Horovod's prescale and postscale, and the average's 1/size.

    Args:
        average: divide the sum by the number of ranks (``op=Average``), else keep it (Sum).
        size: the number of ranks.
        prescale: multiply each buffer by this before the sum (Horovod's predivide).
        postscale: multiply each result by this after the sum.

    Returns:
        ``Scales(pre=prescale, post=postscale / size)`` for an average, else
        ``Scales(pre=prescale, post=postscale)``.

    Raises:
        ValueError: `size` is not a positive integer.

    Example:
        >>> scales(average=True, size=4, prescale=0.5, postscale=2.0)
        Scales(pre=0.5, post=0.5)
    """
    _check_size(size)
    return Scales(prescale, postscale / size if average else postscale)


def scale_once(average: bool, size: int, prescale: float = 1.0, postscale: float = 1.0) -> float:
    """The one factor for values that are gathered rather than summed (sparse gradients):
    ``prescale * postscale``, divided by the number of ranks for an average.

    Example:
        >>> scale_once(average=True, size=4, prescale=0.5, postscale=2.0)
        0.25
    """
    _check_size(size)
    return prescale * postscale / (size if average else 1)


def _check_size(size) -> None:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"size={size!r}: expected the number of ranks, an integer >= 1.")
