"""Every change mgpu_launch makes to Keras's internals, installed once, each checked on install.

mgpu_launch is plain Keras code except where Keras offers no hook: there it replaces a method
of a Keras class. Each replacement is a ``keras_patching.Replacement``: a :class:`Patch` that
names the class, the attribute and the leading parameters our replacement relies on, and the
factory that builds it. Installing one first checks that the attribute still exists with
those parameters; a Keras release that renamed or reshaped it gives a
:class:`KerasInternalsError` naming the Keras version and the attribute, instead of a JAX step
that silently stops reducing gradients. The replacements every backend shares are declared
here and built by factories in two modules beside this one: ``fit`` (``fit``, the epoch
iterators' feed, resuming) and ``objects`` (BatchNormalization, the optimizer's compile config
and variables, ``compile``); each backend's own are its engine's patch set
(``Engine.keras_patches``, declared in ``backends/<name>/patches.py``).

:func:`install` is the one function that installs them, once: ``mgpu.init()`` (the
composition root, ``training/bootstrap.py``) calls it, and so does the first
``DistributedOptimizer``, ``SyncBatchNormalization`` or ``mgpu.data.shard`` of a script that
never called ``mgpu.init()`` (it then finds the context installed, or installs it). The
patches recognise a DistributedOptimizer's model by its options
(``training.optimizer_options.distributed_optimizer``), not by a class set at install.

The patches (each changes behaviour only for models compiled with a DistributedOptimizer,
and only on the backend named; a backend's rows are declared in ``backends/<name>/patches.py``):

=========================================  ========  ===========================================
Keras attribute                            backend   why
=========================================  ========  ===========================================
``Model.fit``                              all       add the pre-training agreement check
                                                     (``training.fit_guard``), multi-process,
                                                     and the stall inspector's step probes
                                                     (``training.stall_probes``); keep the
                                                     order of ``mgpu.data.shard`` data (any model)
``JAXEpochIterator._get_iterator``         jax       feed batches from the device prefetcher
``TorchEpochIterator._get_iterator``       torch     feed batches from the device prefetcher
``TFEpochIterator._get_iterator``          tf        the same, which also takes Keras's train
                                                     function off its tf.data path (one wait
                                                     for the device per call)
``JAXTrainer.make_train_function``         jax       run the train step under the engine's
                                                     ``shard_map`` (gradients ``psum``-ed)
``JAXTrainer.jax_state_sync``              jax       give Keras process-local arrays back
``TorchTrainer._initialize_ddp``           torch     Keras >= 3.16 only: no DDP around any
                                                     model once mgpu owns the process group
                                                     (ours: reduced already; others: local,
                                                     and DDP's set-up is a collective)
``TorchTrainer.get_metrics_result``        torch     Keras >= 3.16 only: metrics stay per rank
                                                     (its per-step metric all-reduce hangs a
                                                     fit or evaluate on one rank alone)
``Trainer.get_compile_config``             all       save the inner optimizer (and the wrapper's
                                                     settings in a key Keras ignores), so a
                                                     saved model loads without mgpu_launch
``TorchTrainer.make_train_function``       torch     let the engine wrap the step (compiled,
                                                     ``backends.torch.compiled``; CUDA-graph
                                                     capture, ``MGPU_TORCH_CUDA_GRAPH=1``)
``Trainer._resolve_auto_jit_compile``      torch     ``jit_compile="auto"``: the compiled step
                                                     where ``MGPU_TORCH_COMPILE`` says (by
                                                     default on a GPU)
``TorchTrainer._should_torch_compile``     torch     never Keras's own ``torch.compile`` of the
                                                     step functions (evaluate, predict: eager)
``torch_sgd.SGD._parallel_update_step``    torch     with the step compiled or captured: the
                                                     learning rate as a device tensor (Keras
                                                     reads it on the host)
``BatchNormalization.call``                torch     on ``torch.nn.functional.batch_norm`` (one
                                                     fused kernel, not Keras's float32
                                                     arithmetic); any model, unless
                                                     ``MGPU_TORCH_KERNELS=0``
                                                     (``mgpu_launch.backends.torch.kernels``)
``torch.nn.conv``                          torch     ``channels_last``: the input as a
                                                     channels-first view, not two copies; the
                                                     same conditions
``torch.core.convert_to_tensor``            torch     while a step is warmed up or captured: a
                                                     Python number becomes a device tensor by a
                                                     fill kernel, not a synchronous host copy
``Trainer._resolve_auto_jit_compile``      tf        ``jit_compile="auto"``: no XLA where the
                                                     engine's collectives cannot be compiled
                                                     (CPU, ``MGPU_TF_COLLECTIVE=ring``)
``Trainer.compile``                        all       ``mgpu_launch.keras`` (Horovod names) only:
                                                     drop Keras 2's experimental_run_tf_function
``BaseOptimizer.variables`` (a property)   all       Horovod namespaces only: also callable, as
                                                     Keras 2's ``opt.variables()`` (Horovod's
                                                     TF2 examples call it)
``EpochIterator._enumerate_iterator``      all       ``callbacks.BackupAndRestore`` only, once,
                                                     after a restore: start the data at the
                                                     backed-up epoch and batch (:func:`resume_at`,
                                                     ``mgpu_launch.training.epoch_resume``)
``BatchNormalization.__init__``            all       ``synchronized=True`` accepted on JAX and
                                                     torch (Keras raises: TensorFlow only)
``BatchNormalization._moments``            all       ``synchronized=True``, multi-process: the
                                                     statistics of every rank's batch
                                                     (``mgpu_launch.layers``), not the local
                                                     ones Keras-TF silently falls back to
=========================================  ========  ===========================================

The two BatchNormalization patches act on layers built with ``synchronized=True``, whatever the
optimizer. ``compile`` and ``BaseOptimizer.variables`` are installed only when a Horovod
namespace's ``init()`` asks for them (its ``keras_2`` names).
"""

import dataclasses
import importlib
import inspect
from typing import Dict, Optional, Sequence, Tuple

from mgpu_launch import backends
from mgpu_launch.keras_patching import (BATCH_NORM, TRAINER, Hooks, Patch, PatchSet,  # noqa: F401
                                        Replacement, apply as apply_replacement, is_ours)
from mgpu_launch.training import optimizer_options
from mgpu_launch.training.patches import fit as _training, objects as _layers
from mgpu_launch.training.patches.fit import uses_distributed_optimizer  # noqa: F401 (public here)
# the error of every Keras internal, the patched ones and those read elsewhere (public here)
from mgpu_launch.keras_internals import KerasInternalsError, SUPPORTED  # noqa: F401


def _batch_norm_init(original):
    # the replacement takes `synchronized` out of Keras's arguments: Keras must have it
    if "synchronized" not in inspect.signature(original).parameters:
        raise KerasInternalsError(Patch(BATCH_NORM, "__init__", ()).message(
            importlib.import_module("keras"), "BatchNormalization.__init__",
            "it has no `synchronized` parameter"))
    return _layers.batch_norm_init(original)


#: the replacements every backend shares, by name (a backend's own: its engine's patch set)
SHARED: Dict[str, Replacement] = {r.name: r for r in (
    Replacement("fit", Patch("keras.src.models.model:Model", "fit",
                             ("self", "x", "y", "batch_size", "epochs", "verbose", "callbacks")),
                _training.fit, "the agreement check, the stall probes, shard()'s order"),
    Replacement("compile_config", Patch(TRAINER, "get_compile_config", ("self",)),
                _layers.compile_config, "save the inner optimizer"),
    Replacement("batch_norm_init", Patch(BATCH_NORM, "__init__", ("self", "axis", "momentum")),
                _batch_norm_init, "synchronized=True accepted on JAX and torch"),
    Replacement("batch_norm_moments", Patch(BATCH_NORM, "_moments", ("self", "inputs", "mask")),
                _layers.batch_norm_moments, "synchronized=True: every rank's statistics"),
    Replacement("resume_iterator", Patch("keras.src.trainers.epoch_iterator:EpochIterator",
                                         "_enumerate_iterator", ("self",)),
                _training.resume_iterator, "start at the backed-up epoch and batch"),
    Replacement("compile", Patch(TRAINER, "compile", ("self", "optimizer")),
                _layers.horovod_compile, "Horovod names: drop experimental_run_tf_function"),
    Replacement("optimizer_variables", Patch("keras.src.optimizers.base_optimizer:BaseOptimizer",
                                             "variables", ("self",)),
                _layers.optimizer_variables, "Horovod names: opt.variables() callable"),
)}
#: name -> Patch of :data:`SHARED` (what each replaces)
PATCHES: Dict[str, Patch] = {name: r.patch for name, r in SHARED.items()}
#: what a Horovod namespace's init() may add (Keras 2's compile argument, opt.variables())
KERAS_2 = ("compile", "optimizer_variables")


@dataclasses.dataclass(frozen=True)
class PatchContext:
    """What :func:`install` installed: the backend's patch set (None: only the Horovod names'
    Keras 2 patches, where no model patch was wanted) and those Keras 2 names."""

    patch_set: Optional[PatchSet]
    keras_2: Tuple[str, ...] = ()


_context: Optional[PatchContext] = None


def hooks() -> Hooks:
    """What the backends' patch sets get from this layer (values down, no upward import)."""
    return Hooks(uses_distributed_optimizer=uses_distributed_optimizer,
                 step_options=optimizer_options.step_options,
                 epoch_iterator=_training.epoch_iterator)


def install(keras_2: Sequence[str] = (), *, models: bool = True) -> PatchContext:
    """Install mgpu's Keras patches: the one function that does (idempotent).

    The shared patches and the backend's patch set (its engine's, or none for a backend
    without one), then the synchronized BatchNormalization patches, then the backend's
    kernels; once. A later call only adds what it asks for that is not installed yet.

    Args:
        keras_2: names of :data:`KERAS_2` to install too (a Horovod namespace's init()).
        models: False installs only `keras_2` (``mgpu.init()`` where no model patch is wanted:
            ``MGPU_ENGINE=none``, or one process of a script that has not loaded Keras).

    Returns:
        The installed context.

    Raises:
        KerasInternalsError: a patched Keras attribute is missing or reshaped.
        ValueError: a name of `keras_2` is not one of :data:`KERAS_2`.
    """
    global _context
    unknown = sorted(set(keras_2) - set(KERAS_2))
    if unknown:
        raise ValueError(f"keras_2={list(keras_2)!r}: {unknown} are not Keras 2 patches; "
                         f"expected names among {list(KERAS_2)}")
    context = _context or PatchContext(patch_set=None)
    if models and context.patch_set is None:
        patch_set = backends.get_engine_or_default().keras_patches(hooks())
        for replacement in (SHARED["fit"], SHARED["compile_config"]) + patch_set.every_model:
            apply_replacement(replacement)
        install_synchronized_batch_norm()
        for replacement in patch_set.kernels:
            apply_replacement(replacement)
        context = dataclasses.replace(context, patch_set=patch_set)
    added = tuple(name for name in dict.fromkeys(keras_2) if name not in context.keras_2)
    for name in added:
        apply_replacement(SHARED[name])
    if added:
        context = dataclasses.replace(context, keras_2=context.keras_2 + added)
    _context = context
    return context


def installed() -> Optional[PatchContext]:
    """The installed context (None: :func:`install` has not run)."""
    return _context


def apply(name: str) -> None:
    """Install the shared patch `name` alone (idempotent; tests, and :func:`resume_at`)."""
    apply_replacement(SHARED[name])


def resume_at(epochs_done: int, batches_done: int) -> None:
    """Make the next epoch that starts (``fit``'s first, after a restore) resume the data.

    The data set is first moved on by `epochs_done` epochs — ``mgpu.data.shard``'s data by
    its epoch-seeded order, another PyDataset by calling its ``on_epoch_end`` that many times —
    then the epoch's first `batches_done` batches are read and dropped, and the epoch's steps
    are numbered from `batches_done`, so callbacks see the batch indices of the interrupted
    run. Used by ``mgpu_launch.callbacks.BackupAndRestore``; (0, 0) or a later call cancels.

    Args:
        epochs_done: epochs finished before the backup (``fit`` starts at this epoch).
        batches_done: batches of that epoch finished before the backup.
    """
    at = (int(epochs_done), int(batches_done)) if (epochs_done or batches_done) else None
    _training.set_resume(at)
    if at is not None:
        apply("resume_iterator")


def install_synchronized_batch_norm() -> None:
    """Make ``BatchNormalization(synchronized=True)`` synchronize under mgpu, on every backend
    (part of :func:`install`)."""
    for name in ("batch_norm_init", "batch_norm_moments"):
        apply(name)
