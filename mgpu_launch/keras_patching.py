"""How mgpu replaces a Keras method: one checked :class:`Patch`, installed by :func:`apply`,
and the values a backend declares its patches in (:class:`PatchSet`, :class:`Hooks`).

The floor just above ``keras_internals``: the backends declare their own patch sets here
(``backends/<name>/patches.py``, returned by ``Engine.keras_patches``), the training glue
declares the patches every backend shares (``training/patches``) and installs both, once
(``training.patches.install``). A replacement that needs the training layer (the device
prefetcher, the DistributedOptimizer's options) gets it from :class:`Hooks`, a value handed
down, never by importing upward. Imports nothing of mgpu_launch but ``keras_internals``.

Installing a patch first checks that the attribute still exists with the leading parameters
our replacement relies on; a Keras release that renamed or reshaped it gives a
:class:`KerasInternalsError` naming the Keras version and the attribute, instead of a step
that silently stops reducing gradients.
"""

import dataclasses
import importlib
import inspect
import sys
from typing import Callable, Optional, Tuple

from mgpu_launch.keras_internals import SUPPORTED, KerasInternalsError

__all__ = ["Patch", "Replacement", "PatchSet", "Hooks", "apply", "is_ours", "TRAINER",
           "BATCH_NORM"]

# Keras 3.15-3.16 names, then keras-team's HEAD's (3.16.0.dev, 2026-10: Trainer -> BaseTrainer)
TRAINER = "keras.src.trainers.trainer:Trainer|keras.src.trainers.trainer:BaseTrainer"
BATCH_NORM = "keras.src.layers.normalization.batch_normalization:BatchNormalization"


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
            raise KerasInternalsError(self.message(keras, where, f"{self.owner} cannot be "
                                                   f"imported ({error})")) from error
        if original is None:
            if self.optional:
                return None
            raise KerasInternalsError(self.message(keras, where, "it does not exist"))
        target = getattr(original, "__wrapped__", original) if is_ours(original) else original
        target = target.fget if isinstance(target, property) else target
        found = tuple(inspect.signature(target).parameters)
        if found[:len(self.parameters)] != self.parameters:
            raise KerasInternalsError(self.message(
                keras, where, f"its parameters are {found}, expected them to begin with "
                              f"{self.parameters}"))
        return original

    def message(self, keras, where: str, problem: str) -> str:
        """The error text for `problem` with the attribute at `where`."""
        return (f"mgpu_launch patches {where}, but in Keras {keras.__version__} {problem}. "
                f"{SUPPORTED}")


@dataclasses.dataclass(frozen=True)
class Replacement:
    """A :class:`Patch` and the factory that builds its replacement from Keras's original.

    Args:
        name: a short name, for tests and messages (``"torch_train_function"``).
        patch: what is replaced, checked before it is.
        make: ``original -> replacement``.
        why: one line: what the replacement changes and for which models.
    """

    name: str
    patch: Patch
    make: Callable[[Callable], Callable]
    why: str = ""


@dataclasses.dataclass(frozen=True)
class PatchSet:
    """A backend's Keras patches, as its engine returns them (``Engine.keras_patches``).

    Args:
        every_model: installed with the patch context (``mgpu.init()``, or the first
            DistributedOptimizer of a script without it), in order; each acts only where its
            docstring says (mostly: models compiled with a DistributedOptimizer).
        on_capture: installed once a train step is wrapped for CUDA-graph capture (otherwise
            every step of every job would pay their extra Python frames).
        kernels: the backend's own kernels for Keras's lowering, installed after the
            synchronized BatchNormalization patches (whose ``_moments`` they check for).
    """

    every_model: Tuple[Replacement, ...] = ()
    on_capture: Tuple[Replacement, ...] = ()
    kernels: Tuple[Replacement, ...] = ()

    def all(self) -> Tuple[Replacement, ...]:
        """Every replacement of the set, in installation order."""
        return self.every_model + self.kernels + self.on_capture


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What the training layer hands a backend's patch set, so that no backend imports it.

    Args:
        uses_distributed_optimizer: ``model -> bool``, whether `model` was compiled with a
            DistributedOptimizer (also under a LossScaleOptimizer).
        step_options: ``model -> backends.reduction.StepOptions``, what its DistributedOptimizer
            asks of the train step.
        epoch_iterator: the factory of the epoch iterators' ``_get_iterator`` replacement
            (``original -> replacement``): batches from the device prefetcher.
    """

    uses_distributed_optimizer: Callable
    step_options: Callable
    epoch_iterator: Callable[[Callable], Callable]


def is_ours(function) -> bool:
    """Whether `function` is a replacement :func:`apply` installed."""
    return getattr(function, "_mgpu", False)


def apply(replacement: Replacement) -> None:
    """Install `replacement` (idempotent), after checking the attribute it replaces.

    Raises:
        KerasInternalsError: the attribute is missing or reshaped.
    """
    patch = replacement.patch
    original = patch.check()
    if original is None or is_ours(original):
        return
    made = replacement.make(original)
    made._mgpu = True
    made.__wrapped__ = original
    setattr(patch.owner_class(), patch.attribute, made)
    if patch.everywhere:
        for module_name, module in list(sys.modules.items()):
            if (module_name.split(".")[0] == "keras" and module is not None
                    and getattr(module, patch.attribute, None) is original):
                setattr(module, patch.attribute, made)
