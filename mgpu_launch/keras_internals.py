"""Every Keras internal mgpu_launch reads, writes or calls, behind one checked door.

Keras has no public hook for a few things data-parallel training needs: the schedule object
behind an optimizer's ``learning_rate``, the variables it was built with, whether the step is
traced as a pure function, where a restored ``fit`` starts, how far an epoch's iterator got.
Each such internal has one accessor here, named for what it means, with one line saying why
mgpu_launch needs it. An accessor checks that the internal is still there and raises
:class:`KerasInternalsError`, naming the Keras version, the internal and its use, when a
Keras release renamed it: instead of an ``AttributeError`` deep inside a train step, or a
setter that silently creates an attribute the new Keras never reads.

Only this module and ``mgpu_launch.training.patches`` (the package whose modules replace
Keras methods) import ``keras.src`` or touch private attributes of Keras objects;
``tests/test_architecture.py`` fails on any other. Imports no framework at module level and
nothing of mgpu_launch: the engines use it too.

Example:
    >>> from mgpu_launch import keras_internals
    >>> keras_internals.raw_learning_rate(keras.optimizers.SGD(0.1))   # the variable itself
"""

import functools
import importlib
import inspect
from typing import Any, Dict, Tuple

__all__ = [
    "CHECKPOINT_METHODS", "KerasInternalsError", "SUPPORTED", "built_variables",
    "check_methods", "check_model_checkpoint",
    "checkpoint_current_epoch", "checkpoint_file_path", "checkpoint_should_save",
    "checkpoint_should_save_on_batch", "close_epoch", "current_batches", "epoch_batches",
    "in_stateless_scope", "in_symbolic_scope", "initial_epoch", "internals_error",
    "momentum_slots", "next_epoch_is_known_early",
    "own_variables", "raw_learning_rate", "restart_batches", "set_initial_epoch",
    "set_steps_seen", "shuffles", "steps_seen", "swap_learning_rate", "tf_dataset_of",
    "tf_epoch_dataset",
    "to_torch_dtype",
    "torch_convert_to_tensor", "torch_device",
]

#: what to do about a Keras that lacks an internal (the patches' errors end with it too)
SUPPORTED = ("mgpu_launch is tested with Keras 3.15 and 3.16: install one of those "
             "(pip install 'keras>=3.15,<3.17'), or report the Keras version.")

_REQUIRED = object()


class KerasInternalsError(RuntimeError):
    """A Keras internal that mgpu_launch uses or patches is missing or has another shape."""


def internals_error(where: str, why: str, problem: str) -> KerasInternalsError:
    """The error for the internal `where`, needed for `why`, found to have `problem`."""
    import keras

    return KerasInternalsError(f"mgpu_launch needs the Keras internal {where} ({why}), but in "
                               f"Keras {keras.__version__} {problem}. {SUPPORTED}")


def _get(owner, name: str, why: str, default: Any = _REQUIRED) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        if default is not _REQUIRED:
            return default
        raise internals_error(f"{type(owner).__name__}.{name}", why,
                              "it does not exist") from None


def _set(owner, name: str, value, why: str) -> None:
    _get(owner, name, why)  # a renamed attribute must not be created anew: Keras would not read it
    setattr(owner, name, value)


@functools.lru_cache(maxsize=None)
def _module(name: str, why: str):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise internals_error(name, why, f"it cannot be imported ({error})") from error


def _function(module, name: str, why: str):
    """`module`'s `name` (`module`: a name, or a tuple of where Keras releases keep it)."""
    # looked up at every call: a patch (mgpu_launch.training.patches) may rebind it in its module
    if isinstance(module, tuple):
        module = _first_importable(module, why)
    return _get(_module(module, why), name, why)


@functools.lru_cache(maxsize=None)
def _first_importable(modules: Tuple[str, ...], why: str) -> str:
    for name in modules[:-1]:
        try:
            importlib.import_module(name)
            return name
        except ImportError:
            continue
    return modules[-1]  # its error, if any, names the newest place


# -- optimizers ----------------------------------------------------------------------------------
_RATE = "the rate as given, a LearningRateSchedule not evaluated"


def raw_learning_rate(optimizer):
    """The optimizer's rate as given: a variable, or a LearningRateSchedule (not its value)."""
    return _get(optimizer, "_learning_rate", _RATE)


def swap_learning_rate(optimizer, rate):
    """Put `rate` (a schedule) in the optimizer's place for it; returns what was there.

    DistributedOptimizer puts its multiplied schedule there, and the user's back for saving.
    """
    previous = raw_learning_rate(optimizer)
    _set(optimizer, "_learning_rate", rate, _RATE)
    return previous


def built_variables(optimizer) -> list:
    """The trainable variables the optimizer was built with, in its order (checked across
    ranks; the order of its stateless update's values)."""
    return _get(optimizer, "_trainable_variables", "the variables an optimizer was built with")


def own_variables(optimizer) -> list:
    """The optimizer's own variables, without a wrapped optimizer's (DistributedOptimizer
    lists its own, then the inner optimizer's)."""
    return _get(optimizer, "_variables", "an optimizer's own variables")


def momentum_slots(optimizer):
    """The optimizer's momentum buffers (a list), or None where it keeps none by that name
    (LR warm-up corrects them when the rate jumps)."""
    for name in ("momentums", "_momentums"):
        slots = getattr(optimizer, name, None)
        if isinstance(slots, (list, tuple)) and slots:
            return list(slots)
    return None


# -- the step's scopes ---------------------------------------------------------------------------
_SCOPES = "keras.src.backend.common."


def in_stateless_scope() -> bool:
    """Whether variables are read and written through a ``StatelessScope`` (Keras's JAX step):
    a wrapped optimizer must then run its own stateless update."""
    return _function(_SCOPES + "stateless_scope", "in_stateless_scope",
                     "whether the train step is a pure function")()


def in_symbolic_scope() -> bool:
    """Whether Keras traces the step symbolically (variables have no values yet, so the first
    sync of rank 0's weights waits for a real step)."""
    return _function(_SCOPES + "symbolic_scope", "in_symbolic_scope",
                     "whether variables have values yet")()


# -- models and fit ------------------------------------------------------------------------------
_INITIAL = "the epoch fit starts at after a restore"


def initial_epoch(model):
    """The epoch a restore told ``fit`` to start at (None: none did)."""
    return _get(model, "_initial_epoch", _INITIAL)


def set_initial_epoch(model, epoch: int) -> None:
    """Make ``fit`` start at `epoch` (a restore, before the loop; Keras's own
    ``BackupAndRestore`` does the same)."""
    _set(model, "_initial_epoch", epoch, _INITIAL)


# -- an epoch's iterator (resuming in the middle of an epoch) -----------------------------------
_EPOCH = "resuming an epoch at a backed-up batch"


def epoch_batches(iterator):
    """Batches per epoch as the data adapter knows them (None: unknown before an epoch ran)."""
    return _get(iterator, "_num_batches", _EPOCH)


def restart_batches(iterator):
    """Start the epoch's batch iterator afresh and return it (a resumed epoch drops its first
    batches from it)."""
    batches = iter(_get(iterator, "_get_iterator", _EPOCH)())
    _set(iterator, "_current_iterator", batches, _EPOCH)
    return batches


def current_batches(iterator):
    """The epoch's batch iterator, which Keras's step loop reads its batches from."""
    return _get(iterator, "_current_iterator", _EPOCH)


def steps_seen(iterator) -> int:
    """Steps of this epoch handed out so far (Keras ends the epoch at the adapter's count)."""
    return _get(iterator, "_steps_seen", _EPOCH)


def set_steps_seen(iterator, steps: int) -> None:
    """Count `steps` steps of this epoch as handed out."""
    _set(iterator, "_steps_seen", steps, _EPOCH)


def close_epoch(iterator) -> None:
    """Forget the finished epoch's batches, so the next epoch starts its own."""
    _set(iterator, "_current_iterator", None, _EPOCH)
    set_steps_seen(iterator, 0)


_FEED = "beginning an epoch's batches while the epoch before it ends (device prefetch)"


def next_epoch_is_known_early(adapter) -> bool:
    """Whether the adapter's batches of the next epoch depend on nothing that runs between
    epochs, so they may be made before this epoch ends: arrays in their own order (not shuffled
    by ``fit``: ``mgpu.data.shard`` data, whose order mgpu draws from its own seeded generator,
    or ``shuffle=False``). Not: shuffled arrays (Keras draws each epoch's permutation from
    numpy's global generator, which the user's code between epochs may draw from too), any
    PyDataset (its ``__getitem__`` is the user's code: it may draw from ``random`` or numpy,
    issue 58) unless its class says ``mgpu_begin_early = True`` (its batches depend on their
    index only) and it has no ``on_epoch_begin`` / ``on_epoch_end`` of its own and no worker
    pool (whose start and stop Keras ties to the epoch), tf.data, generators, any other
    adapter. (Whether the backend allows it at all is the engine's ``runs_epochs_ahead``.)
    """
    arrays = _module("keras.src.trainers.data_adapters.array_data_adapter", _FEED)
    if isinstance(adapter, _get(arrays, "ArrayDataAdapter", _FEED)):
        return not shuffles(adapter)
    py = _module("keras.src.trainers.data_adapters.py_dataset_adapter", _FEED)
    if not isinstance(adapter, _get(py, "PyDatasetAdapter", _FEED)):
        return False
    dataset, base = _get(adapter, "py_dataset", _FEED), _get(py, "PyDataset", _FEED)
    return (getattr(type(dataset), "mgpu_begin_early", False) is True
            and _get(adapter, "enqueuer", _FEED) is None
            and type(dataset).on_epoch_end is base.on_epoch_end
            and type(dataset).on_epoch_begin is base.on_epoch_begin)


def tf_dataset_of(adapter):
    """The ``tf.data`` dataset given to ``fit`` when `adapter` is Keras's adapter of one (None
    for any other adapter): the JAX engine iterates it itself, and the device feed may begin
    its next epoch early when ``mgpu.data.shard`` made it."""
    module = _module("keras.src.trainers.data_adapters.tf_dataset_adapter", _FEED)
    if not isinstance(adapter, _get(module, "TFDatasetAdapter", _FEED)):
        return None
    return adapter.get_tf_dataset()


def tf_epoch_dataset(iterator):
    """What Keras's TensorFlow epoch iterator made for all its epochs (its own feeding
    re-iterates it): a tf.data dataset, or a distributed dataset under a strategy (the TF
    engine's feeding tells them apart)."""
    return _get(iterator, "_distributed_dataset", _FEED)


def shuffles(adapter) -> bool:
    """Whether ``fit`` shuffles this data adapter's batches (a resume cannot replay that).

    Keras keeps the flag public on a PyDataset's adapter, private on an array adapter's, and
    has none on adapters that never shuffle (tf.data, generators): absent means no.
    """
    return bool(getattr(adapter, "shuffle", None) or getattr(adapter, "_shuffle", None))


# -- ModelCheckpoint (mgpu_launch.callbacks.ModelCheckpoint overrides one, calls three) --------
#: ModelCheckpoint's private methods the subclass relies on -> their leading parameters
CHECKPOINT_METHODS: Dict[str, Tuple[str, ...]] = {
    "_save_model": ("self", "epoch", "batch", "logs"),  # overridden: rank 0, atomic write
    "_should_save_on_batch": ("self", "batch"),
    "_get_file_path": ("self", "epoch", "batch", "logs"),
    "_should_save_model": ("self", "epoch", "batch", "logs", "filepath"),
}
_CHECKPOINT = "saving checkpoints on rank 0 only, atomically"


def check_methods(owner: type, methods: Dict[str, Tuple[str, ...]], why: str) -> None:
    """Check that the class `owner` has each of `methods` (name -> leading parameters).

    Raises:
        KerasInternalsError: a method is missing or its parameters begin otherwise.
    """
    for name, parameters in methods.items():
        where = f"{owner.__module__}.{owner.__qualname__}.{name}"
        method = getattr(owner, name, None)
        if method is None:
            raise internals_error(where, why, "it does not exist")
        found = tuple(inspect.signature(method).parameters)
        if found[:len(parameters)] != parameters:
            raise internals_error(where, why, f"its parameters are {found}, expected them to "
                                              f"begin with {parameters}")


@functools.lru_cache(maxsize=None)
def check_model_checkpoint() -> None:
    """Check (once) that Keras's ModelCheckpoint still has the private methods the subclass
    overrides or calls, with their parameters: a renamed ``_save_model`` would otherwise be
    bypassed silently, every rank writing the file non-atomically."""
    import keras

    check_methods(keras.callbacks.ModelCheckpoint, CHECKPOINT_METHODS, _CHECKPOINT)


def checkpoint_should_save_on_batch(callback, batch: int) -> bool:
    """Whether ModelCheckpoint's ``save_freq`` (a number of batches) says save after `batch`."""
    return _get(callback, "_should_save_on_batch", _CHECKPOINT)(batch)


def checkpoint_current_epoch(callback) -> int:
    """The epoch ModelCheckpoint saw begin (what a save after a batch is named by)."""
    return _get(callback, "_current_epoch", _CHECKPOINT)


def checkpoint_file_path(callback, epoch: int, batch, logs) -> str:
    """ModelCheckpoint's file name for this save (its ``filepath`` formatted)."""
    return _get(callback, "_get_file_path", _CHECKPOINT)(epoch, batch, logs)


def checkpoint_should_save(callback, epoch: int, batch, logs, filepath: str) -> bool:
    """ModelCheckpoint's decision (``save_best_only``, ``initial_value_threshold``) for this
    save; it also records a new best value."""
    return _get(callback, "_should_save_model", _CHECKPOINT)(epoch, batch, logs, filepath)


# -- the torch backend (the engine's prefetcher, CUDA-graph capture) ----------------------------
#: Keras 3.15-3.16's module, then keras-team's HEAD's (3.16.0.dev, 2026-10)
_TORCH = ("keras.src.backend.torch.core", "keras.src.backend.torch.ops.core")


def torch_device():
    """The device Keras's torch backend puts tensors on (prefetched batches and captured
    constants must be there)."""
    return _function(_TORCH, "get_device", "the device of Keras's torch tensors")()


def to_torch_dtype(dtype):
    """Keras's torch dtype for a Keras dtype name (captured constants get Keras's dtypes)."""
    return _function(_TORCH, "to_torch_dtype", "the torch dtype Keras uses")(dtype)


def torch_convert_to_tensor(value):
    """The tensor Keras's torch backend makes of `value` (looked up at every call: with CUDA
    graphs on, mgpu_launch.training.patches replaces it)."""
    return _function(_TORCH, "convert_to_tensor", "a batch as the tensor Keras makes")(value)
