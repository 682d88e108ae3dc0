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


# A markdown link's target: ](path) or ](path#anchor); web addresses and in-page anchors are
# left to the reader.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: pathlib.Path) -> set:
    """The #anchors GitHub gives a page's headings: lower case, punctuation out, spaces -."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in headings}


def test_the_anchor_rule_matches_githubs():
    page = ROOT / "docs" / "troubleshooting.md"
    assert {"noise-once", "why-is-my-job-not-n-times-faster"} <= anchors(page)


def test_every_relative_link_in_the_readme_and_docs_leads_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            path, _, anchor = target.partition("#")
            if re.match(r"^[a-z]+:", path):
                continue
            linked = page.parent / path if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, ("links to files or headings that are not there (a page or section "
                        "moved?):\n  " + "\n  ".join(broken))


def test_the_readmes_examples_table_lists_every_example():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Examples"):readme.index("\n## ", readme.index("## Examples") + 1)]
    listed = set(re.findall(r"^\| `([^` ]+)", table, flags=re.M))
    present = {p.name + ("/" if p.is_dir() else "") for p in (ROOT / "examples").iterdir()
               if not p.name.startswith((".", "__"))}
    assert listed == present, (f"examples/ holds {sorted(present - listed)} that the README's "
                               f"table leaves out; the table names {sorted(listed - present)} "
                               f"that examples/ lacks")
    named = set(re.findall(r"examples/[A-Za-z0-9_./-]*[A-Za-z0-9_/]", readme))
    assert named and all((ROOT / path).exists() for path in named), named


# A test named in a page as tests/<file>.py::test_name (docs/starting-processes.md's table).
NAMED_TEST = re.compile(r"(tests/[\w/]+\.py)::(test_\w+)")


def test_every_test_the_docs_name_exists():
    """A cell that says "works" names the test that shows it: a renamed or deleted test breaks
    this, not the reader's trust in the table."""
    missing = []
    for page in PAGES:
        for path, name in NAMED_TEST.findall(page.read_text(encoding="utf-8")):
            source = ROOT / path
            if not source.exists() or not re.search(rf"^def {name}\(",
                                                    source.read_text(encoding="utf-8"), re.M):
                missing.append(f"{page.relative_to(ROOT)}: {path}::{name}")
    assert not missing, "the docs name tests that do not exist:\n  " + "\n  ".join(missing)
    assert len(NAMED_TEST.findall((ROOT / "docs" / "starting-processes.md").read_text())) >= 10
