"""Host-side collectives over the control plane (MPI today) for numbers and numpy arrays.

For metrics, flags and small state — not for gradients (those go through the backend engine,
inside the compiled train step). Every call first compares what each rank passed (shape, dtype,
root); a disagreement raises the same :class:`MismatchError` on every rank instead of hanging or
silently mixing buffers. On a 1-process job each call returns a copy.

Every collective takes ``process_set=``: None (or ``global_process_set``) for every rank, or a
registered :class:`~mgpu_launch.runtime.process_sets.ProcessSet`, whose members then run it
on their own sub-group of the transport (an average divides by the set's size, an allgather
concatenates the members' values in rank order, ``root_rank`` is a global rank of a member). A rank outside
the set raises :class:`~mgpu_launch.runtime.process_sets.NotInProcessSetError` at once.
"""

import enum
from typing import Any, Callable, List, Tuple

import numpy as np

from mgpu_launch.runtime import process_sets, state, timeline
from mgpu_launch.runtime.errors import MismatchError


class ReduceOp(enum.Enum):
    """How ``allreduce`` combines the ranks' values."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Average, Sum, Min, Max = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX
Product = ReduceOp.PRODUCT


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


def _check_agreement(what: str, description: Tuple, payload: Any = None,
                     group: process_sets.Group = None) -> List[Any]:
    """Gather every member's description (and payload); raise on all of them if any description
    differs from the first member's. Returns the members' payloads, in rank order."""
    group = group or process_sets.group_of(None, what)
    with timeline.span(f"host {what} (agreement check)", "collective"):
        gathered = group.transport.allgather_object((description, payload))
    everyone = [item[0] for item in gathered]
    for index, other in enumerate(everyone):
        if other != everyone[0]:
            raise MismatchError(
                f"{what}: ranks disagree — rank {group.ranks[0]} passed "
                f"{_describe(everyone[0])}, rank {group.ranks[index]} passed {_describe(other)}."
                f" Every rank must call the same collective with values of the same dtype and "
                f"shape (and the same root_rank), in the same order.")
    return [item[1] for item in gathered]


def _describe(description: Tuple) -> str:
    return ", ".join(f"{key}={value}" for key, value in description)


def _group(what: str, process_set) -> process_sets.Group:
    """The set a collective runs in; raises on a rank outside it (nothing waits for it)."""
    state.require()
    return process_sets.group_of(process_set, what)


def _span(what: str, group: process_sets.Group) -> str:
    suffix = f" (process set {group.process_set_id})" if group.process_set_id else ""
    return f"host {what}{suffix}"


def _check_root(root_rank: int, group: process_sets.Group, what: str) -> int:
    """`root_rank` (global) as a position in `group`."""
    if not 0 <= root_rank < state.size:
        raise ValueError(f"root_rank={root_rank} is not a rank of this job: expected "
                         f"0 <= root_rank < size() = {state.size}")
    return group.root_index(root_rank, what)


def allreduce(value: Any, op: ReduceOp = Average, process_set=None) -> Any:
    """Combine `value` across all ranks (or the ranks of `process_set`).

    Args:
        value: a Python number or numeric numpy array, same shape and dtype on every rank.
        op: ``Average`` (default; the result is floating point), ``Sum``, ``Min``, ``Max``
            or ``Product``.
        process_set: None (every rank) or a registered ``mgpu.ProcessSet``: only its members
            call this, and ``Average`` divides by its size.

    Returns:
        The combined value, of the same kind as `value` (Python number / numpy array).

    Raises:
        MismatchError: ranks passed different shapes or dtypes, or different ops.
        NotInProcessSetError: this rank is not in `process_set`.

    Example:
        >>> mgpu.allreduce(float(loss))           # mean loss over the ranks
    """
    if not isinstance(op, ReduceOp):
        raise ValueError(f"op={op!r}: expected one of mgpu.Average, mgpu.Sum, mgpu.Min, "
                         f"mgpu.Max, mgpu.Product")
    group = _group("allreduce", process_set)
    array, restore = _as_array(value, "allreduce")
    if group.transport is None:
        result = array.copy()
    else:
        _check_agreement("allreduce", (("dtype", array.dtype.str), ("shape", array.shape),
                                       ("op", op.value)), group=group)
        combine = op.value if op in (Min, Max, Product) else "sum"  # an average is a sum first
        with timeline.span(_span("allreduce", group), "collective"):
            result = group.transport.allreduce_array(array, combine)
    if op is Average:
        result = result / group.size
    return restore(result)


def allgather(value: Any, process_set=None) -> np.ndarray:
    """Concatenate every rank's array along axis 0, in rank order.

    Args:
        value: a number or numeric array; the first dimension may differ between ranks (ragged),
            the others and the dtype may not. A number counts as an array of one element.
        process_set: None (every rank) or a registered ``mgpu.ProcessSet``: its members'
            arrays, in the order of their ranks.

    Returns:
        A numpy array whose first dimension is the sum of the ranks' first dimensions.

    Raises:
        MismatchError: ranks passed different dtypes or trailing shapes.
        NotInProcessSetError: this rank is not in `process_set`.

    Example:
        >>> mgpu.allgather(np.arange(mgpu.rank() + 1))  # 2 ranks: [0, 0, 1]
    """
    group = _group("allgather", process_set)
    array, _ = _as_array(value, "allgather")
    array = array.reshape(1) if array.ndim == 0 else array
    if group.transport is None:
        return array.copy()
    rows = _check_agreement("allgather", (("dtype", array.dtype.str),
                                          ("shape[1:]", array.shape[1:])), array.shape[0],
                            group=group)
    with timeline.span(_span("allgather", group), "collective"):
        return group.transport.allgather_array(array, rows)


def broadcast(value: Any, root_rank: int = 0, process_set=None) -> Any:
    """Rank `root_rank`'s value, on every rank (of `process_set`).

    Args:
        value: a number or numeric array of the same shape and dtype on every rank (the
            non-root ranks' contents are ignored).
        root_rank: the (global) rank whose value everyone gets; a member of `process_set`.
        process_set: None (every rank) or a registered ``mgpu.ProcessSet``.

    Returns:
        A copy of the root's value, of the same kind as `value`.

    Raises:
        MismatchError: ranks passed different shapes, dtypes or roots.
        NotInProcessSetError: this rank is not in `process_set`.
        ValueError: `root_rank` is not a rank of the job (of the set).
    """
    group = _group("broadcast", process_set)
    root = _check_root(root_rank, group, "broadcast")
    array, restore = _as_array(value, "broadcast")
    if group.transport is None:
        return restore(array.copy())
    _check_agreement("broadcast", (("dtype", array.dtype.str), ("shape", array.shape),
                                   ("root_rank", root_rank)), group=group)
    with timeline.span(_span("broadcast", group), "collective"):
        return restore(group.transport.broadcast_array(array, root))


def broadcast_object(obj: Any, root_rank: int = 0, process_set=None) -> Any:
    """Rank `root_rank`'s picklable object, on every rank (of `process_set`), e.g. a config
    dict or an epoch. `root_rank` is a global rank."""
    group = _group("broadcast_object", process_set)
    root = _check_root(root_rank, group, "broadcast_object")
    if group.transport is None:
        return obj
    with timeline.span(_span("broadcast_object", group), "collective"):
        return group.transport.broadcast_object(obj, root)


def allgather_object(obj: Any, process_set=None) -> List[Any]:
    """Every rank's (every member's of `process_set`) picklable object, as a list in rank
    order."""
    group = _group("allgather_object", process_set)
    if group.transport is None:
        return [obj]
    with timeline.span(_span("allgather_object", group), "collective"):
        return group.transport.allgather_object(obj)


def barrier(process_set=None) -> None:
    """Wait until every rank (every member of `process_set`) has reached this call."""
    group = _group("barrier", process_set)
    if group.transport is not None:
        with timeline.span(_span("barrier", group), "collective"):
            group.transport.barrier()
