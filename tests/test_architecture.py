"""The package's import graph: no circles, and the layers depend one way; Keras internals
are touched in one place.

A module's layer is the package it lives in (``ls mgpu_launch/`` draws the architecture;
docs/architecture.md explains it):

    config/  <-  runtime/  <-  keras_internals  <-  keras_patching  <-  backends/  <-  training/
    <-  mgpu_launcher  <-  horovod/  <-  the public paths (mgpu_launch/*.py, thin re-exports)
    <-  bench/

Also: framework imports only in backends/ and bench/ (none, and no Keras, in runtime/ or the
launcher), a backend named only where it is chosen or where Keras differs per backend.

Every import counts, also one inside a function (a lazy import is still a dependency: the
module cannot be read, tested or replaced without the one it imports). Read with ``ast``, so
nothing is imported and no framework is needed.
"""

import ast
import pathlib
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: source folder -> the package name it installs as (the same: each folder is named as it imports)
SOURCES = {"mgpu_launcher": "mgpu_launcher", "mgpu_launch": "mgpu_launch"}

#: the layers, lowest first: (name, the package or module that is the layer). A module belongs
#: to the longest entry its name starts with and may import only from its own layer or lower
#: ones. A module directly in mgpu_launch/ is a public path (the entry "mgpu_launch"), except
#: keras_internals, the one floor that is a single module.
LAYERS = [
    ("config", "mgpu_launch.config"),
    ("runtime", "mgpu_launch.runtime"),
    # the one door to Keras internals: the backends and the training glue both use it
    ("Keras internals", "mgpu_launch.keras_internals"),
    # how a Keras method is replaced (Patch, apply, PatchSet): the backends declare their own
    # patch sets on it, the training glue installs them
    ("Keras patching", "mgpu_launch.keras_patching"),
    ("backends", "mgpu_launch.backends"),
    ("training", "mgpu_launch.training"),
    # the launcher sits on the library (as torch's run.py on torch.distributed); only the
    # facades above it (Horovod's hvd.run, mgpu.run) and the tools import it
    ("launcher", "mgpu_launcher"),
    ("Horovod names", "mgpu_launch.horovod"),
    ("public paths", "mgpu_launch"),
    ("tools", "mgpu_launch.bench"),
]


def modules() -> Dict[str, pathlib.Path]:
    found = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package] + parts)] = path
    return found


def imports_of(name: str, path: pathlib.Path, known: Set[str]) -> Set[str]:
    """The project modules `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod when there is one
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                          for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def graph() -> Dict[str, Set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return result


def layer_of(name: str) -> int:
    best, depth = None, -1
    for position, (_, prefix) in enumerate(LAYERS):
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > depth:
            best, depth = position, len(prefix)
    if best is None:
        raise AssertionError(f"{name} belongs to no layer")
    return best


def upward_imports(edges: Dict[str, Set[str]]) -> List[str]:
    """Every import of a module from a higher layer, one line each."""
    return [f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} "
            f"({LAYERS[layer_of(target)][0]})"
            for name, targets in sorted(edges.items()) for target in sorted(targets)
            if layer_of(target) > layer_of(name)]


def test_the_graph_sees_the_package():
    edges = graph()
    assert "mgpu_launch.training.patches" in edges and "mgpu_launcher.cli" in edges
    # lazy (function-level) imports count: the JAX engine's pinning import is inside setup()
    assert "mgpu_launch.config.devices" in edges["mgpu_launch.backends.jax.engine"]
    assert "mgpu_launch.runtime" in edges["mgpu_launch.runtime.collectives"]


def test_every_package_is_a_layer():
    # a new folder under mgpu_launch/ is placed in LAYERS on purpose, not silently made public
    packages = {".".join(("mgpu_launch",) + path.parent.relative_to(ROOT / "mgpu_launch").parts)
                for path in (ROOT / "mgpu_launch").glob("*/__init__.py")}
    layers = {prefix for _, prefix in LAYERS}
    assert packages <= layers, f"packages in no layer: {sorted(packages - layers)}"


def test_there_is_no_import_circle():
    found = circles(graph())
    assert not found, "import circles (each line one circle): " + "; ".join(
        " <-> ".join(circle) for circle in found)


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_depend_one_way():
    wrong = upward_imports(graph())
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_layer_check_fails_on_a_planted_upward_import():
    # the runtime reaching up into the training glue, and the engines into the Horovod names
    edges = dict(graph())
    edges["mgpu_launch.runtime.planted"] = {"mgpu_launch.training.optimizer"}
    edges["mgpu_launch.backends.planted"] = {"mgpu_launch.horovod.support", "mgpu_launch.runtime"}
    assert upward_imports(edges) == [
        "mgpu_launch.backends.planted (backends) imports mgpu_launch.horovod.support "
        "(Horovod names)",
        "mgpu_launch.runtime.planted (runtime) imports mgpu_launch.training.optimizer "
        "(training)"]


#: the modules directly in mgpu_launch/ that are not public paths
FLOORS = ("__init__.py", "keras_internals.py", "keras_patching.py")


#: what mgpu_launch/__init__.py may hold besides imports: its lazy re-exports (the Keras-facing
#: names load on first use, so that `import mgpu_launch` imports no framework) and __all__
LAZY_EXPORTS = ("_LAZY", "__all__", "__getattr__")


def thin_offences(path) -> List[str]:
    """What in public path `path` is more than a re-export."""
    heavy = []
    for node in ast.parse(path.read_text()).body:
        plain = isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        if path.name == "__init__.py":
            names = ([t.id for t in node.targets if isinstance(t, ast.Name)]
                     if isinstance(node, ast.Assign) else
                     [node.name] if isinstance(node, ast.FunctionDef) else [None])
            plain = plain or all(name in LAZY_EXPORTS for name in names)
        if not plain:
            heavy.append(f"{path.name} line {node.lineno}: {ast.unparse(node)[:60]}")
    return heavy


def test_the_public_paths_are_thin():
    # mgpu_launch/<name>.py exists only so that a name users import stays put: a docstring,
    # imports and __all__, nothing that needs reading to learn how mgpu works; the package's
    # __init__.py also holds no code but its lazy re-exports (init() is composed in
    # training/bootstrap.py, not by hooks registered here at import)
    heavy = []
    for path in sorted((ROOT / "mgpu_launch").glob("*.py")):
        if path.name in FLOORS and path.name != "__init__.py":
            continue
        heavy += thin_offences(path)
    assert not heavy, "public paths must only re-export (move the code into a layer):\n" + (
        "\n".join(heavy))


def test_the_thin_check_fails_on_a_planted_hook(tmp_path):
    planted = tmp_path / "__init__.py"
    planted.write_text("from mgpu_launch import runtime\n_LAZY = {}\n\n\ndef _hook(state):\n"
                       "    pass\n\n\nruntime.add_hooks(start=_hook, stop=None)\n")
    assert [o.split(": ")[0] for o in thin_offences(planted)] == [
        "__init__.py line 5", "__init__.py line 9"]


def test_the_launcher_starts_without_the_library_s_weight():
    """mgpu-train sits on the library (config, and the runtime for ``mgpu_launch.run``), but
    its start-up imports no framework, no Keras, no MPI and not even numpy: a command line
    error comes back in a fraction of a second."""
    import subprocess
    import sys
    heavy = ("numpy", "keras", "mpi4py", *FRAMEWORKS)
    probe = ("import sys, mgpu_launcher.cli, mgpu_launch\n"
             f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=ROOT, check=True).stdout.strip()
    assert loaded == "[]", f"importing mgpu_launcher.cli and mgpu_launch loaded {loaded}"


#: the patching floor, the registry of shared Keras patches and the modules that build its
#: replacements, and each backend's patch set (backends/<name>/patches.py)
PATCH_MODULES = tuple(sorted(name for name in modules()
                             if name.startswith("mgpu_launch.training.patches")
                             or name == "mgpu_launch.keras_patching"
                             or (name.startswith("mgpu_launch.backends.")
                                 and name.endswith(".patches"))))
#: the only modules that may import ``keras.src`` or touch private attributes of Keras objects
INTERNALS_MODULES = ("mgpu_launch.keras_internals",) + PATCH_MODULES


def test_the_patch_package_is_found():
    assert set(PATCH_MODULES) >= {"mgpu_launch.training.patches",
                                  "mgpu_launch.training.patches.fit",
                                  "mgpu_launch.keras_patching",
                                  "mgpu_launch.backends.torch.patches"}


def test_only_the_patch_package_assigns_to_keras_classes():
    # e.g. `keras.Model.fit = ...` or `JAXTrainer.make_train_function = ...` elsewhere
    keras_names = ("keras.", "Trainer", "JAXTrainer", "TorchTrainer", "EpochIterator")
    offenders = []
    for name, path in modules().items():
        if name in PATCH_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (isinstance(target, ast.Attribute)
                            and ast.unparse(target.value).startswith(keras_names)):
                        offenders.append(f"{name}: {ast.unparse(target)} = ...")
    assert not offenders, offenders


# -- Keras internals only behind mgpu_launch.keras_internals -------------------------------------
#: private attributes of objects that are not Keras's, where static reading cannot tell: each
#: (module, attribute) with why it is not a Keras internal
NOT_KERAS = {
    ("mgpu_launch.backends.tensorflow.engine", "_context_handle"):
        "TensorFlow's eager context (tensorflow.python.eager.context), read to refuse a late "
        "mgpu.init(); a TensorFlow internal, not a Keras one",
}
_IMPORTERS = ("import_module", "__import__")
_ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    # _mgpu...: attributes mgpu_launch itself puts on Keras objects (markers, flags)
    return name.startswith("_") and not name.startswith(("__", "_mgpu"))


def _is_keras_src(module: str) -> bool:
    return module == "keras.src" or module.startswith("keras.src.")


def keras_src_imports(source: str) -> List[str]:
    """Every way `source` reaches ``keras.src``: ``import keras.src...``, ``from keras.src...
    import``, ``from keras import src``, ``keras.src`` as an attribute, and
    ``importlib.import_module("keras.src...")`` / ``__import__`` with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {alias.name}" for alias in node.names
                      if _is_keras_src(alias.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if _is_keras_src(module) or (module == "keras" and any(
                    alias.name == "src" for alias in node.names)):
                found.append(f"line {node.lineno}: from {module} import ...")
        elif (isinstance(node, ast.Attribute) and node.attr == "src"
              and isinstance(node.value, ast.Name) and node.value.id == "keras"):
            found.append(f"line {node.lineno}: keras.src")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            name = node.args[0].value
            if function in _IMPORTERS and isinstance(name, str) and _is_keras_src(name):
                found.append(f"line {node.lineno}: {function}({name!r})")
    return found


def _own_object(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def defined_names(sources: Dict[str, str]) -> Set[str]:
    """Private names the project defines itself: functions, classes and methods (overrides
    of a Keras hook included), and attributes it sets on ``self`` / ``cls``."""
    names = set()
    for source in sources.values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and _own_object(node.value)):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and ast.unparse(node.func).startswith(
                    ("vars(self).update", "super().__setattr__", "setattr")):
                # vars(self).update(_tape=...), super().__setattr__("_x", v), setattr(self, ...)
                names.update(k.arg for k in node.keywords if k.arg)
                names.update(a.value for a in node.args if isinstance(a, ast.Constant)
                             and isinstance(a.value, str))
    return names


def _imported_names(tree: ast.AST) -> Set[str]:
    """Names bound by importing something other than Keras (torch, jax, os, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] != "keras")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] not in (
                "keras", "mgpu_launch") and not node.level:
            names.update(a.asname or a.name for a in node.names)
    return names


def private_accesses(name: str, source: str, defined: Set[str]) -> List[str]:
    """Accesses in `source` to a private attribute the project does not define (``x._y``,
    ``getattr(x, "_y")``), on anything but a module imported from another framework."""
    tree = ast.parse(source)
    frameworks = _imported_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner, attribute = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTRIBUTE_CALLS and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            owner, attribute = node.args[0], node.args[1].value
        else:
            continue
        root = owner
        while isinstance(root, ast.Attribute):
            root = root.value
        if (not _private(attribute) or attribute in defined or (name, attribute) in NOT_KERAS
                or (isinstance(root, ast.Name) and root.id in frameworks)):
            continue
        found.append(f"line {node.lineno}: {ast.unparse(owner)}.{attribute}")
    return found


def _sources(package: str) -> Dict[str, str]:
    return {name: path.read_text() for name, path in modules().items()
            if name.split(".")[0] == package}


def boundary_offences(sources: Dict[str, str]) -> List[str]:
    """``keras.src`` imports and private Keras attributes outside INTERNALS_MODULES."""
    defined = defined_names(sources)
    return [f"{name}: {offence}" for name, source in sorted(sources.items())
            if name not in INTERNALS_MODULES
            for offence in keras_src_imports(source) + private_accesses(name, source, defined)]


def test_keras_internals_are_touched_only_behind_keras_internals():
    offences = boundary_offences(_sources("mgpu_launch"))
    offences += [f"{name}: {o}" for name, source in _sources("mgpu_launcher").items()
                 for o in keras_src_imports(source)]
    assert not offences, (
        "Keras internals outside mgpu_launch/keras_internals.py (add a checked accessor there "
        "and use it; a private name that is ours must be defined in the project):\n"
        + "\n".join(offences))


_PLANTED = '''
import importlib

import keras


def restart(model, optimizer, callback):
    from keras.src.backend.common import stateless_scope
    model._initial_epoch = 3
    rate = getattr(optimizer, "_learning_rate")
    scope = importlib.import_module("keras.src.backend.common.stateless_scope")
    return keras.src.utils, callback._should_save_model, self._trainable_variables
'''


def test_the_boundary_check_fails_on_planted_keras_internals():
    sources = dict(_sources("mgpu_launch"), **{"mgpu_launch.planted": _PLANTED})
    found = [o for o in boundary_offences(sources) if o.startswith("mgpu_launch.planted")]
    for expected in ("from keras.src.backend.common import", "model._initial_epoch",
                     "optimizer._learning_rate", "import_module('keras.src.backend.common",
                     "keras.src", "callback._should_save_model", "self._trainable_variables"):
        assert any(expected in offence for offence in found), (expected, found)
    # the same source is fine in the internals module, and so are the project's own names
    sources = dict(_sources("mgpu_launch"), **{"mgpu_launch.keras_internals": _PLANTED})
    assert not boundary_offences(sources)


def test_the_boundary_check_spares_the_projects_and_other_frameworks_names():
    source = '''
import torch
from jax._src import xla_bridge


class Engine:
    def __init__(self):
        self._watched = None

    def _reset(self):
        return torch._foreach_mul, xla_bridge._jax, self._watched, other._reset


def flag(optimizer):
    optimizer._mgpu_device_learning_rate = True
'''
    assert boundary_offences({"mgpu_launch.sample": source}) == []


# -- framework imports: only in backends/ and bench/, never in runtime/ or the launcher ---------
#: the deep-learning frameworks (Keras is checked for the runtime and the launcher alone)
FRAMEWORKS = ("tensorflow", "jax", "jaxlib", "torch")
#: the packages that may import a framework
FRAMEWORK_HOMES = ("mgpu_launch.backends", "mgpu_launch.bench")
#: the lazy exceptions docs/architecture.md names: (module, framework) -> why
FRAMEWORK_EXCEPTIONS = {
    ("mgpu_launch.training.data", "tensorflow"): "shard() reads a tf.data.Dataset it is given",
    # a torchrun job's control plane is torch's own (TCPStore + gloo), joined by the runtime
    # before any engine exists; imported only when that plane is joined, as transport_mpi
    # alone imports mpi4py
    ("mgpu_launch.runtime.transport_torch", "torch"): "the torch.distributed control plane",
    # likewise the processes started with JAX's variables meet at JAX's coordination service
    ("mgpu_launch.runtime.transport_jax", "jax"): "the jax.distributed control plane",
}
#: the layers that import no Keras either ("runtime/: no Keras, no framework")
KERAS_FREE = ("mgpu_launcher", "mgpu_launch.runtime", "mgpu_launch.config")


def imported_tops(source: str) -> Set[str]:
    """The top-level package of every absolute import in `source`, lazy ones included."""
    tops = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def _within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def framework_offences(sources: Dict[str, str]) -> List[str]:
    offences = []
    for name, source in sorted(sources.items()):
        tops = imported_tops(source)
        for framework in sorted(tops & set(FRAMEWORKS)):
            if not _within(name, FRAMEWORK_HOMES) and (name, framework) not in FRAMEWORK_EXCEPTIONS:
                offences.append(f"{name} imports {framework}")
        if "keras" in tops and _within(name, KERAS_FREE):
            offences.append(f"{name} imports keras")
    return offences


def test_frameworks_are_imported_only_by_the_engines():
    sources = dict(_sources("mgpu_launch"), **_sources("mgpu_launcher"))
    offences = framework_offences(sources)
    assert not offences, ("a framework import outside backends/ and bench/ (casting, collectives "
                          "and devices are engine work: add an Engine method):\n"
                          + "\n".join(offences))


def test_the_framework_check_fails_on_planted_imports():
    lazy = "def cast(x):\n    import keras\n    from jax import numpy\n    return x\n"
    sources = {"mgpu_launch.runtime.planted": lazy,
               "mgpu_launch.training.planted": "import torch.distributed\n",
               "mgpu_launch.backends.planted": "import torch\nimport keras\n",
               "mgpu_launch.training.data": "import tensorflow as tf\n"}
    assert framework_offences(sources) == [
        "mgpu_launch.runtime.planted imports jax", "mgpu_launch.runtime.planted imports keras",
        "mgpu_launch.training.planted imports torch"]


# -- backend names: only where the backend is chosen or Keras differs per backend -------------
BACKENDS = ("tensorflow", "jax", "torch")
#: the modules that may name a backend, each with why
NAMES_BACKENDS = {
    "mgpu_launch.backends": "one folder per backend, registered in backends/__init__.py",
    "mgpu_launch.bench": "mgpu-bench: its native baselines are per framework",
    "mgpu_launch.horovod.tensorflow_api": "Horovod's TensorFlow namespace needs that backend",
}


def backend_names(source: str) -> List[str]:
    """Where `source` compares with a backend's name or keys a table by one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            constants = [node.left] + list(node.comparators)
        elif isinstance(node, ast.Dict):
            constants = [key for key in node.keys if key is not None]
        else:
            continue
        for constant in constants:
            if isinstance(constant, ast.Constant) and constant.value in BACKENDS:
                found.append(f"line {node.lineno}: {constant.value!r}")
    return found


def backend_offences(sources: Dict[str, str]) -> List[str]:
    return [f"{name} {found}" for name, source in sorted(sources.items())
            if not _within(name, NAMES_BACKENDS) for found in backend_names(source)]


def test_only_the_engines_and_the_patches_name_a_backend():
    # the launcher too: what it must know of a backend is the backend's facts (the registry)
    offences = backend_offences(dict(_sources("mgpu_launch"), **_sources("mgpu_launcher")))
    assert not offences, ("a backend named outside the engines (ask the engine instead, or "
                          "key the patch registry by engine name):\n" + "\n".join(offences))


def test_the_backend_check_fails_on_a_planted_name():
    source = 'import keras\nif keras.backend.backend() == "torch":\n    TABLE = {"jax": 1}\n'
    assert backend_offences({"mgpu_launch.training.planted": source,
                             "mgpu_launch.backends.planted": source,
                             "mgpu_launcher.planted": 'if backend != "jax":\n    pass\n'}) == [
        "mgpu_launch.training.planted line 2: 'torch'",
        "mgpu_launch.training.planted line 3: 'jax'",
        "mgpu_launcher.planted line 1: 'jax'"]


# -- the engine interface: every engine method called outside backends/ is declared ------------
#: the calls that give an engine (backends/__init__.py's dispatcher, and helpers named _engine)
ENGINE_GETTERS = ("get_engine", "get_engine_or_default", "graph_collectives", "_engine")


def declared_engine_methods() -> Set[str]:
    """Every method and attribute the interfaces of backends/api.py declare."""
    tree = ast.parse((ROOT / "mgpu_launch" / "backends" / "api.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AnnAssign)):
                    names.add(item.name if isinstance(item, ast.FunctionDef)
                              else item.target.id)
    return names


def _gives_engine(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
    return name in ENGINE_GETTERS


#: parameter names that hold an engine passed in (``def _feed(..., engine, ...)``)
ENGINE_PARAMETERS = ("engine",)
#: attributes of ``self`` that hold an engine (``self._engine = backends.get_engine()``)
ENGINE_ATTRIBUTES = ("_engine", "engine")


def _holds_engine(node: ast.AST, bound: Set[str]) -> bool:
    """A getter's result, a name bound to one or a parameter named for one, or ``self._engine``."""
    return (_gives_engine(node) or (isinstance(node, ast.Name) and node.id in bound)
            or (isinstance(node, ast.Attribute) and node.attr in ENGINE_ATTRIBUTES
                and _own_object(node.value)))


def engine_calls(source: str) -> List[tuple]:
    """(line, attribute) of every attribute read on an engine: on a getter's result directly
    (``backends.get_engine().watch``), on a name bound to one (``engine = get_engine()``) or a
    parameter that holds one (``def f(engine)``), or on ``self._engine``."""
    tree = ast.parse(source)
    bound = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and _gives_engine(node.value) for target in node.targets
             if isinstance(target, ast.Name)}
    bound |= {node.arg for node in ast.walk(tree)
              if isinstance(node, ast.arg) and node.arg in ENGINE_PARAMETERS}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                and _holds_engine(node.value, bound)):
            found.append((node.lineno, node.attr))
    return sorted(found)


def undeclared_engine_calls(sources: Dict[str, str]) -> List[str]:
    declared = declared_engine_methods()
    return [f"{name} line {line}: engine.{attribute}" for name, source in sorted(sources.items())
            if not name.startswith("mgpu_launch.backends")
            for line, attribute in engine_calls(source) if attribute not in declared]


def test_every_engine_method_called_is_declared_by_an_interface():
    assert {"reduce_gradients", "compiles_collectives", "name"} <= declared_engine_methods()
    offences = undeclared_engine_calls(dict(_sources("mgpu_launch"), **_sources("mgpu_launcher")))
    assert not offences, ("an engine method called outside backends/ that no interface in "
                          "backends/api.py declares (declare it there, on the concern it "
                          "belongs to):\n" + "\n".join(offences))


def test_the_interface_check_fails_on_a_planted_call():
    source = ('from mgpu_launch import engines\n'
              'engine = engines.get_engine()\n'
              'engine.reduce_gradients([], [], None)\n'
              'engine.collective_reduce(x)\n'
              'engines.graph_collectives("x").ring_allgather(y)\n')
    assert undeclared_engine_calls({"mgpu_launch.training.planted": source}) == [
        "mgpu_launch.training.planted line 4: engine.collective_reduce",
        "mgpu_launch.training.planted line 5: engine.ring_allgather"]


def test_the_interface_check_sees_engines_passed_in_held_and_in_the_launcher():
    source = ('def feed(epoch_iterator, engine):\n'
              '    return engine.prefetch_source(epoch_iterator, None), engine._watched\n'
              'class Report:\n'
              '    def __init__(self, backends):\n'
              '        self._engine = backends.get_engine()\n'
              '    def run(self):\n'
              '        return self._engine.time_gradient_reduction([], None), self._engine.fusion\n')
    assert undeclared_engine_calls({"mgpu_launch.training.planted": source,
                                    "mgpu_launcher.planted": source}) == [
        "mgpu_launch.training.planted line 2: engine._watched",
        "mgpu_launch.training.planted line 7: engine.fusion",
        "mgpu_launcher.planted line 2: engine._watched",
        "mgpu_launcher.planted line 7: engine.fusion"]


def _interfaces_in_api() -> List[str]:
    tree = ast.parse((ROOT / "mgpu_launch" / "backends" / "api.py").read_text())
    return [node.name for node in tree.body if isinstance(node, ast.ClassDef)]


def _bases_by_class() -> Dict[str, Set[str]]:
    """Every class of backends/ -> the names of its bases (api.X read as X)."""
    found = {}
    for path in (ROOT / "mgpu_launch" / "backends").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found[node.name] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
    return found


def test_docs_draw_every_engine_interface_and_who_implements_it():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The engine interfaces", 1)[1].split("```", 2)[1]
    drawn = {line.split()[0]: line for line in block.strip().splitlines()}
    assert list(drawn) == _interfaces_in_api()
    bases = _bases_by_class()
    # Engine implements every interface but GraphCollectives; TensorFlowEngine adds that one
    assert bases["Engine"] == set(_interfaces_in_api()) - {"GraphCollectives"}
    adding = sorted(name for name, of in bases.items() if "GraphCollectives" in of)
    assert adding == ["TensorFlowEngine"] and drawn["GraphCollectives"].endswith(
        "TensorFlowEngine only")
    assert all("Engine;" in line for name, line in drawn.items() if name != "GraphCollectives")


# -- values down: no mgpu option read off a Keras optimizer or an engine by name -----------------
def _distributed_option_names() -> Set[str]:
    tree = ast.parse((ROOT / "mgpu_launch" / "training" / "optimizer_options.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "DistributedOptions":
            return {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)}
    raise AssertionError("DistributedOptions is not in training/optimizer_options.py")


#: what must flow down as a value (StepOptions, GradientReduction, set_skip_allreduce), never
#: be looked up by name on whatever object is at hand: the DistributedOptimizer's options (and
#: the value that holds them), the profile's switch, the flag a patch once read off optimizers
OPTION_NAMES = _distributed_option_names() | {"options", "skip_allreduce",
                                              "_mgpu_device_learning_rate"}
#: the one door: finds a model's DistributedOptimizer by its options' type (each with why)
READS_OPTIONS = {"mgpu_launch.training.optimizer_options":
                 "distributed_optimizer(model): the options found by their type"}


def option_lookups(source: str) -> List[str]:
    """``getattr`` / ``hasattr`` / ``setattr`` / ``delattr`` with an option's name, and an option
    assigned onto an object other than ``self`` (``options`` aside: a word too common), by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in _ATTRIBUTE_CALLS and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in OPTION_NAMES):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and node.attr in OPTION_NAMES - {"options"} and not _own_object(node.value)):
            found.append(f"line {node.lineno}: {ast.unparse(node)} = ...")
    return sorted(found, key=lambda line: int(line.split()[1].rstrip(":")))


def option_offences(sources: Dict[str, str]) -> List[str]:
    return [f"{name} {found}" for name, source in sorted(sources.items())
            if name not in READS_OPTIONS for found in option_lookups(source)]


def test_no_option_is_looked_up_by_name():
    assert {"cuda_graph", "backward_passes_per_step"} <= OPTION_NAMES
    offences = option_offences(dict(_sources("mgpu_launch"), **_sources("mgpu_launcher")))
    assert not offences, ("an mgpu option read or written by name on an optimizer or engine "
                          "(hand it down as a value: reduction.StepOptions, "
                          "GradientReduction, engine.set_skip_allreduce):\n"
                          + "\n".join(offences))


def test_the_option_check_fails_on_planted_lookups():
    source = ('def wrap(model, engine):\n'
              '    if getattr(model.optimizer, "cuda_graph", None):\n'
              '        engine.skip_allreduce = True\n'
              '    optimizer._mgpu_device_learning_rate = True\n'
              '    return hasattr(engine, "skip_allreduce")\n'
              'class Engine:\n'
              '    def __init__(self):\n'
              '        self.skip_allreduce = False\n')
    assert option_offences({"mgpu_launch.backends.planted": source,
                            "mgpu_launch.training.optimizer_options": source}) == [
        "mgpu_launch.backends.planted line 2: getattr(..., 'cuda_graph')",
        "mgpu_launch.backends.planted line 3: engine.skip_allreduce = ...",
        "mgpu_launch.backends.planted line 4: optimizer._mgpu_device_learning_rate = ...",
        "mgpu_launch.backends.planted line 5: hasattr(..., 'skip_allreduce')"]


# -- a fourth backend: one new folder plus at most 3 lines elsewhere (docs/architecture.md) -------
#: what every backend folder holds: its facts (__init__.py), its engine, its Keras patch set
BACKEND_MODULES = {"__init__.py", "engine.py", "patches.py"}
#: the places outside backends/<name>/ that name a backend, one line each: the registry, the
#: extra in pyproject.toml and the case in scripts/test.sh (docs and tests aside)
BACKEND_LINES = ("mgpu_launch/backends/__init__.py", "pyproject.toml", "scripts/test.sh")


def backend_folders(root: pathlib.Path = ROOT) -> List[str]:
    return sorted(path.parent.name for path in (root / "mgpu_launch" / "backends").glob(
        "*/__init__.py"))


def fourth_backend_offences(root: pathlib.Path = ROOT) -> List[str]:
    """What would make a new backend cost more than its folder and the three lines."""
    offences = []
    folders = backend_folders(root)
    for name in folders:
        folder = root / "mgpu_launch" / "backends" / name
        missing = BACKEND_MODULES - {path.name for path in folder.glob("*.py")}
        if missing:
            offences.append(f"backends/{name}/ lacks {sorted(missing)}")
        facts = ast.parse((folder / "__init__.py").read_text())
        if not any(isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "FACTS" for t in node.targets)
                for node in facts.body):
            offences.append(f"backends/{name}/__init__.py declares no FACTS")
        if imported_tops((folder / "__init__.py").read_text()) & set(FRAMEWORKS):
            offences.append(f"backends/{name}/__init__.py imports a framework (the launcher "
                            f"reads it)")
    registry = (root / "mgpu_launch" / "backends" / "__init__.py").read_text()
    for name in folders:
        registered = [line for line in registry.splitlines()
                      if line.strip() == f"_{name}.FACTS,"]
        if len(registered) != 1:
            offences.append(f"backends/__init__.py: {len(registered)} registry lines for {name}")
    for place in BACKEND_LINES[1:]:
        text = (root / place).read_text()
        for name in folders:
            if not any(line.lstrip().startswith((f"{name} =", f"{name})", f"{name}|"))
                       or f"|{name})" in line for line in text.splitlines()):
                offences.append(f"{place} has no line for {name}")
    return offences


def test_a_fourth_backend_is_one_folder_and_three_lines():
    assert backend_folders() == sorted(BACKENDS)
    offences = fourth_backend_offences()
    assert not offences, ("a backend needs more than its folder and the three lines "
                          "docs/architecture.md promises:\n" + "\n".join(offences))
    # and nothing outside the folders names one (the backend-name check above reads the
    # library and the launcher; its exceptions are the bench's baselines and Horovod's TF names)
    assert set(NAMES_BACKENDS) == {"mgpu_launch.backends", "mgpu_launch.bench",
                                   "mgpu_launch.horovod.tensorflow_api"}


def test_the_fourth_backend_check_fails_on_a_planted_half_backend(tmp_path):
    import shutil
    for place in ("mgpu_launch/backends", "scripts"):
        shutil.copytree(ROOT / place, tmp_path / place)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    planted = tmp_path / "mgpu_launch" / "backends" / "openvino"
    planted.mkdir()
    (planted / "__init__.py").write_text("import openvino\nimport torch\n")
    (planted / "engine.py").write_text("")
    assert fourth_backend_offences(tmp_path) == [
        "backends/openvino/ lacks ['patches.py']",
        "backends/openvino/__init__.py declares no FACTS",
        "backends/openvino/__init__.py imports a framework (the launcher reads it)",
        "backends/__init__.py: 0 registry lines for openvino",
        "pyproject.toml has no line for openvino",
        "scripts/test.sh has no line for openvino"]


# -- the control plane: MPI behind one transport module ---------------------------------------
#: the one module that may import mpi4py or hold a communicator (``.comm``): the MPI transport;
#: everything else talks through mgpu_launch.runtime.transport.Transport (state.transport)
MPI_HOME = "mgpu_launch.runtime.transport_mpi"


def mpi_offences(sources: Dict[str, str]) -> List[str]:
    """Imports of mpi4py and uses of a ``.comm`` attribute outside MPI_HOME."""
    offences = []
    for name, source in sorted(sources.items()):
        if name == MPI_HOME:
            continue
        if "mpi4py" in imported_tops(source):
            offences.append(f"{name} imports mpi4py")
        offences += [f"{name} line {node.lineno}: .comm" for node in ast.walk(ast.parse(source))
                     if isinstance(node, ast.Attribute) and node.attr == "comm"]
    return offences


def test_only_the_mpi_transport_touches_mpi():
    sources = dict(_sources("mgpu_launch"), **_sources("mgpu_launcher"))
    assert MPI_HOME in sources
    offences = mpi_offences(sources)
    assert not offences, ("MPI used outside the MPI transport (call the runtime's transport, "
                          "mgpu_launch.runtime.state.transport, instead):\n" + "\n".join(offences))


def test_the_mpi_check_fails_on_a_planted_use():
    planted = ("def total(state, x):\n    from mpi4py import MPI\n"
               "    return state.comm.allreduce(x, op=MPI.SUM)\n")
    sources = {"mgpu_launch.runtime.planted": planted, MPI_HOME: planted,
               "mgpu_launcher.planted": "import mpi4py.MPI\n",
               "mgpu_launch.horovod.planted": "def init(comm=None):\n    return comm\n"}
    assert mpi_offences(sources) == ["mgpu_launch.runtime.planted imports mpi4py",
                                     "mgpu_launch.runtime.planted line 3: .comm",
                                     "mgpu_launcher.planted imports mpi4py"]


# -- the record: docs/architecture.md's module tree names every module -------------------------
def tree_omissions(block: str) -> List[str]:
    """Every module of both packages (``__init__``/``__main__`` aside) that `block` does not
    name, by file name or by its name as a word (``jobs`` in a list of the bench's modules)."""
    import re
    missing = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            if path.name not in block and not re.search(rf"\b{re.escape(path.stem)}\b", block):
                missing.append(str(path.relative_to(ROOT)))
    return missing


def test_the_module_tree_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The module tree", 1)[1].split("```", 2)[1]
    assert not tree_omissions(block), (
        "docs/architecture.md's module tree does not name these modules (add a line with what "
        "each holds):\n" + "\n".join(tree_omissions(block)))


def test_the_tree_check_fails_on_a_module_left_out():
    assert "mgpu_launch/training/sharding.py" in tree_omissions("optimizer.py  data.py")

