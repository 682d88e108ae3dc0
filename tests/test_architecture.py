"""The package's import graph: no circles, and the layers depend one way.

    mgpu_launcher  <-  runtime  <-  collectives  <-  engines  <-  Keras glue  <-  tools

Every import counts, also one inside a function (a lazy import is still a dependency: the
module cannot be read, tested or replaced without the one it imports). Read with ``ast``, so
nothing is imported and no framework is needed.
"""

import ast
import pathlib
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: source folder -> the package name it installs as (pyproject.toml's package-dir)
SOURCES = {"launcher": "mgpu_launcher", "mgpu_launch": "mgpu_launch"}

#: lowest first; a module may import only from its own layer or lower ones
LAYERS = [
    ("launcher", ["mgpu_launcher"]),
    ("runtime", ["mgpu_launch.runtime", "mgpu_launch.rendezvous", "mgpu_launch.stall",
                 "mgpu_launch.stall_channel", "mgpu_launch._auth",
                 "mgpu_launch.prefetch", "mgpu_launch.compression", "mgpu_launch.launch"]),
    ("collectives", ["mgpu_launch.collectives"]),
    ("engines", ["mgpu_launch.engines"]),
    ("Keras glue", ["mgpu_launch.fit_guard", "mgpu_launch.stall_probes",
                    "mgpu_launch.epoch_resume", "mgpu_launch.resize",
                    "mgpu_launch.keras_patches", "mgpu_launch._patches_training",
                    "mgpu_launch._patches_layers",
                    "mgpu_launch.optimizer", "mgpu_launch.optimizer_step",
                    "mgpu_launch.callbacks", "mgpu_launch.data",
                    "mgpu_launch.batch_statistics", "mgpu_launch.layers",
                    "mgpu_launch._horovod", "mgpu_launch._keras_callbacks",
                    "mgpu_launch.tensorflow_ops", "mgpu_launch.tensorflow_tape",
                    "mgpu_launch.tensorflow",
                    "mgpu_launch.elastic", "mgpu_launch.keras"]),
    ("tools and public API", ["mgpu_launch.bench", "mgpu_launch"]),
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
    for position, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = position, len(prefix)
    if best is None:
        raise AssertionError(f"{name} belongs to no layer: add it to LAYERS in this test")
    return best


def test_the_graph_sees_the_package():
    edges = graph()
    assert "mgpu_launch.keras_patches" in edges and "mgpu_launcher.cli" in edges
    # lazy (function-level) imports count: the JAX engine's pinning import is inside setup()
    assert "mgpu_launcher.devices" in edges["mgpu_launch.engines.jax"]
    assert "mgpu_launch.runtime" in edges["mgpu_launch.collectives"]


def test_there_is_no_import_circle():
    found = circles(graph())
    assert not found, "import circles (each line one circle): " + "; ".join(
        " <-> ".join(circle) for circle in found)


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_depend_one_way():
    wrong = [f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} "
             f"({LAYERS[layer_of(target)][0]})"
             for name, targets in sorted(graph().items()) for target in sorted(targets)
             if layer_of(target) > layer_of(name)]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_launcher_imports_nothing_of_the_library():
    edges = graph()
    leaks = {name: sorted(t for t in targets if t.split(".")[0] == "mgpu_launch")
             for name, targets in edges.items() if name.startswith("mgpu_launcher")}
    assert not any(leaks.values()), leaks


#: the registry of Keras patches and the private modules that build its replacements
PATCH_MODULES = ("mgpu_launch.keras_patches", "mgpu_launch._patches_training",
                 "mgpu_launch._patches_layers")


def test_only_the_patch_module_assigns_to_keras_classes():
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
