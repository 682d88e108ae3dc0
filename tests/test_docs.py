"""Every results file or folder the README and docs/*.md name under benchmarks/ exists: a figure
in the docs is traced to a committed file (issue 53), and a moved or renamed results folder
breaks this test, not a reader's link."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# benchmarks/ then path characters; a trailing dot or comma ends the sentence, not the path.
# `name.{md,json,png}` names three files.
NAMED = re.compile(r"benchmarks/[A-Za-z0-9_./{},*-]*[A-Za-z0-9_/}*-]")


def named_paths(text: str) -> list:
    """The benchmarks/ paths a page names, with `a.{md,json}` expanded to a.md and a.json."""
    paths = []
    for found in NAMED.findall(text):
        braces = re.match(r"^(.*)\{([^}]*)\}(.*)$", found)
        if braces:
            paths += [braces.group(1) + part + braces.group(3)
                      for part in braces.group(2).split(",")]
        else:
            paths.append(found)
    return paths


def test_the_finder_reads_the_forms_the_docs_use():
    text = ("(`benchmarks/resnet50_h200x4.{md,json,png}`: commands), see "
            "[the run](../benchmarks/tf_gpu/results_2026-11-26-h200x2-third/README.md), "
            "folder `benchmarks/tf_gpu/results_2026-11-26-h200x2/`. And benchmarks/tf_long_run.md.")
    assert named_paths(text) == [
        "benchmarks/resnet50_h200x4.md", "benchmarks/resnet50_h200x4.json",
        "benchmarks/resnet50_h200x4.png",
        "benchmarks/tf_gpu/results_2026-11-26-h200x2-third/README.md",
        "benchmarks/tf_gpu/results_2026-11-26-h200x2/", "benchmarks/tf_long_run.md"]


def test_every_results_file_or_folder_the_docs_name_exists():
    missing = []
    for page in PAGES:
        for path in named_paths(page.read_text(encoding="utf-8")):
            if "*" not in path and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
            elif "*" in path and not list(ROOT.glob(path)):
                missing.append(f"{page.relative_to(ROOT)}: {path} (matches nothing)")
    assert not missing, ("the docs name results that are not in the repository (commit them, or "
                         "name the folder they are in):\n  " + "\n  ".join(missing))
    assert sum(len(named_paths(p.read_text(encoding="utf-8"))) for p in PAGES) > 10
