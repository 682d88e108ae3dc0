"""Every import path and source path the README, docs/ and examples/ name still exists.

The library moved into layer packages (docs/architecture.md); the names users import did not.
This reads the documents and imports every ``mgpu_launch...`` name they mention, so a move that
breaks a documented path, or a doc that names a file that no longer exists, fails here.
"""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                    *(ROOT / "examples").rglob("*.py"), *(ROOT / "examples").rglob("*.md")])
#: a dotted name, e.g. mgpu_launch.keras.elastic.KerasState (not a file path: no slash before)
DOTTED = re.compile(r"(?<![\w/.])mgpu_launch(?:\.[A-Za-z_]\w*)+")
#: a source path, e.g. mgpu_launch/training/patches/__init__.py or mgpu_launch/engines/
SOURCE_PATH = re.compile(r"(?<![\w/.])(?:mgpu_launch|launcher)/[\w/]*(?:\.py|/)")
#: the public paths docs/architecture.md promises, named here too so that a doc that stops
#: mentioning one does not stop its check
PROMISED = ["mgpu_launch.callbacks", "mgpu_launch.data", "mgpu_launch.layers",
            "mgpu_launch.elastic", "mgpu_launch.keras", "mgpu_launch.keras.callbacks",
            "mgpu_launch.keras.elastic", "mgpu_launch.tensorflow", "mgpu_launch.run"]


def mentioned(pattern):
    found = set()
    for document in DOCUMENTS:
        found |= {match.rstrip(".") for match in pattern.findall(document.read_text())}
    return sorted(found)


def resolve(dotted: str):
    """Import the longest importable module prefix of `dotted`, then get the rest as
    attributes; raises ImportError or AttributeError when the path does not exist."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if not ".".join(parts[:cut]).startswith(error.name or "\0"):
                raise
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(dotted)


def test_the_documents_mention_the_public_paths():
    # the regular expressions find what they are meant to (a regex that matches nothing would
    # make the two checks below pass on anything)
    names = mentioned(DOTTED)
    assert {"mgpu_launch.keras", "mgpu_launch.tensorflow", "mgpu_launch.run"} <= set(names)
    assert any(path.startswith("mgpu_launch/") for path in mentioned(SOURCE_PATH))


@pytest.mark.parametrize("dotted", sorted(set(mentioned(DOTTED)) | set(PROMISED)))
def test_every_documented_import_path_resolves(dotted):
    pytest.importorskip("keras")
    resolve(dotted)


@pytest.mark.parametrize("path", mentioned(SOURCE_PATH))
def test_every_documented_source_path_exists(path):
    folder, _, rest = path.partition("/")
    assert (ROOT / folder / rest).exists(), f"a document names {path}, which does not exist"


def test_resolve_fails_on_a_path_that_does_not_exist():
    with pytest.raises((ImportError, AttributeError)):
        resolve("mgpu_launch.keras_patches.install")
    with pytest.raises(AttributeError):
        resolve("mgpu_launch.keras.NoSuchName")
