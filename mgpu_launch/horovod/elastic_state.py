"""What every ``hvd.elastic`` state shares: declared attributes read back as data, reset
callbacks, and ``@hvd.elastic.run``.

A state here (``KerasState``, ``TensorFlowKerasState``, ``ObjectState``, ``TensorFlowState``)
keeps Horovod's in-memory contract — a snapshot taken at creation, at every ``commit()`` and
``sync()``, which ``restore()`` puts back — and also writes each commit to disk (rank 0, in a
folder of its user's alone), because mgpu-train restarts every process after a failure or a
resize. :func:`run` loads the last commit when a job starts. What comes back from disk is data:
a restore sets only the attributes the state declares, each checked against the kind it was
declared with (:meth:`State._checked`); nothing restored names a path mgpu acts on.

This module imports no deep-learning framework.
"""

import copy
import functools
import math
from typing import Any, Callable, Optional

from mgpu_launch import runtime
from mgpu_launch.runtime import collectives

__all__ = ["State", "run", "check_json"]

# JSON kinds an attribute's restored value must keep (int and float are both numbers).
_KINDS = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
          (list, "a list"), (dict, "a dict"))


def size() -> int:
    """The job's number of processes (1 before ``init()``)."""
    return runtime.size() if runtime.is_initialized() else 1


def is_chief() -> bool:
    return runtime.state.rank == 0


def check_json(value: Any, name: str, depth: int = 0) -> None:
    """Raise ValueError unless `value` is plain JSON data with finite numbers.

    Args:
        value: the value to check.
        name: its name, for the message.
        depth: how deep `value` sits in the value checked first (at most 32).

    Raises:
        ValueError: a value of another type, a number that is not finite, nesting past 32.
    """
    if depth > 32:
        raise ValueError(f"{name} is nested more than 32 deep")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name}={value!r}, expected a finite number")
    if isinstance(value, list):
        for item in value:
            check_json(item, name, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{name} has the key {key!r}, not a string")
            check_json(item, f"{name}[{key!r}]", depth + 1)
    elif value is not None and not isinstance(value, (bool, int, float, str)):
        raise ValueError(f"{name} holds a {type(value).__name__}, not JSON data")


class State:
    """The attribute half of an elastic state: names declared once, values checked as data.

    Subclasses call :meth:`_declare` in ``__init__`` and provide what :func:`run` calls:
    ``_load_commit()`` (the size of the job that wrote the commit it loaded, or None),
    ``sync()`` and ``_delete_commits()``.
    """

    #: names an attribute may not take (besides methods and names starting with "_")
    RESERVED = frozenset({"backup_dir"})
    #: attributes restored only as whole numbers >= 0 (KerasState's epoch and batch)
    WHOLE = ()

    def _declare(self, attributes: dict, defaults: Optional[dict] = None) -> None:
        """Set `attributes` (and `defaults` not among them) as the state's declared ones.

        Raises:
            ValueError: a name is the state's own.
        """
        kind = type(self).__name__
        taken = sorted(name for name in attributes if name in self.RESERVED
                       or name.startswith("_") or hasattr(type(self), name))
        if taken:
            raise ValueError(f"{kind}: the attribute names {taken} are the state's own; "
                             f"give your attributes other names (e.g. my_{taken[0]})")
        values = {**(defaults or {}), **attributes}
        self._names = sorted(values)
        for name, value in values.items():
            setattr(self, name, value)
        self._reset_callbacks = []

    def _values(self) -> dict:
        return {name: getattr(self, name) for name in self._names}

    def _json_values(self) -> dict:
        """The attributes, checked to be JSON data before a commit writes them.

        Raises:
            ValueError: an attribute is not JSON data with finite numbers.
        """
        values = self._values()
        try:
            for name, value in values.items():
                check_json(value, name)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}.commit: {error}; the attributes a commit "
                             f"writes must be JSON data (numbers, strings, booleans, None, "
                             f"lists, dicts with string keys) with finite numbers") from None
        return values

    def _checked(self, restored: Any) -> dict:
        """The attributes of a commit, checked as data: declared names, declared kinds.

        Raises:
            ValueError: an unknown name, a value of another kind, a negative or fractional
                whole-number attribute, a non-finite number (the commit is then refused).
        """
        if not isinstance(restored, dict):
            raise ValueError(f"its attributes are a {type(restored).__name__}, not a dict")
        unknown = sorted(set(restored) - set(self._names))
        if unknown:
            raise ValueError(f"it holds attributes this {type(self).__name__} does not "
                             f"declare: {unknown} (declared: {self._names})")
        for name, value in restored.items():
            declared = getattr(self, name)
            check_json(value, name)
            if name in self.WHOLE and (isinstance(value, bool) or not isinstance(value, int)
                                        or value < 0):
                raise ValueError(f"{name}={value!r}, expected a whole number >= 0")
            for kind, words in _KINDS:
                if isinstance(declared, kind) and (not isinstance(value, kind) or (
                        kind != bool and isinstance(value, bool))):
                    raise ValueError(f"{name}={value!r}, expected {words} as declared "
                                     f"({declared!r})")
                if isinstance(declared, kind):
                    break
        return restored

    def _set_values(self, values: dict) -> None:
        for name, value in copy.deepcopy(values).items():
            setattr(self, name, value)

    def _position(self) -> str:
        """Where a commit is, in words, for mgpu-train's resize message."""
        shown = [f"{name} {getattr(self, name)!r}" for name in ("epoch", "batch")
                 if name in self._names]
        return "commit" + (f" at {', '.join(shown)}" if shown else "")

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions (no arguments) :func:`run` calls after restoring a commit that a job of
        another size wrote, e.g. to set the learning rate for ``hvd.size()``.

        Example:
            >>> state.register_reset_callbacks([lambda: opt.learning_rate.assign(lr * hvd.size())])
        """
        self._reset_callbacks.extend(callbacks)


def run(func: Callable) -> Callable:
    """Horovod's ``@hvd.elastic.run``: call ``func(state)`` from the last committed state.

    Before the call every rank restores the state's last commit (if any), when a job of
    another size wrote it runs the reset callbacks, and then, as Horovod's, calls
    ``state.sync()``: every rank starts from rank 0's variables and attributes. When
    `func` returns, rank 0 deletes the commits: the folder the state was built with, never
    one a commit names. A failure is not retried here: the process exits and mgpu-train
    starts the job again (``--max-restarts``, elastic options).

    Raises:
        TypeError: the first argument is not an ``hvd.elastic`` state.
        PermissionError: the state folder is not rank 0's user's alone (every rank).
        ValueError: the last commit fails a check (``epoch_resume.BadBackup``; every rank).

    Example:
        >>> @hvd.elastic.run
        ... def train(state):
        ...     state.model.fit(data, epochs=5 - state.epoch, callbacks=callbacks)
    """
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(f"@hvd.elastic.run: {getattr(func, '__name__', func)}'s first "
                            f"argument is a {type(state).__name__}, expected an hvd.elastic "
                            f"state (KerasState, TensorFlowKerasState, ObjectState, "
                            f"TensorFlowState): call it as train(state)")
        written_by = state._load_commit()
        if written_by is not None and written_by != size():
            for callback in state._reset_callbacks:
                callback()
        state.sync()
        result = func(state, *args, **kwargs)
        if is_chief():
            state._delete_commits()
        if runtime.is_multi_process():
            collectives.barrier()  # no rank returns while the commits may still be there
        return result
    return wrapper
