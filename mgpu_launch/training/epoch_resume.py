"""Start an epoch in the middle: the data order and batch numbers of an interrupted run.

``callbacks.BackupAndRestore(save_freq=N)`` backs up every N steps. After a restart, the
``EpochIterator._enumerate_iterator`` patch (installed by
:func:`mgpu_launch.training.patches.resume_at`) hands the first epoch of ``fit`` to
:func:`resumed_epoch`, which moves the data on to the backed-up epoch and drops the batches
already trained on.

Exact for ``mgpu.data.shard`` (its shuffle is seeded per epoch, so any epoch's order can be
rebuilt) and for data without shuffling; ``fit(shuffle=True)`` cannot be replayed and warns.
"""

import contextlib
import warnings

from mgpu_launch import keras_internals
from mgpu_launch.runtime import folders

_training_data = None  # fit's x while a patched fit runs (BackupAndRestore asks its position)
_warned_shuffle = []


def keeps_its_order(data, arguments) -> bool:
    """Whether `data` is ``mgpu.data.shard``'s, whose batches ``fit`` must not reorder.

    Its shuffle is seeded per epoch, so a restarted job can rebuild any epoch's order; Keras's
    ``fit(shuffle=True)`` (the default) would reorder the batches again with a random state
    nothing can replay. ``fit`` therefore runs it with ``shuffle=False``; an explicit
    ``shuffle=True`` is ignored, with a warning once.
    """
    if not getattr(data, "keeps_its_order", False):
        return False
    if arguments.get("shuffle") is True and not _warned_shuffle:
        _warned_shuffle.append(True)
        warnings.warn("fit(shuffle=True) is ignored for mgpu.data.shard data: its batches keep "
                      "shard's order, so that a restarted job can resume it exactly. Shuffle "
                      "with mgpu.data.shard(..., shuffle=True, seed=...).", stacklevel=4)
    return True


@contextlib.contextmanager
def training_on(data):
    """Make `data` the ``x`` of the ``fit`` that runs now (what BackupAndRestore asks the
    position of) while that ``fit`` runs."""
    global _training_data
    previous, _training_data = _training_data, data
    try:
        yield
    finally:
        _training_data = previous


def backup_state(batches_done: int, size: int, steps) -> dict:
    """What a backup taken after `batches_done` batches of an epoch needs to be resumed by a
    job of another size: this job's size and steps per epoch, and for ``mgpu.data.shard``
    data the global position in the epoch's order (units done by all ranks together)."""
    state = {"size": int(size), "steps": int(steps) if steps else None}
    data = _training_data
    if batches_done and hasattr(data, "position"):
        state["position"] = int(data.position(batches_done))
        state["unit"] = data.unit
    return state


class BadBackup(ValueError):
    """A backup whose recorded state is not what :func:`backup_state` writes: never used."""


#: what :func:`backup_state` records; :func:`checked_state` refuses any other key
STATE_KEYS = ("size", "steps", "position", "unit")
_UNITS = ("sample", "batch")  # mgpu.data.shard's units: arrays' samples, a PyDataset's batches


def _whole(state: dict, key: str, low: int) -> None:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadBackup(f"{key}={value!r}, expected a whole number >= {low}")


def checked_state(text: str, extra_keys=()) -> dict:
    """The state :func:`backup_state` recorded in a backup, read back as data and checked.

    Args:
        text: the JSON text stored in the backup ("{}" for a backup without one).
        extra_keys: further keys the caller records and checks itself (the elastic state's).

    Returns:
        The state: only known keys; ``size`` a whole number >= 1, ``steps`` None or >= 1,
        ``position`` a whole number >= 0 with ``unit`` "sample" or "batch".

    Raises:
        BadBackup: anything else (the message says which key and what it holds).
    """
    try:  # bounded depth, NaN / Infinity refused: the writer never writes them
        state = folders.load_json(text.encode("utf-8", "replace"), "its state")
    except ValueError as error:
        raise BadBackup(str(error)) from None  # "its state is not JSON (...)", ...
    if not isinstance(state, dict):
        raise BadBackup(f"its state is a {type(state).__name__}, not a JSON object")
    unknown = sorted(set(state) - set(STATE_KEYS) - set(extra_keys))
    if unknown:
        raise BadBackup(f"its state holds unknown keys {unknown}; expected only "
                        f"{list(STATE_KEYS) + list(extra_keys)}")
    if "size" in state:
        _whole(state, "size", 1)
    if state.get("steps") is not None:
        _whole(state, "steps", 1)
    if ("position" in state) != ("unit" in state):
        raise BadBackup("its state holds one of position and unit without the other")
    if "position" in state:
        _whole(state, "position", 0)
        if state["unit"] not in _UNITS:
            raise BadBackup(f"unit={state['unit']!r}, expected one of {list(_UNITS)}")
    return state


def resume_point(epochs: int, batches: int, saved: dict, size: int, steps):
    """Where this job continues a backup of (`epochs` done, `batches` of the next done).

    Args:
        epochs, batches: the backup's position, in the numbering of the job that wrote it.
        saved: :func:`backup_state` of that job ({} for a backup without it: same size).
        size: this job's number of processes.
        steps: this ``fit``'s steps per epoch (None: unknown).

    Returns:
        ``(epochs, batches, note)``: where to resume, in this job's numbering, and what a
        resume across a size change did, in words ("" when the size is the same).

    With ``mgpu.data.shard`` data the epoch continues at the same global position of its
    order (:meth:`mgpu_launch.training.data._Shard.start_at`): every unit of the interrupted
    epoch is trained once, except a remainder smaller than one global batch of the new size.
    Other data resumes at the same fraction of the epoch, with a warning.
    """
    old_size = int(saved.get("size") or size)
    data = _training_data
    if "position" in saved and hasattr(data, "start_at") and batches:
        skip = data.start_at(saved["position"])
        if skip >= len(data):
            data.start_at(0)
            epochs, skip = epochs + 1, 0
        note = "" if old_size == size else (
            f"backed up by {_processes(old_size)} after {saved['position']} "
            f"{saved.get('unit', 'unit')}s of the epoch's order; now {_processes(size)}")
        return epochs, skip, note
    if old_size == size:
        return epochs, batches, ""
    if not batches:
        return epochs, 0, f"backed up by {_processes(old_size)}; now {_processes(size)}"
    old_steps = saved.get("steps")
    skip = batches * steps // old_steps if steps and old_steps else batches
    warnings.warn(f"BackupAndRestore: the backup was written by {old_size} processes, this job "
                  f"has {size}; only mgpu.data.shard data can continue at the same sample, so "
                  f"this data continues at the same fraction of the epoch (batch {skip} of "
                  f"{steps}).", stacklevel=3)
    if steps and skip >= steps:
        return epochs + 1, 0, f"backed up by {_processes(old_size)}; now {_processes(size)}"
    return epochs, skip, (f"backed up by {_processes(old_size)} after batch {batches}; now "
                          f"{_processes(size)}")


def _processes(count: int) -> str:
    return f"{count} process" + ("es" if count != 1 else "")


def move_data_on(adapter, epochs: int) -> None:
    """Put the adapter's data set at the start of epoch `epochs` (0-based), where it can."""
    dataset = getattr(adapter, "py_dataset", None)
    if dataset is None or not epochs:
        return  # arrays and tf.data: their order cannot be replayed (see BackupAndRestore)
    if hasattr(dataset, "skip_epochs"):
        dataset.skip_epochs(epochs)  # mgpu.data.shard's: jumps to that epoch's order
        return
    for _ in range(epochs):
        dataset.on_epoch_end()


def resumed_epoch(iterator, original, epochs: int, skip: int):
    """Yield what ``EpochIterator._enumerate_iterator`` yields, from batch `skip` on.

    Args:
        iterator: the Keras ``EpochIterator`` of the ``fit`` that resumes.
        original: Keras's own ``_enumerate_iterator`` (used when nothing is skipped).
        epochs: epochs finished before the backup.
        skip: batches of the next epoch finished before the backup.

    Yields:
        ``(first step, last step, batch iterator)`` as Keras's does, numbered from `skip`.

    Raises:
        ValueError: `skip` does not fit this ``fit``'s steps per epoch or steps per execution.
    """
    move_data_on(iterator.data_adapter, epochs)
    steps = iterator.steps_per_epoch or keras_internals.epoch_batches(iterator) or -1
    per_call = iterator.steps_per_execution
    if not skip:
        yield from original(iterator)
        return
    if steps <= 0 or skip >= steps or skip % per_call:
        raise ValueError(
            f"BackupAndRestore: the backup was taken after batch {skip} of epoch "
            f"{epochs + 1}, but this fit has {steps} steps per epoch with "
            f"steps_per_execution={per_call}. Resume with the data and fit arguments of the "
            f"interrupted run, or delete the backup folder.")
    adapter = iterator.data_adapter
    if keras_internals.shuffles(adapter):
        warnings.warn(
            "BackupAndRestore: fit(shuffle=True) reorders the batches with a random state "
            "the restarted job cannot replay, so the resumed epoch drops the first "
            f"{skip} batches of another order. For an exact resume pass shuffle=False to "
            "fit and shuffle with mgpu.data.shard(..., shuffle=True, seed=...).",
            stacklevel=3)
    adapter.on_epoch_begin()
    batches = keras_internals.restart_batches(iterator)
    for _ in range(skip):  # read and drop: the order is the interrupted run's
        next(batches)
    keras_internals.set_steps_seen(iterator, skip)
    for step in range(skip, steps, per_call):
        if _epoch_done(iterator):
            break
        keras_internals.set_steps_seen(iterator, keras_internals.steps_seen(iterator) + per_call)
        yield step, step + per_call - 1, keras_internals.current_batches(iterator)
    if _epoch_done(iterator):
        keras_internals.close_epoch(iterator)
    adapter.on_epoch_end()


def _epoch_done(iterator) -> bool:
    """Whether the epoch handed out every batch the data adapter has (when it knows)."""
    batches = keras_internals.epoch_batches(iterator)
    return bool(batches and keras_internals.steps_seen(iterator) >= batches)
