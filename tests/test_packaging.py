"""What `pip install .` puts on sys.path: the launcher under the project's own name only.

The launcher's folder is `mgpu_launcher/`, named as it imports: a top-level package named
`launcher` would shadow (or be shadowed by) PyPI's `launcher` and any project's own module.
These tests build the real wheel and read it.
"""
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # From a copy of the sources: an in-tree build/ folder left by an earlier build would
    # otherwise still hold modules the current configuration leaves out.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    for folder in ("mgpu_launcher", "mgpu_launch"):
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (path,) = out.glob("mgpu_launch-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_has_no_top_level_launcher(wheel):
    top_level = {name.split("/")[0] for name in wheel.namelist()
                 if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"mgpu_launcher", "mgpu_launch"}


def test_every_source_module_is_in_the_wheel(wheel):
    expected = {path.relative_to(ROOT).as_posix()
                for folder in ("mgpu_launcher", "mgpu_launch")
                for path in (ROOT / folder).rglob("*.py")}
    missing = sorted(expected - set(wheel.namelist()))
    assert not missing, f"pyproject.toml's [tool.setuptools] packages misses {missing}"


def test_the_console_scripts_point_at_the_installed_names(wheel):
    (entry_points,) = [name for name in wheel.namelist() if name.endswith("entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "mgpu-train = mgpu_launcher.cli:main" in text
    assert "mgpu-bench = mgpu_launch.bench:main" in text
