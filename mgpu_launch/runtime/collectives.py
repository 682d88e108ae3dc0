"""Host-side collectives over MPI for Python numbers and numpy arrays.

For metrics, flags and small state — not for gradients (those go through the backend engine,
inside the compiled train step). Every call first compares what each rank passed (shape, dtype,
root); a disagreement raises the same :class:`MismatchError` on every rank instead of hanging or
silently mixing buffers. On a 1-process job each call returns a copy.
"""

import enum
from typing import Any, Callable, List, Tuple

import numpy as np

from mgpu_launch.runtime import state, timeline


class ReduceOp(enum.Enum):
    """How ``allreduce`` combines the ranks' values."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Average, Sum, Min, Max = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX
Product = ReduceOp.PRODUCT


class MismatchError(ValueError):
    """Ranks called the same collective with values that cannot be combined."""


def _as_array(value: Any, what: str) -> Tuple[np.ndarray, Callable[[np.ndarray], Any]]:
    """(contiguous array, function turning a result back into the caller's kind of value)."""
    array = np.asarray(value, order="C")  # (np.ascontiguousarray would make 0-d arrays 1-d)
    if array.dtype.kind not in "biufc":
        raise TypeError(f"{what}: expected a number or a numeric numpy array, got "
                        f"{type(value).__name__} with dtype {array.dtype}; use "
                        f"broadcast_object() for arbitrary Python objects")
    if isinstance(value, (bool, int, float, complex)):
        return array, lambda result: result.item()
    if isinstance(value, np.generic):
        return array, lambda result: result[()]
    return array, lambda result: result


def _check_agreement(what: str, description: Tuple, payload: Any = None) -> List[Any]:
    """Gather every rank's description (and payload); raise on all ranks if any description
    differs from rank 0's. Returns the ranks' payloads, in rank order."""
    with timeline.span(f"host {what} (agreement check)", "collective"):
        gathered = state.comm.allgather((description, payload))
    everyone = [item[0] for item in gathered]
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            raise MismatchError(
                f"{what}: ranks disagree — rank 0 passed {_describe(everyone[0])}, rank {rank} "
                f"passed {_describe(other)}. Every rank must call the same collective with "
                f"values of the same dtype and shape (and the same root_rank), in the same order.")
    return [item[1] for item in gathered]


def _describe(description: Tuple) -> str:
    return ", ".join(f"{key}={value}" for key, value in description)


def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < state.size:
        raise ValueError(f"root_rank={root_rank} is not a rank of this job: expected "
                         f"0 <= root_rank < size() = {state.size}")


def allreduce(value: Any, op: ReduceOp = Average) -> Any:
    """Combine `value` across all ranks.

    Args:
        value: a Python number or numeric numpy array, same shape and dtype on every rank.
        op: ``Average`` (default; the result is floating point), ``Sum``, ``Min``, ``Max``
            or ``Product``.

    Returns:
        The combined value, of the same kind as `value` (Python number / numpy array).

    Raises:
        MismatchError: ranks passed different shapes or dtypes, or different ops.

    Example:
        >>> mgpu.allreduce(float(loss))           # mean loss over the ranks
    """
    if not isinstance(op, ReduceOp):
        raise ValueError(f"op={op!r}: expected one of mgpu.Average, mgpu.Sum, mgpu.Min, "
                         f"mgpu.Max, mgpu.Product")
    state.require()
    array, restore = _as_array(value, "allreduce")
    if state.comm is None:
        result = array.copy()
    else:
        _check_agreement("allreduce", (("dtype", array.dtype.str), ("shape", array.shape),
                                       ("op", op.value)))
        from mpi4py import MPI
        mpi_op = {ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
                  ReduceOp.PRODUCT: MPI.PROD}.get(op, MPI.SUM)
        result = np.empty_like(array)
        with timeline.span("host allreduce", "collective"):
            state.comm.Allreduce(array, result, op=mpi_op)
    if op is Average:
        result = result / state.size
    return restore(result)


def allgather(value: Any) -> np.ndarray:
    """Concatenate every rank's array along axis 0, in rank order.

    Args:
        value: a number or numeric array; the first dimension may differ between ranks (ragged),
            the others and the dtype may not. A number counts as an array of one element.

    Returns:
        A numpy array whose first dimension is the sum of the ranks' first dimensions.

    Example:
        >>> mgpu.allgather(np.arange(mgpu.rank() + 1))  # 2 ranks: [0, 0, 1]
    """
    state.require()
    array, _ = _as_array(value, "allgather")
    array = array.reshape(1) if array.ndim == 0 else array
    if state.comm is None:
        return array.copy()
    rows = _check_agreement("allgather", (("dtype", array.dtype.str),
                                          ("shape[1:]", array.shape[1:])), array.shape[0])
    row_size = int(np.prod(array.shape[1:], dtype=np.int64))
    result = np.empty((sum(rows),) + array.shape[1:], dtype=array.dtype)
    counts = [count * row_size for count in rows]
    with timeline.span("host allgather", "collective"):
        state.comm.Allgatherv(array, [result, counts])
    return result


def broadcast(value: Any, root_rank: int = 0) -> Any:
    """Rank `root_rank`'s value, on every rank.

    Args:
        value: a number or numeric array of the same shape and dtype on every rank (the
            non-root ranks' contents are ignored).
        root_rank: the rank whose value everyone gets.

    Returns:
        A copy of the root's value, of the same kind as `value`.
    """
    state.require()
    _check_root(root_rank)
    array, restore = _as_array(value, "broadcast")
    if state.comm is None:
        return restore(array.copy())
    _check_agreement("broadcast", (("dtype", array.dtype.str), ("shape", array.shape),
                                   ("root_rank", root_rank)))
    result = array.copy()
    with timeline.span("host broadcast", "collective"):
        state.comm.Bcast(result, root=root_rank)
    return restore(result)


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """Rank `root_rank`'s picklable object, on every rank (e.g. a config dict or an epoch)."""
    state.require()
    _check_root(root_rank)
    if state.comm is None:
        return obj
    with timeline.span("host broadcast_object", "collective"):
        return state.comm.bcast(obj, root=root_rank)


def allgather_object(obj: Any) -> List[Any]:
    """Every rank's picklable object, as a list in rank order."""
    state.require()
    if state.comm is None:
        return [obj]
    with timeline.span("host allgather_object", "collective"):
        return state.comm.allgather(obj)


def barrier() -> None:
    """Wait until every rank has reached this call."""
    state.require()
    if state.comm is not None:
        with timeline.span("host barrier", "collective"):
            state.comm.Barrier()
