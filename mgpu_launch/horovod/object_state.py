"""Horovod's ``ObjectState``: an elastic state of plain Python values, no model.

    import mgpu_launch.tensorflow as hvd        # or mgpu_launch.keras

    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, best=0.0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

As Horovod's, the keyword arguments are the state's attributes; ``commit()`` takes a snapshot
that ``restore()`` puts back and ``sync()`` gives every rank rank 0's values. Here a commit is
also written to disk by rank 0 (:mod:`mgpu_launch.horovod.elastic_store`), because a failure
or a resize restarts every process and ``run`` starts the new job from the last commit. So the
attributes are JSON values (numbers, strings, booleans, None, lists, dicts), read back as data.
``TensorFlowState`` (``mgpu_launch.tensorflow.elastic``) adds a list of variables to it.
"""

import copy
from typing import Callable, List, Optional

import numpy as np

from mgpu_launch import runtime
from mgpu_launch.horovod.elastic_state import State
from mgpu_launch.horovod.elastic_store import CommitStore
from mgpu_launch.runtime import collectives
from mgpu_launch.training import resize, stall_probes
from mgpu_launch.config import settings

__all__ = ["ObjectState", "STATE_DIR_VARIABLE", "DEFAULT_DIR"]

STATE_DIR_VARIABLE = "MGPU_ELASTIC_STATE_DIR"
DEFAULT_DIR = ".mgpu-elastic-state"


def state_dir(backup_dir: Optional[str]) -> str:
    """Where a state keeps its commits: `backup_dir`, else ``$MGPU_ELASTIC_STATE_DIR``, else
    ``.mgpu-elastic-state`` in the working folder."""
    return backup_dir or settings.text(STATE_DIR_VARIABLE) or DEFAULT_DIR


class ObjectState(State):
    """Horovod's ``ObjectState``: plain values committed, restored and synced across ranks.

    Args:
        bcast_object: the function :meth:`sync` sends rank 0's attributes with, as Horovod's
            (``hvd.broadcast_object``); default: mgpu's host broadcast (the same).
        get_rank: Horovod's rank function; accepted for Horovod's signature, not needed
            (rank 0 writes the commits).
        backup_dir: where rank 0 keeps the commits (default: ``$MGPU_ELASTIC_STATE_DIR``,
            else ``.mgpu-elastic-state`` in the working folder). It must be rank 0's user's
            alone; :func:`run` deletes it when the training function returns.
        **kwargs: the attributes, e.g. ``epoch=0, batch=0`` (JSON values). A restore from
            disk sets only these, each to a value of the kind it was declared with (a number,
            a string, ...; any JSON value for one declared None).

    Raises:
        TypeError: `bcast_object` or `get_rank` is not callable.
        ValueError: an attribute's name is the state's own (``backup_dir``, a method, a name
            starting with ``_``).

    Example:
        >>> state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, batch=0)
        >>> state.epoch = 3; state.restore(); state.epoch
        0
    """

    def __init__(self, bcast_object: Optional[Callable] = None,
                 get_rank: Optional[Callable] = None, backup_dir: Optional[str] = None,
                 **kwargs):
        kind = type(self).__name__
        for name, function in (("bcast_object", bcast_object), ("get_rank", get_rank)):
            if function is not None and not callable(function):
                raise TypeError(f"{kind}: {name}={function!r} is not callable; pass Horovod's "
                                f"function (hvd.broadcast_object, hvd.rank) or leave it out")
        self._declare(kwargs)
        self._bcast_object = bcast_object or collectives.broadcast_object
        self.backup_dir = state_dir(backup_dir)
        self._store = CommitStore(self.backup_dir, kind)
        self._snapshot = self._take_snapshot()

    # -- what TensorFlowState adds: the variables (none here) --------------------------------
    def _arrays(self) -> List[np.ndarray]:
        """The tracked variables' values, as host arrays."""
        return []

    def _variable_names(self) -> List[str]:
        """The tracked variables' names, for messages."""
        return []

    def _assign(self, arrays: List[np.ndarray]) -> None:
        """Give the tracked variables `arrays`' values."""

    def _broadcast_variables(self) -> None:
        """Give every rank rank 0's variables (collective)."""

    # -- Horovod's State ----------------------------------------------------------------------
    def _take_snapshot(self):
        """Copies of the variables' values and of the attributes (this process's memory)."""
        return ([np.array(value, copy=True) for value in self._arrays()],
                copy.deepcopy(self._values()))

    def commit(self) -> None:
        """Take the snapshot :meth:`restore` returns to and write it to disk (rank 0,
        atomic); stop here if mgpu-train asked the job to resize.

        Call it on every rank at the same point (a collective runs in elastic jobs).

        Raises:
            ValueError: an attribute is not JSON data (nothing is committed).
            SystemExit: status 0 on every rank when mgpu-train asked the job to resize.
        """
        values = self._json_values()
        self._snapshot = self._take_snapshot()
        self._store.save(values, self._snapshot[0])
        # A custom loop has no fit to tell mgpu-train that training got going: a failure
        # after a commit resumes from it, so it is worth a restart.
        stall_probes.report_progress()
        resize.stop_here_if_asked(self._position())

    def restore(self) -> None:
        """Undo every change since the last :meth:`commit`, :meth:`sync` or the state's
        creation (Horovod's): the attributes (and variables) get the snapshot's values. This
        process's memory only: no collective, nothing read from disk."""
        arrays, values = self._snapshot
        self._assign([np.array(value, copy=True) for value in arrays])
        self._set_values(values)

    def sync(self) -> None:
        """Give every rank rank 0's current attributes (and variables), then take the snapshot
        :meth:`restore` returns to. Call it on every rank."""
        if runtime.is_multi_process():
            self._broadcast_variables()
            received = self._bcast_object(self._values())
            if not isinstance(received, dict) or sorted(received) != self._names:
                raise ValueError(f"{type(self).__name__}.sync: bcast_object returned "
                                 f"{type(received).__name__} {received!r:.200}, expected the "
                                 f"dict of attributes {self._names} it was given")
            self._set_values(received)
        self._snapshot = self._take_snapshot()

    def _load_commit(self) -> Optional[int]:
        """Load the last commit from disk and make it the snapshot; the size of the job that
        wrote it, or None if there is none. Collective: call it on every rank. The variables
        are set on rank 0 (:meth:`sync`, which :func:`run` calls next, sends them on)."""
        loaded = self._store.load_everywhere(self._checked, self._arrays(),
                                             self._variable_names())
        if loaded is None:
            return None
        written_by, values, arrays = loaded
        if arrays is not None:
            self._assign(arrays)
        self._set_values(values)  # only declared names: _checked refused any other
        self._snapshot = self._take_snapshot()
        return written_by

    def _delete_commits(self) -> None:
        self._store.delete()
