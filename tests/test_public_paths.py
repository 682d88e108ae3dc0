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


# -- module names in the code's own words: docstrings, comments, messages -----------------------
import io  # noqa: E402
import tokenize  # noqa: E402

import test_architecture  # noqa: E402 - its module table (tests/ is on the path)

#: the source folders and the package each installs as
#: modules that existed once and exist nowhere now (the flat modules the layer packages
#: replaced): a docstring that names one sends the reader to nothing
RETIRED = ("keras_patches", "_patches_training", "_patches_layers", "_horovod",
           "_keras_callbacks", "_auth", "lagged_logs")
#: a dotted name of the project, e.g. mgpu_launch.runtime.folders.private_folder
PROJECT_DOTTED = re.compile(r"(?<![\w/.])(?:mgpu_launch|mgpu_launcher)(?:\.[A-Za-z_]\w*)+")
_RETIRED_WORD = re.compile(r"(?<![\w.])(" + "|".join(RETIRED) + r")(?![\w])")


MODULE_FILES = test_architecture.modules()  # dotted module name -> its file, both packages


def dotted_exists(dotted: str) -> bool:
    """Whether a project name resolves (imported: a public name may be lazy or re-exported)."""
    try:
        resolve(dotted)
    except (ImportError, AttributeError):
        return False
    return True


def words(path) -> list:
    """(line, text) of every comment and string literal in `path` (docstrings included)."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            found.append((token.start[0], token.string))
    return found


def stale_names(path) -> list:
    """What the comments and strings of `path` name that does not exist: a retired module, a
    project dotted name that does not resolve, a source path that is not there."""
    offences = []
    for line, text in words(path):
        for match in _RETIRED_WORD.findall(text):
            offences.append(f"line {line}: {match} (a module that no longer exists)")
        for dotted in PROJECT_DOTTED.findall(text):
            if not dotted_exists(dotted.rstrip(".")):
                offences.append(f"line {line}: {dotted}")
        for source in SOURCE_PATH.findall(text):
            folder, _, rest = source.partition("/")
            if not (ROOT / folder / rest).exists():
                offences.append(f"line {line}: {source}")
    return offences


def test_every_module_the_code_names_exists():
    pytest.importorskip("keras")
    assert not [name for name in RETIRED if any(
        module.rpartition(".")[2] == name for module in MODULE_FILES)], "RETIRED lists a module"
    offences = [f"{path.relative_to(ROOT)} {offence}" for path in MODULE_FILES.values()
                for offence in stale_names(path)]
    assert not offences, ("docstrings, comments or messages name what does not exist (name "
                          "the module where it lives now):\n" + "\n".join(offences))


def test_the_stale_name_check_finds_planted_names(tmp_path):
    pytest.importorskip("keras")
    planted = tmp_path / "planted.py"
    planted.write_text('"""Moved here from keras_patches (see mgpu_launch.runtime.nothing and\n'
                       'mgpu_launch/runtime/gone.py); mgpu_launch.runtime.folders is fine."""\n'
                       '# mgpu_launch.config.settings.flag and mgpu_launcher.cli.nope\n')
    found = stale_names(planted)
    assert [o.split(": ", 1)[1] for o in found] == [
        "keras_patches (a module that no longer exists)", "mgpu_launch.runtime.nothing",
        "mgpu_launch/runtime/gone.py", "mgpu_launcher.cli.nope"], found
