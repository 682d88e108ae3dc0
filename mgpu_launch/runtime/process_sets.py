"""Process sets: collectives within a subset of the job's ranks (Horovod's ``hvd.ProcessSet``).

A process set is a fixed, sorted list of global ranks. Once registered it has an id (0 is the
global set, every rank; the others count up from 1 in the order they are registered, the same
on every rank) and an MPI sub-communicator on its members, so that the host collectives
(``mgpu_launch.runtime.collectives``) and the engines' in-graph collectives can run within it
while other sets run theirs at the same time. Two ways to register sets, as with Horovod:

- static: ``init(process_sets=[ProcessSet([0, 2]), ProcessSet([1, 3])])`` on every rank;
- dynamic: ``init(process_sets="dynamic")`` (or ``MGPU_DYNAMIC_PROCESS_SETS=1``), then
  :func:`add_process_set` / :func:`remove_process_set` at any point, called by every rank of
  the job with the same ranks, in the same order (they are collectives over every rank).

Registration is a collective over the global communicator: the ranks first compare what they
were given, so a rank that passes other sets raises :class:`MismatchError` on every rank
instead of hanging in the sub-communicator's creation. A rank outside a set that calls a
collective on it gets :class:`NotInProcessSetError` at once (Horovod: "Rank r is not a
member of the provided process set"); it does not wait for the members.

The runtime layer only keeps the table and the communicators. Engines that need a handle of
their own per set (torch's ``new_group``) register a listener (:func:`add_listener`), which
is told about every set added or removed, on every rank.
"""

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from mgpu_launch.runtime.errors import MismatchError, NotInitializedError, NotInProcessSetError

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "NotInProcessSetError", "Group", "group_of", "registered", "add_listener"]


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

    def _entry(self) -> Optional["Group"]:
        """The registered group this object stands for, or None."""
        found = _table.get(self.process_set_id)
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
        return entry.index(_own_rank(), f"{self}.rank()")

    def included(self) -> Optional[bool]:
        """Whether this process is in the set; None while it is not registered."""
        return None if self._entry() is None else _own_rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """``global_process_set``: every rank of the job, id 0, registered by ``init()``."""

    def __init__(self):  # pylint: disable=super-init-not-called
        self.process_set_id = 0

    @property
    def ranks(self) -> List[int]:
        group = _table.get(0)
        return list(group.ranks) if group is not None else []

    def _entry(self) -> Optional["Group"]:
        return _table.get(0)


#: every rank of the job (Horovod's ``hvd.global_process_set``)
global_process_set = _GlobalProcessSet()


@dataclasses.dataclass(frozen=True)
class Group:
    """A registered process set as the collectives see it.

    Attributes:
        process_set_id: its id (0: every rank).
        ranks: its sorted global ranks.
        comm: its MPI communicator on a member (the runtime's global one for id 0); None on a
            non-member and on a one-process job.
    """

    process_set_id: int
    ranks: Tuple[int, ...]
    comm: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, global_rank: int, what: str) -> int:
        """`global_rank`'s position in the set.

        Raises:
            NotInProcessSetError: `global_rank` is not in the set (`what` names the call).
        """
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise NotInProcessSetError(
                f"{what}: rank {global_rank} is not a member of process set "
                f"{self.process_set_id} (ranks {list(self.ranks)}). Only its members may "
                f"call collectives on it: test process_set.included() first.") from None

    def root_index(self, root_rank: int, what: str) -> int:
        """The position of `root_rank` (a global rank, as Horovod's ``root_rank``) in the set.

        Raises:
            ValueError: `root_rank` is not a member of the set.
        """
        if root_rank not in self.ranks:
            raise ValueError(f"{what}: root_rank={root_rank} is not a member of process set "
                             f"{self.process_set_id} (ranks {list(self.ranks)}): root_rank is a "
                             f"global rank, and must be one of the set's")
        return self.ranks.index(root_rank)


#: id -> registered group; filled by init() (id 0 and the static sets), emptied by shutdown()
_table: Dict[int, Group] = {}
_dynamic = False
_next_id = 1
_comm = None  # the runtime's global communicator (None on one process)
_rank = 0
Listener = Tuple[Callable[[Group], None], Callable[[Group], None]]
_listeners: List[Listener] = []


def _own_rank() -> int:
    return _rank


def add_listener(added: Callable[[Group], None], removed: Callable[[Group], None]) -> None:
    """Call ``added(group)`` for every set registered from now on (and now, for those already
    registered other than the global one), ``removed(group)`` for every set removed; on
    every rank, members or not, in registration order (an engine's ``new_group`` needs all)."""
    if (added, removed) in _listeners:
        return
    _listeners.append((added, removed))
    for process_set_id in sorted(_table):
        if process_set_id:
            added(_table[process_set_id])


def remove_listener(added: Callable[[Group], None], removed: Callable[[Group], None]) -> None:
    """Stop calling a pair given to :func:`add_listener` (an engine's shutdown)."""
    if (added, removed) in _listeners:
        _listeners.remove((added, removed))


def registered() -> List[Group]:
    """Every registered set, the global one first, in id order."""
    return [_table[key] for key in sorted(_table)]


def start(state, process_sets, dynamic: bool) -> None:
    """Called by ``init()`` once MPI is up: register the global set and `process_sets`.

    Args:
        state: the runtime state (rank, size, comm).
        process_sets: None, or a list of :class:`ProcessSet` (the same on every rank).
        dynamic: allow :func:`add_process_set` / :func:`remove_process_set` later.
    """
    global _dynamic, _next_id, _comm, _rank
    _comm, _rank, _dynamic, _next_id = state.comm, state.rank, bool(dynamic), 1
    _table.clear()
    _table[0] = Group(0, tuple(range(state.size)), state.comm)
    if process_sets is not None and not isinstance(process_sets, (list, tuple)):
        raise ValueError(f"init(process_sets={process_sets!r}): expected a list of "
                         f"mgpu.ProcessSet, or 'dynamic'")
    sets = list(process_sets or ())
    for item in sets:
        if not isinstance(item, ProcessSet) or isinstance(item, _GlobalProcessSet):
            raise ValueError(f"init(process_sets=...): expected a list of mgpu.ProcessSet (or "
                             f"'dynamic'), got {item!r} in it. Build each with "
                             f"ProcessSet([ranks]).")
    seen = {}
    for position, item in enumerate(sets):
        _check_ranks(item.ranks, state.size, "init(process_sets=...)")
        key = tuple(item.ranks)
        if key in seen or key == _table[0].ranks:
            other = "the global process set" if key == _table[0].ranks else \
                f"entry number {seen[key]}"
            raise ValueError(f"init(process_sets=...): entry number {position}, {item}, has "
                             f"the same ranks as {other}. Pass each set of ranks once.")
        seen[key] = position
    _agree("init(process_sets=...)", [item.ranks for item in sets])
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
        if process_sets.lower() == "dynamic" and not _dynamic:
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
    """Called by ``shutdown()`` before the global communicator goes: free every set's."""
    global _comm
    for process_set_id in sorted(_table, reverse=True):
        if process_set_id:
            _unregister(process_set_id)
    _table.clear()
    _comm = None


def _check_ranks(ranks: Sequence[int], size: int, what: str) -> None:
    outside = [r for r in ranks if r >= size]
    if outside:
        raise ValueError(f"{what}: ranks {outside} are not ranks of this job of {size} "
                         f"processes (expected 0 .. {size - 1})")


def _agree(what: str, description) -> None:
    """Raise MismatchError on every rank unless all passed the same `description`."""
    if _comm is None:
        return
    everyone = _comm.allgather(description)
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            raise MismatchError(
                f"{what}: ranks disagree — rank 0 passed {everyone[0]}, rank {rank} passed "
                f"{other}. Every rank must register the same process sets, in the same order.")


def _register(process_set: ProcessSet) -> None:
    global _next_id
    process_set_id, _next_id = _next_id, _next_id + 1
    comm = None
    if _comm is not None:
        from mpi4py import MPI
        member = _rank in process_set.ranks
        # Split is collective over every rank: non-members get COMM_NULL and keep nothing.
        sub = _comm.Split(color=0 if member else MPI.UNDEFINED, key=_rank)
        comm = sub if member else None
    group = Group(process_set_id, tuple(process_set.ranks), comm)
    _table[process_set_id] = group
    process_set.process_set_id = process_set_id
    for added, _ in list(_listeners):
        added(group)


def _unregister(process_set_id: int) -> None:
    group = _table.pop(process_set_id)
    for _, removed in list(_listeners):
        removed(group)
    if group.comm is not None:
        from mpi4py import MPI
        if not MPI.Is_finalized():
            group.comm.Free()


def _require_initialized(what: str) -> None:
    if 0 not in _table:
        raise NotInitializedError(f"{what} before mgpu.init(): call init() first (with "
                                  f"process_sets='dynamic' to add sets later)")


def _require_dynamic(what: str) -> None:
    if not _dynamic:
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
    _check_ranks(process_set.ranks, _table[0].size, "add_process_set")
    _agree("add_process_set", process_set.ranks)
    duplicate = [g for g in _table.values() if list(g.ranks) == process_set.ranks]
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
    _agree("remove_process_set", process_set.process_set_id if known else None)
    if not known:
        return False
    _unregister(process_set.process_set_id)
    process_set.process_set_id = None
    return True


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
        return _table[0]
    if isinstance(process_set, Group):  # resolved before (an engine's, an optimizer's)
        if member:
            process_set.index(_rank, what)
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
        group.index(_rank, what)
    return group
