"""Every change mgpu_launch makes to Keras's internals, in one place, each checked on install.

mgpu_launch is plain Keras code except where Keras offers no hook: there it replaces a method
of a Keras class. All such replacements live here, and each is a :class:`Patch` that names
the class, the attribute and the leading parameters our replacement relies on. Installing
one first checks that the attribute still exists with those parameters; a Keras release
that renamed or reshaped it gives a :class:`KerasInternalsError` naming the Keras version and
the attribute, instead of a JAX step that silently stops reducing gradients.

The patches (each changes behaviour only for models compiled with a DistributedOptimizer,
and only on the backend named):

=========================================  ========  ===========================================
Keras attribute                            backend   why
=========================================  ========  ===========================================
``Model.fit``                              all       add the pre-training agreement check
                                                     (``mgpu_launch.fit_guard``), multi-process,
                                                     and the stall inspector's step probes
                                                     (``mgpu_launch.stall_probes``); keep the
                                                     order of ``mgpu.data.shard`` data (any model)
``JAXEpochIterator._get_iterator``         jax       feed batches from the device prefetcher
``TorchEpochIterator._get_iterator``       torch     feed batches from the device prefetcher
``TFEpochIterator._get_iterator``          tf        the same, which also takes Keras's train
                                                     function off its tf.data path (one wait
                                                     for the device per call)
``JAXTrainer.make_train_function``         jax       run the train step under the engine's
                                                     ``shard_map`` (gradients ``psum``-ed)
``JAXTrainer.jax_state_sync``              jax       give Keras process-local arrays back
``TorchTrainer._initialize_ddp``           torch     Keras >= 3.16 only: no DDP around a model
                                                     whose gradients we reduce already
``Trainer.get_compile_config``             all       save the inner optimizer (and the wrapper's
                                                     settings in a key Keras ignores), so a
                                                     saved model loads without mgpu_launch
``TorchTrainer.make_train_function``       torch     let the engine wrap the step (CUDA-graph
                                                     capture, ``MGPU_TORCH_CUDA_GRAPH=1``)
``torch_sgd.SGD._parallel_update_step``    torch     with capture on: the learning rate as a
                                                     device tensor (Keras reads it on the host)
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
                                                     ``mgpu_launch.epoch_resume``)
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
import functools
import importlib
import inspect
import sys
import warnings
from typing import Callable, Optional, Tuple

from mgpu_launch import engines, epoch_resume, fit_guard, prefetch, runtime, stall_probes


class KerasInternalsError(RuntimeError):
    """A Keras internal that mgpu_launch patches is missing or has another signature."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced Keras attribute.

    Args:
        owner: ``"module:Class"`` where the attribute is looked up (and set).
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
        module_name, class_name = self.owner.split(":")
        return getattr(importlib.import_module(module_name), class_name)

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
                f"mgpu_launch is tested with Keras 3.15 and 3.16: install one of those "
                f"(pip install 'keras>=3.15,<3.17'), or report the Keras version.")


_BATCH_NORM = "keras.src.layers.normalization.batch_normalization:BatchNormalization"
#: name -> Patch; the factories below build each replacement from the original.
PATCHES = {
    "fit": Patch("keras.src.models.model:Model", "fit",
                 ("self", "x", "y", "batch_size", "epochs", "verbose", "callbacks")),
    "jax_iterator": Patch("keras.src.backend.jax.trainer:JAXEpochIterator", "_get_iterator",
                          ("self",)),
    "torch_iterator": Patch("keras.src.backend.torch.trainer:TorchEpochIterator",
                            "_get_iterator", ("self",)),
    "tf_iterator": Patch("keras.src.backend.tensorflow.trainer:TFEpochIterator",
                         "_get_iterator", ("self",)),
    "jax_train_function": Patch("keras.src.backend.jax.trainer:JAXTrainer",
                                "make_train_function", ("self", "force")),
    "jax_state_sync": Patch("keras.src.backend.jax.trainer:JAXTrainer", "jax_state_sync",
                            ("self",)),
    "torch_ddp": Patch("keras.src.backend.torch.trainer:TorchTrainer", "_initialize_ddp",
                       ("self",), optional=True),
    "torch_train_function": Patch("keras.src.backend.torch.trainer:TorchTrainer",
                                  "make_train_function", ("self", "force")),
    "torch_sgd_update": Patch("keras.src.backend.torch.optimizers.torch_sgd:SGD",
                              "_parallel_update_step",
                              ("self", "grads", "variables", "learning_rate")),
    "torch_scalars": Patch("keras.src.backend.torch:core", "convert_to_tensor",
                           ("x", "dtype"), everywhere=True),
    "compile": Patch("keras.src.trainers.trainer:Trainer", "compile", ("self", "optimizer")),
    "optimizer_variables": Patch("keras.src.optimizers.base_optimizer:BaseOptimizer",
                                 "variables", ("self",)),
    "resume_iterator": Patch("keras.src.trainers.epoch_iterator:EpochIterator",
                             "_enumerate_iterator", ("self",)),
    "compile_config": Patch("keras.src.trainers.trainer:Trainer", "get_compile_config",
                            ("self",)),
    "tf_auto_jit": Patch("keras.src.trainers.trainer:Trainer", "_resolve_auto_jit_compile",
                         ("self",)),
    "batch_norm_init": Patch(_BATCH_NORM, "__init__", ("self", "axis", "momentum")),
    "batch_norm_moments": Patch(_BATCH_NORM, "_moments", ("self", "inputs", "mask")),
}

#: backend -> the patches :func:`install` applies there, in order.
BY_BACKEND = {
    "tensorflow": ("fit", "compile_config", "tf_auto_jit", "tf_iterator"),
    "jax": ("fit", "compile_config", "jax_iterator", "jax_train_function", "jax_state_sync"),
    "torch": ("fit", "compile_config", "torch_iterator", "torch_ddp", "torch_train_function"),
}
#: applied once a torch train step is wrapped for CUDA-graph capture: otherwise every step of
#: every torch job would pay their extra Python frames (convert_to_tensor runs many times a step)
FOR_CUDA_GRAPHS = ("torch_sgd_update", "torch_scalars")

_distributed_class: Optional[type] = None
# (epochs done, batches done in the next epoch) for the next training epoch to start from.
_resume: Optional[Tuple[int, int]] = None


def _ours(function) -> bool:
    return getattr(function, "_mgpu", False)


def uses_distributed_optimizer(model) -> bool:
    """Whether `model` was compiled with a DistributedOptimizer (also under a LossScaleOptimizer)."""
    if _distributed_class is None:
        return False
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", None)
    return isinstance(optimizer, _distributed_class) or isinstance(inner, _distributed_class)


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
            so this module need not import ``mgpu_launch.optimizer``, which imports it).
        backend: a Keras backend name.

    Raises:
        KerasInternalsError: a patched Keras attribute is missing or reshaped.
    """
    global _distributed_class
    _distributed_class = distributed_class
    if backend is None:
        import keras
        backend = keras.backend.backend()
    for name in BY_BACKEND.get(backend, ("fit", "compile_config")):
        apply(name)
    install_synchronized_batch_norm()


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
    global _resume
    _resume = (int(epochs_done), int(batches_done)) if (epochs_done or batches_done) else None
    if _resume is not None:
        apply("resume_iterator")


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


# -- the replacements ----------------------------------------------------------------------------
def _fit(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        ours = uses_distributed_optimizer(self)
        guarded = ours and runtime.is_multi_process()
        probed = ours and stall_probes.wanted()
        bound = signature.bind(self, *args, **kwargs)
        ordered = epoch_resume.keeps_its_order(bound.arguments.get("x"), bound.arguments)
        if not (guarded or probed or ordered):
            return original(self, *args, **kwargs)
        bound.apply_defaults()
        if ordered:  # shard() shuffles replayably; fit's shuffle could not be replayed
            bound.arguments["shuffle"] = False
        if guarded:
            fit_guard.add_agreement_check(bound.arguments)
        if probed:
            stall_probes.add_probes(bound.arguments)
        with epoch_resume.training_on(bound.arguments["x"]):
            return original(*bound.args, **bound.kwargs)
    return fit


def _epoch_iterator(original):
    # Each epoch asks the engine for the batches to prefetch; None (or depth 0) keeps Keras's.
    def _get_iterator(self):
        engine = engines.get_engine_or_default()
        depth = prefetch.prefetch_depth(engine.computes_on_accelerator())
        batches = engine.prefetch_source(self, original) if depth else None
        if batches is None:
            return original(self)
        return prefetch.Prefetcher(batches, engine.prefetch_transfer(), depth)
    return _get_iterator


def _jax_train_function(original):
    def make_train_function(self, force=False):
        engine = engines.get_engine()
        if not (uses_distributed_optimizer(self) and engine.owns_train_step()):
            return original(self, force)
        if self.train_function is not None and not force:
            return
        self.train_function = self._make_function(engine.train_function(self))
    return make_train_function


def _jax_state_sync(original):
    def jax_state_sync(self):
        if getattr(self, "_jax_state", None) and not self._jax_state_synced:
            # Keras keeps these as TrackedLists, which jax.tree treats as leaves.
            localize = engines.get_engine().localize
            self._jax_state = {key: [localize(v) for v in values]
                               for key, values in self._jax_state.items()}
        original(self)
    return jax_state_sync


def _torch_ddp(original):
    def _initialize_ddp(self):
        if uses_distributed_optimizer(self):
            return  # mgpu_launch reduces the gradients; DDP would do it a second time
        original(self)
    return _initialize_ddp


def _tf_auto_jit(original):
    # Keras resolves "auto" to XLA on any machine with a GPU; a step whose collectives XLA
    # cannot compile (the host ring) would then fail at its first trace.
    def _resolve_auto_jit_compile(self):
        if (uses_distributed_optimizer(self) and runtime.is_multi_process()
                and not engines.get_engine().compiles_collectives()):
            return False
        return original(self)
    return _resolve_auto_jit_compile


def _compile_config(original):
    # Keras names a saved object's class after type(obj): without this, a saved model's
    # optimizer is "DistributedOptimizer", which only loads where mgpu_launch is importable.
    @functools.wraps(original)
    def get_compile_config(self):
        config = original(self)
        optimizer = getattr(self, "optimizer", None)
        if (isinstance(config, dict) and "optimizer" in config and _distributed_class
                is not None and isinstance(optimizer, _distributed_class)):
            config = dict(config, optimizer=optimizer.inner_config())
        return config
    return get_compile_config
def _torch_train_function(original):
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        original(self, force)
        if uses_distributed_optimizer(self):
            wrapped = engines.get_engine().wrap_train_function(self, self.train_function)
            if wrapped is not self.train_function:  # capture asked for
                for name in FOR_CUDA_GRAPHS:
                    apply(name)
            self.train_function = wrapped
        return self.train_function
    return make_train_function


def _torch_sgd_update(original):
    # Keras passes the rate as alpha= of _foreach_add_, a host read (.item()) every step,
    # which a CUDA graph cannot contain. The same update with the rate as a device tensor:
    # v <- m*v - lr*g; w <- w + v (nesterov: w <- w - lr*g + m*v). Only where the engine's
    # graph step set the optimizer's flag; the result may differ from Keras's in the last bit
    # (lr*g is rounded before the add instead of fused into it).
    def _parallel_update_step(self, grads, variables, learning_rate):
        if not getattr(self, "_mgpu_device_learning_rate", False):
            return original(self, grads, variables, learning_rate)
        import torch

        rate = getattr(learning_rate, "value", learning_rate)
        step = torch._foreach_mul(list(grads), -rate)
        params = [v.value for v in variables]
        if self.momentum == 0:
            torch._foreach_add_(params, step)
            return
        velocities = [self.momentums[self._get_variable_index(v)].value for v in variables]
        torch._foreach_mul_(velocities, self.momentum)
        torch._foreach_add_(velocities, step)
        if self.nesterov:
            torch._foreach_add_(params, step)
            torch._foreach_add_(params, velocities, alpha=self.momentum)
        else:
            torch._foreach_add_(params, velocities)
    return _parallel_update_step


def _torch_scalars(original):
    # Keras makes a tensor of every Python number or shape tuple an op meets
    # (torch.as_tensor(x, device=...)): a CPU tensor and a synchronous copy, which a CUDA graph
    # cannot contain. While the engine warms up or captures a step, fill kernels make the same
    # small constant on the device instead (same dtype rule as Keras's); at any other time,
    # and for anything larger, Keras's own conversion runs.
    from mgpu_launch.engines import torch_graph

    def convert_to_tensor(x, dtype=None, sparse=None, ragged=None):
        if torch_graph.scalars_on_device() and not (sparse or ragged):
            made = torch_graph.device_constant(x, dtype)
            if made is not None:
                return made
        return original(x, dtype=dtype, sparse=sparse, ragged=ragged)
    return convert_to_tensor


def _compile(original):
    warned = []

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        if "experimental_run_tf_function" in kwargs:
            del kwargs["experimental_run_tf_function"]
            if not warned and runtime.state.rank == 0:
                warned.append(True)
                warnings.warn("compile(experimental_run_tf_function=...) is a Keras 2 argument; "
                              "Keras 3 has no such argument, so mgpu_launch.keras drops it "
                              "(the optimizer runs inside the compiled step anyway). Remove it.",
                              stacklevel=2)
        return original(self, *args, **kwargs)
    return compile


def _resume_iterator(original):
    def _enumerate_iterator(self):
        global _resume
        if _resume is None:
            yield from original(self)
            return
        (epochs, skip), _resume = _resume, None
        yield from epoch_resume.resumed_epoch(self, original, epochs, skip)
    return _enumerate_iterator


def _batch_norm_init(original):
    signature = inspect.signature(original)
    if "synchronized" not in signature.parameters:
        raise KerasInternalsError(Patch(_BATCH_NORM, "__init__", ())._message(
            importlib.import_module("keras"), "BatchNormalization.__init__",
            "it has no `synchronized` parameter"))

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        synchronized = bound.arguments.pop("synchronized", False)
        original(*bound.args, **bound.kwargs)  # Keras raises for it off TensorFlow
        self.synchronized = synchronized
    # Keras's Operation.__new__ reads the signature without following __wrapped__.
    __init__.__signature__ = signature
    return __init__


def _batch_norm_moments(original):
    def _moments(self, inputs, mask):
        if not self.synchronized:
            return original(self, inputs, mask)
        from mgpu_launch import batch_statistics
        moments = batch_statistics.synchronized_moments(inputs, self._reduction_axes, mask)
        if moments is not None:
            return moments
        import keras
        if keras.backend.backend() == "tensorflow":
            return original(self, inputs, mask)  # Keras's: a tf.distribute strategy's, or local
        self.synchronized = False  # Keras's local statistics (its own raise off TensorFlow)
        try:
            return original(self, inputs, mask)
        finally:
            self.synchronized = True
    return _moments


class _CallableList(list):
    """A list that is also callable, returning itself (Keras 2's ``optimizer.variables()``)."""

    def __call__(self):
        return self


class _VariablesProperty(property):
    """A property that can carry the ``_mgpu`` / ``__wrapped__`` marks :func:`apply` sets."""


def _optimizer_variables(original):
    return _VariablesProperty(lambda self: _CallableList(original.fget(self)),
                              doc=original.__doc__)


_FACTORIES = {
    "fit": _fit, "jax_iterator": _epoch_iterator, "torch_iterator": _epoch_iterator,
    "tf_iterator": _epoch_iterator,
    "jax_train_function": _jax_train_function, "jax_state_sync": _jax_state_sync,
    "torch_ddp": _torch_ddp, "torch_train_function": _torch_train_function,
    "torch_sgd_update": _torch_sgd_update, "torch_scalars": _torch_scalars,
    "compile": _compile, "resume_iterator": _resume_iterator, "compile_config": _compile_config,
    "tf_auto_jit": _tf_auto_jit, "batch_norm_init": _batch_norm_init,
    "batch_norm_moments": _batch_norm_moments, "optimizer_variables": _optimizer_variables,
}
