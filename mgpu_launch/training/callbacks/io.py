"""Rank-0 I/O: checkpoints written once, atomically, on decisions every rank shares.

    callbacks = [mgpu.callbacks.MetricAverageCallback(),
                 mgpu.callbacks.ModelCheckpoint("ckpt/model-{epoch:02d}.keras", save_best_only=True),
                 mgpu.callbacks.rank0(keras.callbacks.CSVLogger("train.csv"))]
"""

import os
from typing import Optional

import keras
import numpy as np

from mgpu_launch import keras_internals, runtime
from mgpu_launch.runtime import collectives, folders
from mgpu_launch.training.callbacks.sync import gather_sharded_state

_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
          "on_predict_batch_begin", "on_predict_batch_end")


def _is_chief() -> bool:
    return runtime.state.rank == 0


class _Rank0(keras.callbacks.Callback):
    def __init__(self, callback):
        super().__init__()
        self.callback = callback

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)


def _forward(name):
    def hook(self, *args, **kwargs):
        if _is_chief():
            return getattr(self.callback, name)(*args, **kwargs)
    hook.__name__ = name
    return hook


for _name in _HOOKS:
    setattr(_Rank0, _name, _forward(_name))


def rank0(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Run `callback` on rank 0 only (Keras's ModelCheckpoint, TensorBoard, CSVLogger, ...).

    The other ranks skip every hook. Put ``MetricAverageCallback()`` before it so what rank 0
    logs or saves reflects all ranks. Not for callbacks that change training
    (EarlyStopping, ReduceLROnPlateau): those must run on every rank, on averaged metrics.

    Example:
        >>> callbacks = [mgpu.callbacks.MetricAverageCallback(),
        ...              mgpu.callbacks.rank0(keras.callbacks.TensorBoard("logs"))]
    """
    return _Rank0(callback)


def _partial_path(filepath: str) -> str:
    """A sibling of `filepath` with the same suffix (Keras checks it), hidden, unique."""
    folder, name = os.path.split(filepath)
    suffix = next((s for s in (".weights.h5", ".keras", ".h5") if name.endswith(s)),
                  os.path.splitext(name)[1])
    stem = name[:len(name) - len(suffix)] if suffix else name
    return os.path.join(folder, f".{stem}.partial-{os.getpid()}{suffix}")


def save_atomically(model, filepath: str, weights_only: bool,
                    attributes: Optional[dict] = None, mode: int = 0o666) -> None:
    """``model.save`` / ``save_weights`` into a hidden sibling, then rename it over `filepath`:
    a process killed mid-write leaves whatever `filepath` held before. Creates the folder.
    The sibling is created with ``O_EXCL | O_NOFOLLOW`` (`mode`, less the umask) before Keras
    writes it, so a symbolic link planted under its name is removed, never written through.
    `attributes` (``.weights.h5`` only): strings stored as the HDF5 file's root attributes,
    inside the same atomic write (Keras's loading ignores them; see :func:`read_attributes`)."""
    folder = os.path.dirname(filepath)
    if folder:
        os.makedirs(folder, exist_ok=True)
    partial = _partial_path(filepath)
    if os.path.lexists(partial):
        os.remove(partial)  # an earlier process's with our pid: a link is removed, not followed
    # Ours alone from here: created anew, so the path cannot lead through a link someone
    # planted (Keras then writes by path: in a private folder nobody can swap it meanwhile).
    folders.create_new(partial, mode=mode)
    try:
        if weights_only:
            model.save_weights(partial, overwrite=True)
        else:
            model.save(partial, overwrite=True)
        if attributes:
            import h5py  # Keras's own dependency for .weights.h5

            with h5py.File(partial, "a") as store:
                store.attrs.update(attributes)
        os.replace(partial, filepath)
    finally:
        if os.path.lexists(partial):
            os.remove(partial)


def read_attributes(filepath: str) -> dict:
    """The root attributes :func:`save_atomically` stored in a ``.weights.h5`` file."""
    import h5py

    with h5py.File(filepath, "r") as store:
        return {key: str(value) for key, value in store.attrs.items()}


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint`` (same arguments), written by rank 0 only and atomically.

    - Only rank 0 writes; the other ranks never touch the file system.
    - Atomic: the model is written to a hidden file in the same folder, then renamed over the
      final name, so a process killed mid-write leaves the previous checkpoint intact.
    - With ``save_best_only`` the monitored value is averaged over the ranks first (one
      collective, every rank), so "best" means best over all the data.

    Example:
        >>> mgpu.callbacks.ModelCheckpoint("ckpt/model.keras", monitor="val_loss",
        ...                                save_best_only=True)

    Raises:
        KerasInternalsError: this Keras's ModelCheckpoint lacks a private method the class
            overrides or calls (:func:`mgpu_launch.keras_internals.check_model_checkpoint`).
    """

    def __init__(self, *args, **kwargs):
        # Keras calls our _save_model only while it still has one by that name: otherwise every
        # rank would write, non-atomically, through Keras's own. Refuse before training.
        keras_internals.check_model_checkpoint()
        super().__init__(*args, **kwargs)

    def _averaged(self, logs):
        if (not self.save_best_only or not runtime.is_multi_process() or not logs
                or self.monitor not in logs):
            return logs
        logs = dict(logs)
        value = np.array([float(logs[self.monitor])], dtype=np.float64)
        logs[self.monitor] = float(collectives.allreduce(value, op=collectives.Average)[0])
        return logs

    def on_train_batch_end(self, batch, logs=None):
        if keras_internals.checkpoint_should_save_on_batch(self, batch):
            self._save_model(epoch=keras_internals.checkpoint_current_epoch(self), batch=batch,
                             logs=self._averaged(logs))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, self._averaged(logs))

    def _save_model(self, epoch, batch, logs):
        gather_sharded_state(self.model)  # every rank: a sharded optimizer's state to rank 0
        if not _is_chief():
            return
        filepath = keras_internals.checkpoint_file_path(self, epoch, batch, logs)
        if not keras_internals.checkpoint_should_save(self, epoch, batch, logs, filepath):
            return
        save_atomically(self.model, filepath, weights_only=self.save_weights_only)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: saved the model to {filepath} (rank 0)")
