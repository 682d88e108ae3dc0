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

``ObjectState`` (plain values, no model; :mod:`mgpu_launch.horovod.object_state`) and ``run``
(:mod:`mgpu_launch.horovod.elastic_state`) are exported here too.

What comes back from the state folder is data (docs/security.md): rank 0 reads it only from a
folder of its user's alone, and a restore sets only the attributes the state declares, each
checked against its declared kind; nothing restored names a path mgpu acts on.
"""

import copy
from typing import Optional

import keras
import numpy as np

from mgpu_launch import backends, keras_internals, runtime
from mgpu_launch.horovod.elastic_state import State, run, size as _size
from mgpu_launch.horovod.object_state import STATE_DIR_VARIABLE, ObjectState, state_dir
from mgpu_launch.runtime import collectives
from mgpu_launch.training import epoch_resume, patches, resize, stall_probes
from mgpu_launch.training.callbacks.backup import BackupAndRestore
from mgpu_launch.training.callbacks.io import _is_chief
from mgpu_launch.training.callbacks.sync import (model_state_variables, scatter_sharded_state,
                                                 sharded_state_variables)

__all__ = ["KerasState", "ObjectState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "STATE_DIR_VARIABLE"]

_EXTRA = "elastic_state"  # the key of KerasState's attributes in the backup's state


class KerasState(State):
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
            method, a name starting with ``_``); an attribute is not a JSON value (at a
            commit, before anything is written).

    Example:
        >>> state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    """

    # What KerasState itself holds or does; epoch and batch are positions in the data.
    RESERVED = frozenset({"model", "optimizer", "backup_dir", "params"})
    WHOLE = ("epoch", "batch")

    def __init__(self, model, optimizer=None, backup_dir: Optional[str] = None, **kwargs):
        self._declare(kwargs, defaults={"epoch": 0, "batch": 0})
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        self.backup_dir = state_dir(backup_dir)
        self._backup = BackupAndRestore(self.backup_dir, keep=2, delete_checkpoint=False,
                                        rescale_lr=False)
        self._backup.set_model(model)
        self._resume, self.params = None, None
        self._build_optimizer()
        self._snapshot = self._take_snapshot()

    def _build_optimizer(self) -> None:
        if self.optimizer is not None and not self.optimizer.built and self.model.built:
            self.optimizer.build(self.model.trainable_variables)  # the slots a commit fills

    def _take_snapshot(self):
        """The model's and optimizer's variables with host copies of their values, and a deep
        copy of the attributes (this process's memory: nothing of it is read from outside)."""
        model = self._backup.model  # on JAX, reading it writes fit's state back first
        variables = model_state_variables(model) + sharded_state_variables(model)  # own part
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
        values = self._json_values()  # before anything changes: a bad value commits nothing
        self._snapshot = self._take_snapshot()
        self._backup.params = self.params  # steps per epoch, for a resume at another size
        self._backup._save((int(self.epoch), int(self.batch)), extra={_EXTRA: values})
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
            backends.get_engine().broadcast_variables(model_state_variables(self.model), 0)
            scatter_sharded_state(self.model, 0)
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
        self._set_values(values)

    def _load_commit(self) -> Optional[int]:
        """Load the last commit from disk (rank 0 reads it, every rank receives it) and make
        it the snapshot; the size of the job that wrote it, None if there is none.
        Collective: call it on every rank."""
        self._build_optimizer()
        restored = self._backup._restore_everywhere({_EXTRA: self._checked})
        if restored is None:
            return None
        (epochs, batches), saved = restored
        self._set_values(saved.pop(_EXTRA, {}))  # only declared names: _checked refused others
        self.epoch, self.batch = epochs, batches
        self._resume = (epochs, batches, saved)
        self._snapshot = self._take_snapshot()
        return saved.get("size") or _size()

    def _delete_commits(self) -> None:
        self._backup._delete_folder()

    def _take_resume(self):
        resume, self._resume = self._resume, None
        return resume


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
