"""One engine per Keras backend: the collectives that run inside the compiled train step.

The rest of mgpu_launch (optimizer, callbacks) is backend-agnostic Keras code; everything that
needs the backend's own collective machinery is an :class:`Engine` method. What an engine is
(one small interface per concern, no defaults) is declared in ``backends/api.py``;
:class:`Engine` joins those interfaces, each backend's engine implements them (taking shared
pieces from ``backends/shared.py`` by name), and :func:`get_engine` picks it once, from
``keras.backend.backend()``. Everything one backend needs lives in ``backends/<name>/``, whose
``__init__.py`` declares its facts (:class:`~mgpu_launch.backends.facts.BackendFacts`);
framework imports live only there. Adding a backend means adding a folder and one line to
:data:`BACKENDS`.
"""

import importlib
from typing import Any, Dict, List, Optional, Sequence

from mgpu_launch.backends import api, shared
from mgpu_launch.backends import jax as _jax, tensorflow as _tensorflow, torch as _torch
from mgpu_launch.backends.facts import BackendFacts

#: backend name -> its facts (engine, pinning rule, packages); one line per backend, in the
#: order mgpu-train lists them
BACKENDS: Dict[str, BackendFacts] = {facts.name: facts for facts in (
    _tensorflow.FACTS,
    _jax.FACTS,
    _torch.FACTS,
)}


class UnknownBackend(ValueError):
    """The Keras backend has no engine (the message lists the supported ones)."""


def facts(backend: str) -> BackendFacts:
    """What mgpu knows of `backend` without importing it.

    Raises:
        UnknownBackend: the backend has no engine; the message lists the supported ones.
    """
    if backend not in BACKENDS:
        raise UnknownBackend(
            f"mgpu_launch has no engine for the Keras backend {backend!r}; supported: "
            f"{', '.join(sorted(BACKENDS))}. Set KERAS_BACKEND to one of them.")
    return BACKENDS[backend]


class Engine(api.Lifecycle, api.Feeding, api.TrainStep, api.GradientReducer,
             api.ProcessSetSupport, api.InStepCollectives, api.ReductionTiming,
             api.HorovodQueries, api.KerasPatches):
    """What every backend provides: every interface of ``backends/api.py`` but
    ``GraphCollectives``, with no default, so that a subclass missing a method cannot be made
    (``TypeError`` at construction). Methods are called on every rank, in the same order.
    """

    name = ""


class KerasOnly(shared.NoCommunicator, shared.KerasFeeding, shared.KerasTrainStep,
                shared.HostBroadcast, shared.DenseReduction, shared.EveryRankOnly,
                shared.GroupCheck, shared.GatherBySum, shared.DefaultReductionTiming,
                shared.CannotSkipAllreduce, shared.NoBuildInfo, Engine):
    """What a Keras backend without an engine gets (:func:`get_engine_or_default`): Keras's
    own feeding and step, and no collective in the step."""

    def allreduce(self, tensors: Sequence[Any], *, average: bool, prescale: float = 1.0,
                  postscale: float = 1.0, compression=None, group=None) -> List[Any]:
        raise NotImplementedError(_no_engine("allreduce"))

    def sum_in_step(self, tensors: Sequence[Any]) -> List[Any]:
        raise NotImplementedError(_no_engine("sum_in_step"))

    def keras_patches(self, hooks):
        """None of its own: the patches every backend shares only."""
        from mgpu_launch.keras_patching import PatchSet
        return PatchSet()


def _no_engine(what: str) -> str:
    return (f"{what}: mgpu_launch has no engine for this Keras backend, so nothing reduces "
            f"inside the step; supported: {', '.join(BACKENDS)} (set KERAS_BACKEND)")


_engine: Optional[Engine] = None


def get_engine(backend: Optional[str] = None) -> Engine:
    """The engine for `backend` (default: Keras's current backend), created once.

    Raises:
        UnknownBackend: the backend has no engine; the message lists the supported ones.
        mgpu_launch.config.settings.SettingError: an ``MGPU_*`` variable the engine reads is bad.
    """
    global _engine
    if backend is None:
        import keras
        backend = keras.backend.backend()
    if _engine is not None and _engine.name == backend:
        return _engine
    module_name, class_name = facts(backend).engine.split(":")
    _engine = getattr(importlib.import_module(module_name), class_name)()
    return _engine


def graph_collectives(what: str) -> api.GraphCollectives:
    """The backend's engine, as the in-graph collectives beyond the sum (TensorFlow's).

    Args:
        what: the caller, for the message.

    Raises:
        ValueError: the backend's engine has none; the message names the backend and the fix.
    """
    engine = get_engine()
    if not isinstance(engine, api.GraphCollectives):
        raise ValueError(f"{what} needs in-graph allgather / broadcast / reduce, which only the "
                         f"TensorFlow engine has; the Keras backend is {engine.name!r}. Set "
                         f"KERAS_BACKEND=tensorflow, or use the host collectives "
                         f"(mgpu.allgather, mgpu.broadcast, mgpu.allreduce).")
    return engine


def get_engine_or_default(backend: Optional[str] = None) -> Engine:
    """The backend's engine, or :class:`KerasOnly` for a backend without one.

    Only a backend without an engine falls back: an engine that cannot be made (a bad
    ``MGPU_FUSION_MB``, ...) raises, as :func:`get_engine` does.
    """
    try:
        return get_engine(backend)
    except UnknownBackend:
        return KerasOnly()


def reset() -> None:
    """Forget the engine (after shutdown)."""
    global _engine
    if _engine is not None:
        _engine.shutdown()
    _engine = None
