"""Resume after a crash: rank 0 keeps an atomic per-epoch backup; a restart restores every rank."""

import glob
import os
import re
import shutil

import keras

from mgpu_launch import collectives, engines, runtime
from mgpu_launch.callbacks.io import _is_chief, save_atomically
from mgpu_launch.callbacks.sync import model_state_variables

_BACKUP = re.compile(r"epoch-(\d+)\.weights\.h5$")


class BackupAndRestore(keras.callbacks.Callback):
    """Back up the training state every epoch (rank 0) and resume from it after a restart.

    At the end of every epoch rank 0 writes the model's and the optimizer's state to
    ``backup_dir/epoch-<next epoch>.weights.h5`` — through a hidden file and a rename, so a
    kill at any moment leaves the last complete backup — and removes the older one. When
    ``fit`` starts and a backup exists, rank 0 reads it, every rank receives rank 0's values
    (so the backup needs to be on rank 0's file system only), and training continues at the
    epoch after the backed-up one. For a deterministic model this ends with exactly the weights
    of an uninterrupted run; a job killed mid-epoch loses that epoch's work only.

    Args:
        backup_dir: a folder for the backups (created by rank 0).
        delete_checkpoint: remove the folder when ``fit`` finishes normally.

    Example:
        >>> model.fit(x, y, epochs=90,
        ...           callbacks=[mgpu.callbacks.BackupAndRestore("/scratch/job-42/backup")])
    """

    def __init__(self, backup_dir: str, delete_checkpoint: bool = True):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore: backup_dir is empty; give a folder path")
        self.backup_dir, self.delete_checkpoint = backup_dir, delete_checkpoint

    def _latest(self):
        found = [(int(m.group(1)), path) for path in glob.glob(os.path.join(
            glob.escape(self.backup_dir), "epoch-*.weights.h5"))
            if (m := _BACKUP.search(os.path.basename(path)))]
        return max(found) if found else (None, None)

    def on_train_begin(self, logs=None):
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # the slots the backup fills
        epoch = None
        if _is_chief():
            epoch, path = self._latest()
            if path is not None:
                model.load_weights(path)
        if runtime.is_multi_process():
            epoch = collectives.broadcast_object(epoch)
            if epoch is not None:
                engines.get_engine().broadcast_variables(model_state_variables(model), 0)
        if epoch is not None:
            model._initial_epoch = epoch
            if _is_chief():
                print(f"BackupAndRestore: resuming at epoch {epoch + 1} from {self.backup_dir}")

    def on_epoch_end(self, epoch, logs=None):
        if not _is_chief():
            return
        previous = self._latest()[1]
        target = os.path.join(self.backup_dir, f"epoch-{epoch + 1}.weights.h5")
        save_atomically(self.model, target, weights_only=True)
        if previous and previous != target:
            os.remove(previous)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and _is_chief():
            shutil.rmtree(self.backup_dir, ignore_errors=True)
