"""Process sets: collectives within a subset of the job's ranks (Horovod's ``hvd.ProcessSet``).

A process set is a fixed, sorted list of global ranks. Once registered it has an id (0 is the
global set, every rank; the others count up from 1 in the order they are registered, the same
on every rank) and a sub-group of the control plane on its members, so that the host collectives
(``mgpu_launch.runtime.collectives``) and the engines' in-graph collectives can run within it
while other sets run theirs at the same time. Two ways to register sets, as with Horovod:

- static: ``init(process_sets=[ProcessSet([0, 2]), ProcessSet([1, 3])])`` on every rank;
- dynamic: ``init(process_sets="dynamic")`` (or ``MGPU_DYNAMIC_PROCESS_SETS=1``), then
  :func:`add_process_set` / :func:`remove_process_set` at any point, called by every rank of
  the job with the same ranks, in the same order (they are collectives over every rank).

Registration is a collective over the global transport: the ranks first compare what they
were given, so a rank that passes other sets raises :class:`MismatchError` on every rank
instead of hanging in the sub-group's creation. A rank outside a set that calls a
collective on it gets :class:`NotInProcessSetError` at once (Horovod: "Rank r is not a
member of the provided process set"); it does not wait for the members.

The runtime layer only keeps the table and the sub-groups
(``mgpu_launch.runtime.process_set_table``). Engines that need a handle of their own per set
(torch's ``new_group``) register a listener (:func:`add_listener`), which is told about every
set added or removed, on every rank.
"""

from typing import Iterable, List, Optional, Sequence, Union

from mgpu_launch.runtime import process_set_table as table
from mgpu_launch.runtime.errors import NotInitializedError, NotInProcessSetError
from mgpu_launch.runtime.process_set_table import (Group, add_listener, registered,
                                                   remove_listener)

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "NotInProcessSetError", "Group", "group_of", "with_ranks", "registered", "add_listener",
           "remove_listener"]


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Args:
        ranks: the global ranks of the set (any order; kept sorted). An mpi4py communicator is
            not accepted: the ranks list says the same on every rank.

    Attributes:
        process_set_id: None until registered (``init(process_sets=...)`` or
            :func:`add_process_set`); None again after :func:`remove_process_set`.
        ranks: the sorted global ranks.

    Raises:
        ValueError: `ranks` is not a non-empty list of distinct non-negative integers.

    Example:
        >>> even, odd = mgpu.ProcessSet([0, 2]), mgpu.ProcessSet([1, 3])
        >>> mgpu.init(process_sets=[even, odd])
        >>> if even.included():
        ...     total = mgpu.allreduce(value, op=mgpu.Sum, process_set=even)
    """

    def __init__(self, ranks: Iterable[int]):
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise ValueError(f"ProcessSet({ranks!r}): expected a list of global ranks, e.g. "
                             f"ProcessSet([0, 2]) (an MPI communicator is not accepted: pass "
                             f"the ranks it holds)")
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if not ranks or bad or len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet({ranks!r}): expected a non-empty list of distinct "
                             f"global ranks (integers >= 0), e.g. ProcessSet([0, 2])")
        self.ranks: Optional[List[int]] = sorted(ranks)
        self.process_set_id: Optional[int] = None

    def _entry(self) -> Optional[Group]:
        """The registered group this object stands for, or None."""
        found = table.lookup(self.process_set_id)
        return found if found is not None and list(found.ranks) == self.ranks else None

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None while it is not registered."""
        return None if self._entry() is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's position in the set (0 .. size() - 1); None while it is not registered.

        Collectives still take global ranks (``root_rank``); this is the position of this
        rank's rows in an allgather over the set.

        Raises:
            NotInProcessSetError: this process is not in the set.
        """
        entry = self._entry()
        if entry is None:
            return None
        return entry.index(table.own_rank(), f"{self}.rank()")

    def included(self) -> Optional[bool]:
        """Whether this process is in the set; None while it is not registered."""
        return None if self._entry() is None else table.own_rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """``global_process_set``: every rank of the job, id 0, registered by ``init()``."""

    def __init__(self):  # pylint: disable=super-init-not-called
        self.process_set_id = 0

    @property
    def ranks(self) -> List[int]:
        group = table.lookup(0)
        return list(group.ranks) if group is not None else []

    def _entry(self) -> Optional[Group]:
        return table.lookup(0)


#: every rank of the job (Horovod's ``hvd.global_process_set``)
global_process_set = _GlobalProcessSet()


def start(state, process_sets, dynamic: bool) -> None:
    """Called by ``init()`` once the transport is up: register the global set and `process_sets`.

    Args:
        state: the runtime state (rank, size, transport).
        process_sets: None, or a list of :class:`ProcessSet` (the same on every rank).
        dynamic: allow :func:`add_process_set` / :func:`remove_process_set` later.
    """
    table.reset(state.rank, state.size, state.transport, dynamic)
    everyone = table.lookup(0).ranks
    if process_sets is not None and not isinstance(process_sets, (list, tuple)):
        raise ValueError(f"init(process_sets={process_sets!r}): expected a list of "
                         f"mgpu.ProcessSet, or 'dynamic'")
    sets = list(process_sets or ())
    for item in sets:
        if isinstance(item, _GlobalProcessSet):
            raise ValueError("init(process_sets=...): the global process set is registered "
                             "always (id 0); leave it out of the list")
        if not isinstance(item, ProcessSet):
            raise ValueError(f"init(process_sets=...): expected a list of mgpu.ProcessSet (or "
                             f"'dynamic'), got {item!r} in it. Build each with "
                             f"ProcessSet([ranks]).")
    seen = {}
    for position, item in enumerate(sets):
        _check_ranks(item.ranks, state.size, "init(process_sets=...)")
        key = tuple(item.ranks)
        if key in seen or key == everyone:
            other = "the global process set" if key == everyone else \
                f"entry number {seen[key]}"
            raise ValueError(f"init(process_sets=...): entry number {position}, {item}, has "
                             f"the same ranks as {other}. Pass each set of ranks once.")
        seen[key] = position
    table.agree("init(process_sets=...)", [item.ranks for item in sets])
    for item in sets:
        _register(item)


def check_registered(process_sets) -> None:
    """``init(process_sets=...)`` called again: fine when it asks for nothing new.

    Raises:
        ValueError: it names sets that are not registered, or asks for dynamic sets that the
            first ``init()`` did not switch on.
    """
    if process_sets is None:
        return
    if isinstance(process_sets, str):
        if process_sets.lower() == "dynamic" and not table.dynamic():
            raise ValueError("init(process_sets='dynamic') after the job was initialized "
                             "without it: pass it to the first init() call (or set "
                             "MGPU_DYNAMIC_PROCESS_SETS=1)")
        return
    late = [item for item in process_sets
            if not isinstance(item, ProcessSet) or item._entry() is None]
    if late:
        raise ValueError(f"init(process_sets=...) after the job was initialized: {late[0]!r} "
                         f"is not registered. Pass the sets to the first init() call, or use "
                         f"init(process_sets='dynamic') and add_process_set.")


def stop() -> None:
    """Called by ``shutdown()`` before the global transport goes: close every set's."""
    table.clear()


def _check_ranks(ranks: Sequence[int], size: int, what: str) -> None:
    outside = [r for r in ranks if r >= size]
    if outside:
        raise ValueError(f"{what}: ranks {outside} are not ranks of this job of {size} "
                         f"processes (expected 0 .. {size - 1})")


def _register(process_set: ProcessSet) -> None:
    process_set.process_set_id = table.register(process_set.ranks).process_set_id


def _require_initialized(what: str) -> None:
    if not table.ready():
        raise NotInitializedError(f"{what} before mgpu.init(): call init() first (with "
                                  f"process_sets='dynamic' to add sets later)")


def _require_dynamic(what: str) -> None:
    if not table.dynamic():
        raise ValueError(
            f"{what} needs dynamic process sets: call init(process_sets='dynamic') or set "
            f"MGPU_DYNAMIC_PROCESS_SETS=1 (under the Horovod names also "
            f"HOROVOD_DYNAMIC_PROCESS_SETS=1), or pass the sets to init(process_sets=[...])")


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set after ``init()`` (Horovod's ``hvd.add_process_set``).

    A collective over every rank of the job: call it on every rank, with the same ranks, in
    the same order as the other registrations.

    Args:
        process_set: a :class:`ProcessSet` not registered yet, or a list of global ranks.

    Returns:
        The registered :class:`ProcessSet` (`process_set` itself when one was given).

    Raises:
        ValueError: dynamic process sets are off, the ranks are not ranks of the job, or a
            registered set (the global one included) has the same ranks.
        MismatchError: the ranks passed other sets.

    Example:
        >>> mgpu.init(process_sets="dynamic")
        >>> even = mgpu.add_process_set([0, 2])
    """
    _require_initialized("add_process_set")
    _require_dynamic("add_process_set")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if isinstance(process_set, _GlobalProcessSet) or process_set._entry() is not None:
        raise ValueError(f"add_process_set: {process_set} is registered already")
    _check_ranks(process_set.ranks, table.lookup(0).size, "add_process_set")
    table.agree("add_process_set", process_set.ranks)
    duplicate = [g for g in table.registered() if list(g.ranks) == process_set.ranks]
    if duplicate:
        raise ValueError(f"add_process_set: attempted to add a duplicate process set: "
                         f"process set {duplicate[0].process_set_id} has the ranks "
                         f"{process_set.ranks} already. Use that one.")
    _register(process_set)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set added before (Horovod's ``hvd.remove_process_set``); a collective over
    every rank, like :func:`add_process_set`. Its object's ``process_set_id`` becomes None.

    Returns:
        True when it was removed; False for the global set and for a set not registered.

    Raises:
        ValueError: dynamic process sets are off.
        MismatchError: the ranks passed other sets.

    Example:
        >>> mgpu.remove_process_set(even)
        True
    """
    _require_initialized("remove_process_set")
    _require_dynamic("remove_process_set")
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"remove_process_set({process_set!r}): expected a ProcessSet that "
                         f"add_process_set or init returned")
    known = process_set._entry() is not None and process_set.process_set_id != 0
    table.agree("remove_process_set", process_set.process_set_id if known else None)
    if not known:
        return False
    table.unregister(process_set.process_set_id)
    process_set.process_set_id = None
    return True


def with_ranks(ranks: Sequence[int]) -> ProcessSet:
    """The registered set of `ranks` (a model saved with it, loaded again), or an unregistered
    :class:`ProcessSet` of them when none is: a collective on that one raises ``group_of``'s
    "not registered" error, which says how to register it.

    Example:
        >>> with_ranks([0, 2])
        ProcessSet(process_set_id=1, ranks=[0, 2])
    """
    found = ProcessSet(ranks)
    if table.ready():
        for group in registered():
            if group.process_set_id and list(group.ranks) == found.ranks:
                found.process_set_id = group.process_set_id
    return found


def group_of(process_set: Optional[ProcessSet], what: str, member: bool = True) -> Group:
    """The registered group behind `process_set` (None: the global set).

    Args:
        process_set: a registered :class:`ProcessSet`, ``global_process_set``, None, or a
            :class:`Group` resolved before.
        what: the calling collective, for the messages.
        member: require this rank to be in the set (every collective does).

    Raises:
        ValueError: `process_set` is not a ProcessSet, or is not registered (or removed).
        NotInProcessSetError: `member` and this rank is not in the set.
    """
    _require_initialized(what)
    if process_set is None:
        return table.lookup(0)
    if isinstance(process_set, Group):  # resolved before (an engine's, an optimizer's)
        if member:
            process_set.index(table.own_rank(), what)
        return process_set
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{what}: process_set={process_set!r} is not a process set: pass "
                         f"mgpu.global_process_set or a ProcessSet registered with "
                         f"init(process_sets=[...]) or add_process_set")
    group = process_set._entry()
    if group is None:
        raise ValueError(f"{what}: {process_set} is not registered (or was removed): "
                         f"register it with init(process_sets=[...]) or add_process_set "
                         f"before using it")
    if member:
        group.index(table.own_rank(), what)
    return group
