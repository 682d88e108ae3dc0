"""The engine interfaces have no defaults: an engine missing a method cannot be made, and each
backend folder declares the same facts. Reads the classes only (no framework is imported:
an engine module imports its framework inside its methods, or at the top for numpy alone)."""

import importlib

import pytest

from mgpu_launch import backends
from mgpu_launch.backends import api, shared
from mgpu_launch.backends.facts import BackendFacts


def _engine_class(name):
    module_name, class_name = backends.BACKENDS[name].engine.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def test_an_engine_that_declares_nothing_cannot_be_made():
    class Bare(backends.Engine):
        name = "bare"
    with pytest.raises(TypeError, match="abstract method"):
        Bare()


@pytest.mark.parametrize("backend", sorted(backends.BACKENDS))
def test_an_engine_missing_one_method_fails_at_construction(backend):
    engine_class = _engine_class(backend)
    # the engine's own allreduce taken away, with the shared pieces it names still there
    body = {key: value for key, value in vars(engine_class).items() if key != "allreduce"}
    partial = type(f"Partial{engine_class.__name__}", engine_class.__bases__, body)
    with pytest.raises(TypeError, match="allreduce"):
        partial()
    assert not getattr(engine_class, "__abstractmethods__", None)


def test_every_interface_method_is_abstract_and_each_shared_piece_serves_one_interface():
    for interface in api.INTERFACES:
        declared = {name for name, value in vars(interface).items() if callable(value)}
        assert declared == set(interface.__abstractmethods__), interface.__name__
    owners = {name: interface for interface in api.INTERFACES
              for name in interface.__abstractmethods__}
    for piece_name in shared.__all__:
        piece = getattr(shared, piece_name)
        methods = {name for name, value in vars(piece).items()
                   if callable(value) and not name.startswith("__")}
        assert methods and len({owners[name] for name in methods}) == 1, piece_name


@pytest.mark.parametrize("backend", sorted(backends.BACKENDS))
def test_an_engine_method_that_calls_super_reaches_a_shared_piece(backend):
    # An interface's abstract body does nothing: an engine that wraps super() around a piece
    # it forgot to list (TensorFlow's broadcast_variables without HostBroadcast) would run
    # it silently, and the ranks would keep their own weights.
    engine_class = _engine_class(backend)
    for name, method in vars(engine_class).items():
        if "super" not in getattr(getattr(method, "__code__", None), "co_names", ()):
            continue
        below = next(klass for klass in engine_class.__mro__[1:] if name in vars(klass))
        assert not getattr(vars(below)[name], "__isabstractmethod__", False), (
            f"{engine_class.__name__}.{name} calls super(), which reaches the abstract "
            f"{below.__name__}.{name}: list the shared piece that implements it")


def test_a_backend_without_an_engine_gets_keras_only():
    engine = backends.get_engine_or_default("no-such-backend")
    assert isinstance(engine, backends.KerasOnly) and not engine.supports_process_sets()
    with pytest.raises(NotImplementedError, match="no engine for this Keras backend"):
        engine.allreduce([], average=True)


def test_every_backend_folder_declares_its_facts():
    for name, facts in backends.BACKENDS.items():
        assert isinstance(facts, BackendFacts) and facts.name == name
        assert importlib.import_module(f"mgpu_launch.backends.{name}").FACTS is facts
        assert facts.engine.startswith(f"mgpu_launch.backends.{name}.")
    with pytest.raises(backends.UnknownBackend, match="supported: jax, tensorflow, torch"):
        backends.facts("openvino")
