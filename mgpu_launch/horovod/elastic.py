"""Horovod's ``hvd.elastic`` Keras names, on mgpu-launch's restart-based elastic training.

    import mgpu_launch.keras as hvd        # was: import horovod.tensorflow.keras as hvd

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([on_state_reset])
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(data, epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)

What differs from Horovod's in-memory rollback (docs/fault-tolerance.md, "The Horovod names"):

- ``commit()`` writes a step backup to disk (``callbacks.BackupAndRestore``'s files, rank 0,
  atomic) besides the in-memory snapshot Horovod takes. A commit costs one model save on
  rank 0. As in Horovod, ``restore()`` puts back the snapshot of the last ``commit()``,
  ``sync()`` or the state's creation, undoing uncommitted changes in the running process.
- A failure or a size change restarts every process (``mgpu-train --max-restarts`` /
  ``--host-discovery-script``); :func:`run` then restores the last commit from disk. Horovod
  keeps the surviving processes and rolls them back. Either way the work since the last
  commit is redone; here the processes' start-up (imports, compilation) is paid as well.
- Reset callbacks run once at start-up, after the restore, when the commit was written by a
  job of another size (Horovod runs them inside the running processes at each reset).
- ``state.batch`` counts the batches done in the current epoch (Horovod's holds the last
  batch's index). The resumed ``fit`` skips the committed batches of the data itself
  (``mgpu.data.shard`` data exactly, across size changes too), so ``UpdateBatchStateCallback``
  does not shorten the epoch's ``steps`` as Horovod's does.
- Extra attributes (``KerasState(model, epoch=0, best=0.5)``) must be JSON values.

What comes back from the state folder is data (docs/security.md): rank 0 reads it only from a
folder of its user's alone, and a restore sets only the attributes the state declares, each
checked against its declared kind; nothing restored names a path mgpu acts on.
"""

import copy
import functools
import math
from typing import Any, Callable, Optional

import keras
import numpy as np

from mgpu_launch import engines, keras_internals, runtime
from mgpu_launch.runtime import collectives
from mgpu_launch.training import epoch_resume, patches, resize, stall_probes
from mgpu_launch.training.callbacks.backup import BackupAndRestore
from mgpu_launch.training.callbacks.io import _is_chief
from mgpu_launch.training.callbacks.sync import model_state_variables
from mgpu_launcher import settings

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "STATE_DIR_VARIABLE"]

STATE_DIR_VARIABLE = "MGPU_ELASTIC_STATE_DIR"
_DEFAULT_DIR = ".mgpu-elastic-state"
_EXTRA = "elastic_state"  # the key of KerasState's attributes in the backup's state
# Names an attribute may not take: what KerasState itself holds or does.
_RESERVED = frozenset({"model", "optimizer", "backup_dir", "params"})
# JSON kinds an attribute's restored value must keep (int and float are both numbers).
_KINDS = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
          (list, "a list"), (dict, "a dict"))


def _size() -> int:
    return runtime.size() if runtime.is_initialized() else 1


class KerasState:
    """The state Horovod's elastic Keras scripts commit: a model, its optimizer, attributes.

    Args:
        model: the compiled Keras model.
        optimizer: its optimizer (default: ``model.optimizer``); its state is committed too.
        backup_dir: where rank 0 keeps the commits (default: ``$MGPU_ELASTIC_STATE_DIR``, else
            ``.mgpu-elastic-state`` in the working folder). :func:`run` deletes it when the
            training function returns, so the next job starts afresh.
        **kwargs: attributes committed and restored with the model, e.g. ``epoch=0, batch=0``
            (JSON values). ``epoch`` and ``batch`` are always there (default 0). A restore
            from disk sets only these, each to a value of the kind it was declared with (a
            number, a string, ...; any JSON value for one declared None); ``epoch`` and
            ``batch`` are whole numbers >= 0.

    As Horovod's state, it keeps a snapshot in memory (the model's and the optimizer's
    variables, the attributes) taken when it is created and at every :meth:`commit` and
    :meth:`sync`; :meth:`restore` puts it back. The optimizer is built at creation (when the
    model is), so that its slots are in the snapshot.

    Raises:
        ValueError: an attribute's name is the state's own (``model``, ``backup_dir``, a
            method, a name starting with ``_``); an attribute is not a JSON value (found at
            the first commit).

    Example:
        >>> state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    """

    def __init__(self, model, optimizer=None, backup_dir: Optional[str] = None, **kwargs):
        taken = sorted(name for name in kwargs if name in _RESERVED or name.startswith("_")
                       or hasattr(type(self), name))
        if taken:
            raise ValueError(f"KerasState: the attribute names {taken} are the state's own; "
                             f"give your attributes other names (e.g. my_{taken[0]})")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        self.backup_dir = backup_dir or settings.text(STATE_DIR_VARIABLE) or _DEFAULT_DIR
        self._backup = BackupAndRestore(self.backup_dir, keep=2, delete_checkpoint=False,
                                        rescale_lr=False)
        self._backup.set_model(model)
        self._names = sorted(set(kwargs) | {"epoch", "batch"})
        self.epoch, self.batch = 0, 0
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._reset_callbacks, self._resume, self.params = [], None, None
        self._build_optimizer()
        self._snapshot = self._take_snapshot()

    def _values(self) -> dict:
        return {name: getattr(self, name) for name in self._names}

    def _build_optimizer(self) -> None:
        if self.optimizer is not None and not self.optimizer.built and self.model.built:
            self.optimizer.build(self.model.trainable_variables)  # the slots a commit fills

    def _take_snapshot(self):
        """The model's and optimizer's variables with host copies of their values, and a deep
        copy of the attributes (this process's memory: nothing of it is read from outside)."""
        model = self._backup.model  # on JAX, reading it writes fit's state back first
        variables = model_state_variables(model)
        return ([(v, np.array(keras.ops.convert_to_numpy(v), copy=True)) for v in variables],
                copy.deepcopy(self._values()))

    def commit(self) -> None:
        """Write the state as a step backup (rank 0, atomic); stop here if a resize is asked.

        Call it on every rank at the same step (a collective runs in elastic jobs).

        Raises:
            SystemExit: status 0 on every rank when mgpu-train asked the job to resize.
        """
        self._commit(may_stop=True)

    def _commit(self, may_stop: bool) -> None:
        self._snapshot = self._take_snapshot()
        self._backup.params = self.params  # steps per epoch, for a resume at another size
        try:
            self._backup._save((int(self.epoch), int(self.batch)),
                               extra={_EXTRA: self._values()})
        except TypeError as error:
            raise ValueError(f"KerasState.commit: the attributes {self._values()!r} must be "
                             f"JSON values ({error}); keep numbers, strings, lists and dicts "
                             f"in the state") from error
        # A custom loop has no fit to tell mgpu-train that training got going: a failure
        # after a commit resumes from it, so it is worth a restart.
        stall_probes.report_progress()
        if may_stop:
            resize.stop_here_if_asked(f"commit after batch {self.batch} of epoch "
                                      f"{int(self.epoch) + 1}" if self.batch else
                                      f"commit after epoch {self.epoch}")

    def sync(self) -> None:
        """Give every rank rank 0's weights, optimizer state and attributes, then take the
        snapshot :meth:`restore` returns to (Horovod's). Call it on every rank."""
        if runtime.is_multi_process():
            self._build_optimizer()
            engines.get_engine().broadcast_variables(model_state_variables(self.model), 0)
            for name, value in collectives.broadcast_object(self._values()).items():
                setattr(self, name, value)
        self._snapshot = self._take_snapshot()

    def restore(self) -> None:
        """Undo every change since the last :meth:`commit`, :meth:`sync` or the state's
        creation (Horovod's): the model's and the optimizer's variables and the attributes get
        the snapshot's values. This process's memory only: no collective, nothing read from
        disk (:func:`run` loads the last commit from disk when a job starts).

        Variables created after the snapshot (an optimizer built by the first step because
        the model was not built when the state was created) keep their values.

        Example:
            >>> state.epoch = 5; state.restore(); state.epoch      # the last commit's
            0
        """
        variables, values = self._snapshot
        for variable, value in variables:
            variable.assign(value)
        for name, value in copy.deepcopy(values).items():
            setattr(self, name, value)

    def _load_commit(self) -> bool:
        """Load the last commit from disk (rank 0 reads it, every rank receives it) and make
        it the snapshot; False if there is none. Collective: call it on every rank."""
        self._build_optimizer()
        restored = self._backup._restore_everywhere({_EXTRA: self._checked})
        if restored is None:
            return False
        (epochs, batches), saved = restored
        for name, value in saved.pop(_EXTRA, {}).items():
            setattr(self, name, value)  # only declared names: _checked refused any other
        self.epoch, self.batch = epochs, batches
        self._resume = (epochs, batches, saved)
        self._snapshot = self._take_snapshot()
        return True

    def _checked(self, restored: Any) -> dict:
        """The attributes of a commit, checked as data: declared names, declared kinds.

        Raises:
            ValueError: an unknown name, a value of another kind, a negative or fractional
                epoch or batch, a non-finite number (the commit is then refused).
        """
        if not isinstance(restored, dict):
            raise ValueError(f"its attributes are a {type(restored).__name__}, not a dict")
        unknown = sorted(set(restored) - set(self._names))
        if unknown:
            raise ValueError(f"it holds attributes this KerasState does not declare: {unknown} "
                             f"(declared: {self._names})")
        for name, value in restored.items():
            declared = getattr(self, name)
            _check_json(value, name)
            if name in ("epoch", "batch") and (isinstance(value, bool) or
                                               not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r}, expected a whole number >= 0")
            for kind, words in _KINDS:
                if isinstance(declared, kind) and (not isinstance(value, kind) or (
                        kind != bool and isinstance(value, bool))):
                    raise ValueError(f"{name}={value!r}, expected {words} as declared "
                                     f"({declared!r})")
                if isinstance(declared, kind):
                    break
        return restored

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions (no arguments) :func:`run` calls after restoring a commit that a job of
        another size wrote, e.g. to set the learning rate for ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def _take_resume(self):
        resume, self._resume = self._resume, None
        return resume


def _check_json(value: Any, name: str, depth: int = 0) -> None:
    """Raise ValueError unless `value` is plain JSON data with finite numbers."""
    if depth > 32:
        raise ValueError(f"{name} is nested more than 32 deep")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name}={value!r}, expected a finite number")
    if isinstance(value, list):
        for item in value:
            _check_json(item, name, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_json(item, f"{name}[{key!r}]", depth + 1)
    elif value is not None and not isinstance(value, (bool, int, float, str)):
        raise ValueError(f"{name} holds a {type(value).__name__}, not JSON data")


def run(func: Callable) -> Callable:
    """Horovod's ``@hvd.elastic.run``: call ``func(state)`` from the last committed state.

    Before the call every rank restores the state's last commit (if any), when a job of
    another size wrote it runs the reset callbacks, and then, as Horovod's, calls
    ``state.sync()``: every rank starts from rank 0's variables and attributes. When
    `func` returns, rank 0 deletes the commits: the folder the state was built with, never
    one a commit names. A failure is not retried here: the process exits and mgpu-train
    starts the job again (``--max-restarts``, elastic options).

    Raises:
        PermissionError: the state folder is not rank 0's user's alone (every rank).
        ValueError: the last commit fails a check (``epoch_resume.BadBackup``; every rank).

    Example:
        >>> @hvd.elastic.run
        ... def train(state):
        ...     state.model.fit(data, epochs=5 - state.epoch, callbacks=callbacks)
    """
    @functools.wraps(func)
    def wrapper(state: KerasState, *args, **kwargs):
        if state._load_commit() and (state._resume[2].get("size") or _size()) != _size():
            for callback in state._reset_callbacks:
                callback()
        state.sync()
        result = func(state, *args, **kwargs)
        if _is_chief():
            state._backup._delete_folder()
        if runtime.is_multi_process():
            collectives.barrier()  # no rank returns while the commits may still be there
        return result
    return wrapper


class CommitStateCallback(keras.callbacks.Callback):
    """Commit the state every `batches_per_commit` batches and at every epoch's end.

    When ``fit`` starts after :func:`run` restored a commit, it also moves the data on to the
    committed epoch and batch (as ``BackupAndRestore`` does; fit's epoch 0 is the state's
    ``epoch``, as in Horovod's ``fit(epochs=epochs - state.epoch)``).

    Args:
        state: the :class:`KerasState`.
        batches_per_commit: batches between commits (each commit is a model save on rank 0).
    """

    def __init__(self, state: KerasState, batches_per_commit: int = 1):
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit={batches_per_commit!r}; "
                             f"expected a number of batches >= 1 (e.g. 10)")
        self.state, self.batches_per_commit = state, batches_per_commit
        self._first_epoch = self._epoch = self._done = self._resumed = self._since = 0

    def on_train_begin(self, logs=None):
        self.state.params = self.params
        self._first_epoch, self._since, self._resumed = int(self.state.epoch), 0, 0
        resume = self.state._take_resume()
        if resume is None:
            return
        epochs, batches, note = epoch_resume.resume_point(*resume, _size(),
                                                          (self.params or {}).get("steps"))
        if epochs > self._first_epoch:  # a size change put the position past the epoch's end
            keras_internals.set_initial_epoch(self.model, epochs - self._first_epoch)
        patches.resume_at(epochs, batches)
        self._resumed = batches
        if _is_chief():
            where = f", batch {batches + 1}" if batches else ""
            print(f"elastic: resuming at epoch {epochs + 1}{where} from the commit in "
                  f"{self.state.backup_dir}" + (f" ({note})" if note else ""), flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = self._first_epoch + epoch
        self._done, self._resumed = self._resumed, 0

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        self._since += done - self._done
        self._done = done
        steps = (self.params or {}).get("steps")
        if self._since < self.batches_per_commit or (steps and done >= steps):
            return  # the epoch's end commits its last batch
        self._since = 0
        self.state.epoch, self.state.batch = self._epoch, done
        self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self._since = 0
        self.state.epoch, self.state.batch = self._epoch + 1, 0
        last = self._epoch + 1 - self._first_epoch >= (self.params or {}).get("epochs", 0)
        self.state._commit(may_stop=not last)

    def on_train_end(self, logs=None):
        patches.resume_at(0, 0)  # a restore whose fit never reached an epoch


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` = the batches done in the current epoch (0 at its end)."""

    def __init__(self, state: KerasState):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` = the epochs done (the state's epoch when ``fit`` began + fit's)."""

    def __init__(self, state: KerasState):
        super().__init__()
        self.state = state
        self._first_epoch = 0

    def on_train_begin(self, logs=None):
        self._first_epoch = int(self.state.epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._first_epoch + epoch + 1
