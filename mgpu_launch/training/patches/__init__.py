"""Every change mgpu_launch makes to Keras's internals, in one place, each checked on install.

mgpu_launch is plain Keras code except where Keras offers no hook: there it replaces a method
of a Keras class. All such replacements live here, and each is a :class:`Patch` that names
the class, the attribute and the leading parameters our replacement relies on. Installing
one first checks that the attribute still exists with those parameters; a Keras release
that renamed or reshaped it gives a :class:`KerasInternalsError` naming the Keras version and
the attribute, instead of a JAX step that silently stops reducing gradients.
The replacements are built by factories in two modules beside this one, which only this
module imports: ``fit`` (``fit``, the epoch iterators, the train functions, resuming) and
``objects`` (BatchNormalization, the optimizer's compile config and variables, ``compile``);
the registry, the checks and the installing stay here.

The patches (each changes behaviour only for models compiled with a DistributedOptimizer,
and only on the backend named):

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
``TorchTrainer.make_train_function``       torch     let the engine wrap the step (CUDA-graph
                                                     capture, ``MGPU_TORCH_CUDA_GRAPH=1``)
``torch_sgd.SGD._parallel_update_step``    torch     with capture on: the learning rate as a
                                                     device tensor (Keras reads it on the host)
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
``Trainer._resolve_auto_jit_compile``      torch     ``jit_compile="auto"``: the compiled step
                                                     (``backends.torch.compiled``) by default
                                                     on a GPU (``MGPU_TORCH_COMPILE``)
``TorchTrainer._should_torch_compile``     torch     never Keras's own ``torch.compile`` of
                                                     the step functions: the train step is
                                                     ours, evaluate and predict stay eager
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
optimizer; :func:`install_synchronized_batch_norm` applies them (at ``mgpu.init()`` of a
multi-process job, by ``mgpu_launch.layers``, and by every ``DistributedOptimizer``).

Entry points: :func:`install` (called by every ``DistributedOptimizer``) and
:func:`install_horovod_compile` (called by ``mgpu_launch.keras.init``). Both are idempotent.
"""

import dataclasses
import importlib
import inspect
import sys
from typing import Callable, Optional, Tuple

from mgpu_launch.backends.torch import compiled as torch_compiled, kernels as torch_kernels
from mgpu_launch.training.patches import fit as _training, objects as _layers
from mgpu_launch.config import settings
from mgpu_launch.training.patches.fit import uses_distributed_optimizer  # noqa: F401 (public here)
# the error of every Keras internal, the patched ones and those read elsewhere (public here)
from mgpu_launch.keras_internals import KerasInternalsError, SUPPORTED


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced Keras attribute.

    Args:
        owner: ``"module:Class"`` where the attribute is looked up (and set); alternatives
            joined by ``|`` where a Keras release moved or renamed the class (the first that
            imports is used).
        attribute: the method's name.
        parameters: the leading parameter names the replacement relies on, in order.
        optional: the attribute exists only in some Keras versions; absent means nothing to
            patch (present, it must still match `parameters`).
        everywhere: `owner` is a module whose function other Keras modules imported by name;
            rebind it in every loaded ``keras`` module that holds the original too.
    """

    owner: str
    attribute: str
    parameters: Tuple[str, ...]
    optional: bool = False
    everywhere: bool = False

    def owner_class(self) -> type:
        for candidate in self.owner.split("|"):
            module_name, class_name = candidate.split(":")
            try:
                return getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError) as error:
                missing = error
        raise missing

    def check(self) -> Optional[Callable]:
        """The attribute as Keras has it now, after checking its shape (None: optional, absent).

        Raises:
            KerasInternalsError: the attribute is missing or its parameters differ.
        """
        import keras

        where = f"{self.owner.replace(':', '.')}.{self.attribute}"
        try:
            original = getattr(self.owner_class(), self.attribute, None)
        except (ImportError, AttributeError) as error:
            raise KerasInternalsError(self._message(keras, where, f"{self.owner} cannot be "
                                                    f"imported ({error})")) from error
        if original is None:
            if self.optional:
                return None
            raise KerasInternalsError(self._message(keras, where, "it does not exist"))
        target = getattr(original, "__wrapped__", original) if _ours(original) else original
        target = target.fget if isinstance(target, property) else target
        found = tuple(inspect.signature(target).parameters)
        if found[:len(self.parameters)] != self.parameters:
            raise KerasInternalsError(self._message(
                keras, where, f"its parameters are {found}, expected them to begin with "
                              f"{self.parameters}"))
        return original

    def _message(self, keras, where: str, problem: str) -> str:
        return (f"mgpu_launch patches {where}, but in Keras {keras.__version__} {problem}. "
                f"{SUPPORTED}")


_BATCH_NORM = "keras.src.layers.normalization.batch_normalization:BatchNormalization"
# Keras 3.15-3.16 names, then keras-team's HEAD's (3.16.0.dev, 2026-10: Trainer -> BaseTrainer,
# the backends' JAXTrainer / TorchTrainer -> Trainer, torch's core -> ops.core)
_TRAINER = "keras.src.trainers.trainer:Trainer|keras.src.trainers.trainer:BaseTrainer"
_JAX_TRAINER = "keras.src.backend.jax.trainer:JAXTrainer|keras.src.backend.jax.trainer:Trainer"
_TORCH_TRAINER = ("keras.src.backend.torch.trainer:TorchTrainer"
                  "|keras.src.backend.torch.trainer:Trainer")
_TORCH_CORE = "keras.src.backend.torch:core|keras.src.backend.torch.ops:core"
#: name -> Patch; its factory (:data:`_FACTORIES`) builds the replacement from the original.
PATCHES = {
    "fit": Patch("keras.src.models.model:Model", "fit",
                 ("self", "x", "y", "batch_size", "epochs", "verbose", "callbacks")),
    "jax_iterator": Patch("keras.src.backend.jax.trainer:JAXEpochIterator", "_get_iterator",
                          ("self",)),
    "torch_iterator": Patch("keras.src.backend.torch.trainer:TorchEpochIterator",
                            "_get_iterator", ("self",)),
    "tf_iterator": Patch("keras.src.backend.tensorflow.trainer:TFEpochIterator",
                         "_get_iterator", ("self",)),
    "jax_train_function": Patch(_JAX_TRAINER, "make_train_function", ("self", "force")),
    "jax_state_sync": Patch(_JAX_TRAINER, "jax_state_sync", ("self",)),
    "torch_ddp": Patch(_TORCH_TRAINER, "_initialize_ddp", ("self",), optional=True),
    "torch_metrics": Patch(_TORCH_TRAINER, "get_metrics_result", ("self",)),
    "torch_train_function": Patch(_TORCH_TRAINER, "make_train_function", ("self", "force")),
    "torch_sgd_update": Patch("keras.src.backend.torch.optimizers.torch_sgd:SGD",
                              "_parallel_update_step",
                              ("self", "grads", "variables", "learning_rate")),
    "torch_scalars": Patch(_TORCH_CORE, "convert_to_tensor", ("x", "dtype"), everywhere=True),
    "compile": Patch(_TRAINER, "compile", ("self", "optimizer")),
    "optimizer_variables": Patch("keras.src.optimizers.base_optimizer:BaseOptimizer",
                                 "variables", ("self",)),
    "resume_iterator": Patch("keras.src.trainers.epoch_iterator:EpochIterator",
                             "_enumerate_iterator", ("self",)),
    "compile_config": Patch(_TRAINER, "get_compile_config", ("self",)),
    "tf_auto_jit": Patch(_TRAINER, "_resolve_auto_jit_compile", ("self",)),
    "torch_auto_jit": Patch(_TRAINER, "_resolve_auto_jit_compile", ("self",)),
    "torch_keras_compile": Patch(_TORCH_TRAINER, "_should_torch_compile", ("self",),
                                 optional=True),
    "batch_norm_init": Patch(_BATCH_NORM, "__init__", ("self", "axis", "momentum")),
    "batch_norm_moments": Patch(_BATCH_NORM, "_moments", ("self", "inputs", "mask")),
    "torch_batch_norm": Patch(_BATCH_NORM, "call", ("self", "inputs", "training", "mask")),
    "torch_conv": Patch("keras.src.backend.torch:nn", "conv",
                        ("inputs", "kernel", "strides", "padding", "data_format",
                         "dilation_rate"), everywhere=True),
}

#: backend -> the patches :func:`install` applies there, in order.
BY_BACKEND = {
    "tensorflow": ("fit", "compile_config", "tf_auto_jit", "tf_iterator"),
    "jax": ("fit", "compile_config", "jax_iterator", "jax_train_function", "jax_state_sync"),
    "torch": ("fit", "compile_config", "torch_iterator", "torch_ddp", "torch_metrics",
              "torch_train_function", "torch_auto_jit", "torch_keras_compile"),
}
#: applied once a torch train step is wrapped for CUDA-graph capture: otherwise every step of
#: every torch job would pay their extra Python frames (convert_to_tensor runs many times a step)
FOR_CUDA_GRAPHS = ("torch_sgd_update", "torch_scalars")
#: torch's own kernels for Keras's torch lowering (backends/torch/kernels.py); unless
#: MGPU_TORCH_KERNELS=0, installed with :data:`BY_BACKEND`'s (after the synchronized
#: BatchNormalization patches, whose ``_moments`` the replacement call checks for)
TORCH_KERNELS = ("torch_batch_norm", "torch_conv")
#: engine name -> the patches mgpu.init() installs for every model on a multi-process job: on
#: torch, Keras >= 3.16 must run no collective of its own on mgpu's process group (no DDP
#: wrapper, no metric sums), whatever the model's optimizer
AT_INIT = {"torch": ("torch_ddp", "torch_metrics")}


def _ours(function) -> bool:
    return getattr(function, "_mgpu", False)


def apply(name: str) -> None:
    """Install the patch `name` (idempotent), after checking the attribute it replaces."""
    patch = PATCHES[name]
    original = patch.check()
    if original is None or _ours(original):
        return
    replacement = _FACTORIES[name](original)
    replacement._mgpu = True
    replacement.__wrapped__ = original
    setattr(patch.owner_class(), patch.attribute, replacement)
    if patch.everywhere:
        for module_name, module in list(sys.modules.items()):
            if (module_name.split(".")[0] == "keras" and module is not None
                    and getattr(module, patch.attribute, None) is original):
                setattr(module, patch.attribute, replacement)


def install(distributed_class: type, backend: Optional[str] = None) -> None:
    """Install every patch for `backend` (default: Keras's). Called by DistributedOptimizer.

    Args:
        distributed_class: the optimizer class whose models the patches act on (passed in,
            so this module need not import ``mgpu_launch.training.optimizer``, which imports it).
        backend: a Keras backend name.

    Raises:
        KerasInternalsError: a patched Keras attribute is missing or reshaped.
    """
    _training.set_distributed_class(distributed_class)
    if backend is None:
        import keras
        backend = keras.backend.backend()
    for name in BY_BACKEND.get(backend, ("fit", "compile_config")):
        apply(name)
    install_synchronized_batch_norm()
    if backend == "torch" and settings.flag("MGPU_TORCH_KERNELS"):
        for name in TORCH_KERNELS:
            apply(name)


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


def install_at_init(engine_name: str) -> None:
    """At mgpu.init() on a multi-process job: the patches `engine_name`'s engine needs for
    every model (:data:`AT_INIT`)."""
    for name in AT_INIT.get(engine_name, ()):
        apply(name)


def install_synchronized_batch_norm() -> None:
    """Make ``BatchNormalization(synchronized=True)`` synchronize under mgpu, on every backend."""
    for name in ("batch_norm_init", "batch_norm_moments"):
        apply(name)


def install_horovod_compile() -> None:
    """Let ``compile`` accept Keras 2's ``experimental_run_tf_function`` (mgpu_launch.keras)."""
    apply("compile")


def install_callable_optimizer_variables() -> None:
    """Let ``opt.variables()`` (Keras 2's method) work beside ``opt.variables`` (Keras 3's
    property): the Horovod namespaces' ``init()``, for Horovod's TF2 scripts."""
    apply("optimizer_variables")


# -- the replacements (built in patches/fit.py and patches/objects.py) --------------------------
def _install_for_cuda_graphs() -> None:
    for name in FOR_CUDA_GRAPHS:
        apply(name)


def _batch_norm_init(original):
    # the replacement takes `synchronized` out of Keras's arguments: Keras must have it
    if "synchronized" not in inspect.signature(original).parameters:
        raise KerasInternalsError(Patch(_BATCH_NORM, "__init__", ())._message(
            importlib.import_module("keras"), "BatchNormalization.__init__",
            "it has no `synchronized` parameter"))
    return _layers.batch_norm_init(original)


#: name -> the factory that builds the replacement of PATCHES[name] from Keras's original
_FACTORIES = {
    "fit": _training.fit, "jax_iterator": _training.epoch_iterator,
    "torch_iterator": _training.epoch_iterator, "tf_iterator": _training.epoch_iterator,
    "jax_train_function": _training.jax_train_function,
    "jax_state_sync": _training.jax_state_sync, "torch_ddp": _training.torch_ddp,
    # Keras's own (BaseTrainer's) get_metrics_result: the result without the cross-rank sum
    "torch_metrics": lambda original: _training.torch_metrics(
        original, Patch(_TRAINER, "get_metrics_result", ("self",)).check()),
    "torch_train_function": lambda original: _training.torch_train_function(
        original, on_capture=_install_for_cuda_graphs),
    "torch_sgd_update": _training.torch_sgd_update, "torch_scalars": _training.torch_scalars,
    "resume_iterator": _training.resume_iterator, "tf_auto_jit": _training.tf_auto_jit,
    "torch_auto_jit": lambda original: _training.torch_auto_jit(original,
                                                                torch_compiled.default_on),
    "torch_keras_compile": _training.torch_keras_compile,
    "compile": _layers.horovod_compile, "compile_config": _layers.compile_config,
    "batch_norm_init": _batch_norm_init, "batch_norm_moments": _layers.batch_norm_moments,
    "optimizer_variables": _layers.optimizer_variables,
    "torch_batch_norm": lambda original: torch_kernels.batch_norm(
        original, PATCHES["batch_norm_moments"].owner_class()._moments),
    "torch_conv": torch_kernels.conv,
}
