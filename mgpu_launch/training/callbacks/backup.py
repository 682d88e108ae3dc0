"""Resume after a crash: rank 0 keeps atomic backups (per epoch or every N steps); a restart
restores every rank and continues at the backed-up epoch and batch."""

import glob
import json
import math
import os
import re
import stat
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import keras

from mgpu_launch import backends, keras_internals, runtime
from mgpu_launch.runtime import agreement, folders
from mgpu_launch.training import epoch_resume, patches, resize
from mgpu_launch.training.callbacks.io import _is_chief, read_attributes, save_atomically
from mgpu_launch.training.callbacks.schedule import correct_momentum, lr_target
from mgpu_launch.training.callbacks.sync import model_state_variables

# epoch-<epochs done>.weights.h5, or epoch-<epochs done>-batch-<batches done>.weights.h5
_BACKUP = re.compile(r"^epoch-(\d+)(?:-batch-(\d+))?\.weights\.h5$")
# What save_atomically leaves behind when its process is killed mid-write.
_PARTIAL = re.compile(r"^\..*\.partial-\d+\.weights\.h5$")
# The HDF5 root attribute with epoch_resume.backup_state (the writer's size, data position).
_STATE = "mgpu_backup_state"


def _refused_folder(why: str) -> PermissionError:
    return PermissionError(f"BackupAndRestore: rank 0 refuses to read or write backups there: "
                           f"{why}")


class BackupAndRestore(keras.callbacks.Callback):
    """Back up the training state (rank 0) and resume from it after a restart.

    Rank 0 writes the model's and the optimizer's state at the end of every epoch, and with an
    integer `save_freq` also every `save_freq` batches, to
    ``backup_dir/epoch-<E>[-batch-<B>].weights.h5`` (E epochs and B batches of the next one
    done). Each write goes to a hidden file and is renamed into place, so a kill at any moment
    leaves the last complete backup; only the newest `keep` backups are kept; hidden partial
    files of a rank 0 killed mid-write are removed at the next start.

    When ``fit`` starts and a backup exists, rank 0 reads it, every rank receives rank 0's
    values (so the backup needs to be on rank 0's file system only), and training continues
    at that epoch and batch: the data set is moved on to the backed-up epoch, the epoch's
    first B batches are read and dropped, and callbacks see the interrupted run's batch
    numbers. The resumed run then ends with exactly the weights of an uninterrupted one for a
    deterministic model when the batches come in the interrupted run's order:

    - ``mgpu.data.shard`` data (arrays or a PyDataset), with any ``fit`` call: exact on every
      backend; shard's own shuffling is seeded by the epoch number, and ``fit`` never reorders
      shard's batches (its ``shuffle`` is ignored for them).
    - another PyDataset: exact if its order depends only on how often ``on_epoch_end`` was
      called (it is called E times before training resumes).
    - numpy arrays with ``fit(shuffle=False)``: exact. With Keras's shuffling (``fit``'s
      default ``shuffle=True``) or a ``tf.data`` dataset that reshuffles, the resumed run
      cannot replay the order: the resumed epoch reads B batches fewer of a fresh order.

    Args:
        backup_dir: a folder for the backups (created by rank 0, mode 0700); use it for
            nothing else. It must be rank 0's user's alone (below).
            ``fit`` fails at its start, before any step, when rank 0 cannot write there.
        save_freq: ``"epoch"``, or a number of batches: back up every that many batches and
            at the end of every epoch.
        keep: how many backups to keep (newest first); 2 or more leaves an older one to fall
            back on if the newest cannot be read.
        delete_checkpoint: remove the folder when ``fit`` finishes normally.
        rescale_lr: when the backup was written by a job of another size (elastic training,
            see docs/fault-tolerance.md), multiply the restored learning rate by
            ``size() / old size``, as ``mgpu.scale_lr`` scales it. A ``LearningRateSchedule``
            is not restored (your script builds it again) and is left alone.
        momentum_correction: when ``rescale_lr`` changes the rate, scale the restored momentum
            buffers (SGD's, RMSprop's) by the same factor (Goyal et al.): Keras keeps the rate
            inside the velocity (``v = momentum * v - lr * g``), so the first steps after the
            resize then move as the new rate says instead of at the old one's speed.

    The folder must be rank 0's user's alone (:func:`mgpu_launch.runtime.folders.private_folder`:
    owned by that user, nobody else may write in it or redirect its path; a missing one is
    created with mode 0700): ``fit`` refuses another with a PermissionError on every rank,
    before reading or writing anything there. What a backup records is data: its state is
    checked (:func:`mgpu_launch.training.epoch_resume.checked_state`) before its weights are
    loaded, and its learning rate after. A backup that fails a check is **refused** with a
    ValueError on every rank, not skipped for an older one: the folder is private, so a bad
    state means a tampered file or one of an incompatible version, and resuming from an older
    backup (or from scratch, whose first backups then delete the bad one) would hide that and
    silently redo or lose training. Delete the file to resume from the next older one. A
    backup that cannot be read at all (a damaged file) is skipped with a warning, as before.

    Each backup also records the writer's size and, for ``mgpu.data.shard`` data, the global
    position in the epoch's order, so a job restarted with another number of processes
    continues the interrupted epoch at the same sample (``mgpu.data.shard`` splits the rest
    into batches of the new size).

    Example:
        >>> model.fit(mgpu.data.shard((x, y), 64, shuffle=True), epochs=90,
        ...           callbacks=[mgpu.callbacks.BackupAndRestore("/scratch/job-42/backup",
        ...                                                      save_freq=500)])
    """

    def __init__(self, backup_dir: str, save_freq: Union[str, int] = "epoch", keep: int = 1,
                 delete_checkpoint: bool = True, rescale_lr: bool = True,
                 momentum_correction: bool = True):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore: backup_dir is empty; give a folder path")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ValueError(f"BackupAndRestore: save_freq={save_freq!r}; expected 'epoch' or a "
                             f"number of batches >= 1 (e.g. save_freq=500)")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"BackupAndRestore: keep={keep!r}; expected how many backups to "
                             f"keep, an integer >= 1")
        self.backup_dir, self.save_freq, self.keep = backup_dir, save_freq, keep
        self.delete_checkpoint, self.rescale_lr = delete_checkpoint, rescale_lr
        self.momentum_correction = momentum_correction
        self._epoch = self._done_in_epoch = self._resumed_batches = 0
        self._batches_since_save = 0
        if save_freq != "epoch":
            # Only then: Keras runs every batch-end callback synchronously (no async dispatch
            # on JAX / torch) as soon as one callback overrides on_train_batch_end.
            self.on_train_batch_end = self._back_up_every_save_freq_batches

    def _folder(self, create: bool = True) -> str:
        """The backup folder's real path, checked to be this user's alone (rank 0).

        Raises:
            folders.UnsafeFolder: another user could change it or its path.
            FileNotFoundError: it does not exist and `create` is False.
        """
        return folders.private_folder(self.backup_dir, "backup_dir", create=create)

    def _backups(self, folder: str) -> List[Tuple[Tuple[int, int], str]]:
        """((epochs done, batches done), path) of every complete backup, newest first."""
        found = []
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if (match := _BACKUP.match(name)) and stat.S_ISREG(os.lstat(path).st_mode):
                position = (int(match.group(1)), int(match.group(2) or 0))
                found.append((position, path))
        return sorted(found, reverse=True)

    def _restore_on_chief(self, extras: Optional[Dict[str, Callable[[Any], Any]]] = None):
        """Load the newest readable backup; ((epochs done, batches done), its state), or None.

        Args:
            extras: for each further key the caller records in a backup's state (KerasState's
                attributes), the function that checks its value and returns it (raising
                ValueError for a bad one); a backup with any other key is refused.

        Raises:
            folders.UnsafeFolder: the folder is not this user's alone.
            epoch_resume.BadBackup: the newest readable backup fails a check (class docstring).
        """
        try:
            folder = self._folder(create=False)
        except FileNotFoundError:
            return None
        for path in glob.glob(os.path.join(glob.escape(folder), ".*")):
            if _PARTIAL.match(os.path.basename(path)):
                os.remove(path)  # a link is removed, never followed
        for position, path in self._backups(folder):
            try:
                text = read_attributes(path).get(_STATE, "{}")
            except (OSError, ValueError) as error:
                warnings.warn(f"BackupAndRestore: cannot read {path} ({error}); trying an "
                              f"older backup", stacklevel=2)
                continue
            try:
                state = epoch_resume.checked_state(text, tuple(extras or ()))
                for key, check in (extras or {}).items():
                    if key in state:
                        state[key] = check(state[key])
            except ValueError as error:
                raise epoch_resume.BadBackup(f"{path}: {error}") from None
            variables = model_state_variables(self.model)
            before = [keras.ops.convert_to_numpy(v) for v in variables]
            try:
                self.model.load_weights(path)
                self._check_learning_rate(path)
            except (OSError, ValueError) as error:
                # Nothing of a refused or half-read backup stays: not its rate, not the
                # variables loaded before the read failed.
                for variable, value in zip(variables, before):
                    variable.assign(value)
                if isinstance(error, epoch_resume.BadBackup):
                    raise
                warnings.warn(f"BackupAndRestore: cannot read {path} ({error}); trying an "
                              f"older backup", stacklevel=2)
                continue
            return position, state
        return None

    def _check_learning_rate(self, path: str) -> None:
        try:
            kind, target = lr_target(self.model.optimizer)
        except (ValueError, AttributeError):  # no optimizer, or a schedule nothing restores
            return
        value = target.learning_rate if kind == "value" else target
        rate = float(keras.ops.convert_to_numpy(value))
        if not math.isfinite(rate) or rate < 0:
            raise epoch_resume.BadBackup(
                f"{path}: the restored learning rate{' multiplier' * (kind != 'value')} is "
                f"{rate!r}, expected a finite number >= 0")

    def _restore_everywhere(self, extras=None):
        """Collective: rank 0's :meth:`_restore_on_chief`, its model state and outcome on
        every rank; a refusal raises the same error on every rank (none waits for rank 0)."""
        restored = agreement.decided_by_root(
            runtime.state.transport, lambda: self._restore_on_chief(extras), {
            folders.UnsafeFolder: _refused_folder,
            epoch_resume.BadBackup: lambda why: epoch_resume.BadBackup(
                f"BackupAndRestore: refused the backup {why}. Nothing of it was used. "
                f"Delete that file to resume from an older backup (or the folder to start "
                f"afresh). mgpu never writes a backup that fails this check: look for what else "
                f"writes there")})
        if runtime.is_multi_process() and restored is not None:
            backends.get_engine().broadcast_variables(model_state_variables(self.model), 0)
        return restored

    def _check_folder(self) -> None:
        """Fail before the first step, not at the first save, when rank 0 cannot back up.

        Raises:
            PermissionError: the folder is not rank 0's user's alone (every rank).
            OSError: rank 0 cannot create it or write in it (every rank).
        """
        def try_writing():
            try:
                with tempfile.NamedTemporaryFile(dir=self._folder(), prefix=".write-check-"):
                    pass
            except FileExistsError as error:
                raise FileExistsError("it exists and is not a folder") from error
            except folders.UnsafeFolder:
                raise
            except OSError as error:
                raise OSError(f"{type(error).__name__}: {error.strerror or error}") from error

        agreement.decided_by_root(runtime.state.transport, try_writing, {
            folders.UnsafeFolder: _refused_folder,
            OSError: lambda why: OSError(
                f"BackupAndRestore: rank 0 cannot keep backups in {self.backup_dir!r}: {why}. "
                f"Expected a folder rank 0 can create and write in; give another backup_dir "
                f"or fix its permissions.")})

    def _delete_folder(self) -> None:
        """Remove the backup folder (rank 0), unless another user could have redirected it."""
        folders.remove_private(self.backup_dir, "backup_dir", "BackupAndRestore", "the backups")

    def on_train_begin(self, logs=None):
        self._check_folder()
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # the slots the backup fills
        restored = self._restore_everywhere()
        self._batches_since_save = self._resumed_batches = 0
        if restored is None:
            return
        (epochs, batches), saved = restored
        size = runtime.size() if runtime.is_initialized() else 1
        epochs, batches, note = epoch_resume.resume_point(
            epochs, batches, saved, size, (self.params or {}).get("steps"))
        old_size = int(saved.get("size") or size)
        if old_size != size and self.rescale_lr:
            note = ", ".join(filter(None, (note, self._rescale_learning_rate(size / old_size))))
        note = f" ({note})" if note else ""
        keras_internals.set_initial_epoch(model, epochs)
        self._resumed_batches = batches
        patches.resume_at(epochs, batches)
        if _is_chief():
            where = f", batch {batches + 1}" if batches else ""
            print(f"BackupAndRestore: resuming at epoch {epochs + 1}{where} from "
                  f"{self.backup_dir}{note}", flush=True)

    def _rescale_learning_rate(self, factor: float) -> str:
        try:
            kind, target = lr_target(self.model.optimizer)
        except ValueError:  # a schedule in a plain optimizer: nothing was restored
            return ""
        if kind != "value":
            return ""  # a schedule: built again by the script, for this size
        old = float(keras.ops.convert_to_numpy(target.learning_rate))
        target.learning_rate = old * factor
        note = f"learning rate {old:g} -> {old * factor:g}"
        if not self.momentum_correction:
            return note
        try:
            corrected = correct_momentum(self.model.optimizer, factor)
        except ValueError:
            warnings.warn(f"BackupAndRestore: the learning rate changed by {factor:g} with the "
                          f"size, but {type(self.model.optimizer).__name__}'s momentum cannot "
                          f"be corrected (no known velocity slots); it is restored as it was. "
                          f"Pass momentum_correction=False to silence this.", stacklevel=2)
            return note
        return note + (f", momentum buffers x {factor:g}" if corrected else "")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._done_in_epoch, self._resumed_batches = self._resumed_batches, 0

    def _back_up_every_save_freq_batches(self, batch, logs=None):
        done = batch + 1  # `batch` is an execution's last step (steps_per_execution > 1)
        self._batches_since_save += done - self._done_in_epoch
        self._done_in_epoch = done
        steps = (self.params or {}).get("steps")
        if self._batches_since_save < self.save_freq or (steps and done >= steps):
            return  # the epoch's end saves its last batch, after the epoch's other callbacks
        self._batches_since_save = 0
        self._save((self._epoch, done))
        resize.stop_here_if_asked(f"backup after batch {done} of epoch {self._epoch + 1}")

    def on_epoch_end(self, epoch, logs=None):
        self._batches_since_save = 0
        self._save((epoch + 1, 0))
        if epoch + 1 < (self.params or {}).get("epochs", 0):  # after the last: just finish
            resize.stop_here_if_asked(f"backup after epoch {epoch + 1}")

    def _save(self, position: Tuple[int, int], extra: Optional[dict] = None) -> None:
        # extra: more JSON-able entries for the backup's state (mgpu_launch.elastic.KerasState's)
        if not _is_chief():
            return
        epochs, batches = position
        name = f"epoch-{epochs}" + (f"-batch-{batches}" if batches else "") + ".weights.h5"
        state = epoch_resume.backup_state(batches, runtime.size() if runtime.is_initialized()
                                          else 1, (self.params or {}).get("steps"))
        state.update(extra or {})
        folder = self._folder()  # checked at every write: nothing is written through others'
        save_atomically(self.model, os.path.join(folder, name), weights_only=True,
                        attributes={_STATE: json.dumps(state)}, mode=0o600)
        for _, old in self._backups(folder)[self.keep:]:
            os.remove(old)

    def on_train_end(self, logs=None):
        patches.resume_at(0, 0)  # a restore whose fit never reached an epoch
        if self.delete_checkpoint and _is_chief():
            self._delete_folder()
