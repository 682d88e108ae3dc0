"""The table of registered process sets: one :class:`Group` per set, its group of the transport,
and the listeners (engines) told of every set added or removed.

``mgpu_launch.runtime.process_sets`` is the API (``ProcessSet``, ``add_process_set``, ...);
this module only keeps what every rank registered, in the same order: ids count up from 1 and
are never reused while the job runs, so an id names one set of ranks on every rank (the
TensorFlow engine derives its group keys from them).
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mgpu_launch.runtime.errors import MismatchError, NotInProcessSetError


@dataclasses.dataclass(frozen=True)
class Group:
    """A registered process set as the collectives see it.

    Attributes:
        process_set_id: its id (0: every rank).
        ranks: its sorted global ranks.
        transport: its sub-group of the control plane on a member (the runtime's global one
            for id 0; mgpu_launch.runtime.transport); None on a non-member and on a one-process
            job.
    """

    process_set_id: int
    ranks: Tuple[int, ...]
    transport: Any = None

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


@dataclasses.dataclass
class _Job:
    """What the table needs of the runtime, set by ``init()``."""

    rank: int = 0
    transport: Any = None  # the runtime's global transport (None on one process)
    dynamic: bool = False
    next_id: int = 1


#: id -> registered group; id 0 and the static sets from init(), emptied by shutdown()
_table: Dict[int, Group] = {}
_job = _Job()
Listener = Tuple[Callable[[Group], None], Callable[[Group], None]]
_listeners: List[Listener] = []


def reset(rank: int, size: int, transport, dynamic: bool) -> None:
    """``init()``: forget every set, register the global one (id 0)."""
    _table.clear()
    vars(_job).update(vars(_Job(rank, transport, bool(dynamic))))
    _table[0] = Group(0, tuple(range(size)), transport)


def clear() -> None:
    """``shutdown()``, before the global transport goes: close every set's."""
    for process_set_id in sorted(_table, reverse=True):
        if process_set_id:
            unregister(process_set_id)
    _table.clear()
    _job.transport = None


def ready() -> bool:
    """Whether ``init()`` registered the global set (and not ``shutdown()`` removed it)."""
    return 0 in _table


def lookup(process_set_id: Optional[int]) -> Optional[Group]:
    """The registered group of that id, or None."""
    return _table.get(process_set_id)


def registered() -> List[Group]:
    """Every registered set, the global one first, in id order."""
    return [_table[key] for key in sorted(_table)]


def own_rank() -> int:
    return _job.rank


def dynamic() -> bool:
    """Whether sets may be added and removed after ``init()``."""
    return _job.dynamic


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


def agree(what: str, description) -> None:
    """Raise MismatchError on every rank unless all passed the same `description`."""
    if _job.transport is None:
        return
    everyone = _job.transport.allgather_object(description)
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            raise MismatchError(
                f"{what}: ranks disagree — rank 0 passed {everyone[0]}, rank {rank} passed "
                f"{other}. Every rank must register the same process sets, in the same order.")


def register(ranks: Sequence[int]) -> Group:
    """A new set of `ranks` (checked by the caller) on every rank: its id, its transport;
    the listeners are told. A collective over every rank."""
    process_set_id, _job.next_id = _job.next_id, _job.next_id + 1
    sub = None
    if _job.transport is not None:
        # split is collective over every rank: non-members pass no color and keep nothing
        sub = _job.transport.split(color=0 if _job.rank in ranks else None, key=_job.rank)
    group = Group(process_set_id, tuple(ranks), sub)
    _table[process_set_id] = group
    for added, _ in list(_listeners):
        added(group)
    return group


def unregister(process_set_id: int) -> None:
    """Forget a set (every rank): the listeners are told, its transport closed."""
    group = _table.pop(process_set_id)
    for _, removed in list(_listeners):
        removed(group)
    if group.transport is not None:
        group.transport.close()
