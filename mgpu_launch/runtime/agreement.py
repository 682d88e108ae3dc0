"""One rank decides, every rank raises alike: the pattern that keeps a refusal from hanging.

When only rank 0 may read something (a backup folder, an elastic commit), or every rank
prepares something on its own (the efficiency report's timed reduction), a failure on one rank
must become the same error on every rank; otherwise the others wait in the next collective for
a rank that already left. The two shapes, each in one function here:

- :func:`decided_by_root`: rank 0 runs the work; its result, or the kind and message of the
  refusal it met, is broadcast as ``(kind, detail)``; every rank returns the result or raises
  the error made from that kind.
- :func:`raise_any_rank`: every rank reports its own failure ("" for none); the ranks gather
  them and every rank raises the first rank's.

Both are collectives over the `transport` they are given (the runtime's,
``mgpu_launch.runtime.state.transport``, or a process set's; None on a one-process job, where
rank 0 alone decides): call them on every rank of it alike. The runtime's own meetings use
them too: the stall inspector's and the engines' rendezvous addresses
(mgpu_launch.runtime.stall, mgpu_launch.runtime.rendezvous).
"""

from typing import Any, Callable, List, Mapping, Optional, Tuple, Type

from mgpu_launch.runtime.transport import Transport

__all__ = ["decided_by_root", "raise_any_rank", "failures"]

#: the kind of a successful outcome in the broadcast (kind, detail) pair
_DONE = "done"


def decided_by_root(transport: Optional[Transport], work: Callable[[], Any],
                    refusals: Mapping[Type[BaseException], Callable[[str], BaseException]]) -> Any:
    """`work()` on rank 0; its result on every rank, or the same error raised on every rank.

    Args:
        transport: the ranks that agree (rank 0 of it decides); None: this process alone.
        work: what rank 0 alone runs; its result must pickle (it is broadcast).
        refusals: each exception type `work` may raise for a refusal -> the error every rank
            raises, made from the refusal's message. The first type in the mapping that the
            exception is an instance of decides. Other exceptions are not caught: they are
            bugs, and rank 0 raises them alone.

    Returns:
        `work`'s result, on every rank.

    Raises:
        The error the matching refusal makes, on every rank.

    Example:
        >>> found = decided_by_root(runtime.state.transport, lambda: read_newest(folder), {
        ...     folders.UnsafeFolder: lambda why: PermissionError(f"refused: {why}")})
    """
    kinds = list(refusals)
    outcome = None
    if transport is None or transport.rank == 0:
        try:
            outcome = (_DONE, work())
        except tuple(kinds) as error:
            kind = next(i for i, cls in enumerate(kinds) if isinstance(error, cls))
            outcome = (kind, str(error))
    if transport is not None:
        outcome = transport.broadcast_object(outcome, 0)
    kind, detail = outcome
    if kind == _DONE:
        return detail
    raise refusals[kinds[kind]](detail)


def failures(transport: Optional[Transport], failure: str) -> List[Tuple[int, str]]:
    """Every rank's failure that is not "", as ``(rank, failure)`` in rank order, on every
    rank (a collective): what :func:`raise_any_rank` raises from, for a caller whose error
    also counts the failed ranks."""
    everyone = transport.allgather_object(failure) if transport is not None else [failure]
    return [(rank, found) for rank, found in enumerate(everyone) if found]


def raise_any_rank(transport: Optional[Transport], failure: str,
                   make: Callable[[int, str], BaseException]) -> None:
    """Raise on every rank when any rank failed: `make(first failing rank, its failure)`.

    Args:
        transport: the ranks that agree; None: this process alone.
        failure: this rank's failure, one line ("" for none).
        make: the error every rank raises, from the first failing rank and its failure.

    Example:
        >>> raise_any_rank(runtime.state.transport, failure,
        ...                lambda rank, why: RuntimeError(f"rank {rank}: {why}"))
    """
    failed = failures(transport, failure)
    if failed:
        raise make(*failed[0])
