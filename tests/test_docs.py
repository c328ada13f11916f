"""The README is a front page; the docs site documents every flag, setting and package folder the code has."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tests.layout import ROOT, SOURCE_ROOTS, package_folders
from tools.docs_reference import launcher_page, render
from torchspot_trainer.config import build_parser
from torchspot_trainer.rendezvous.settings import EtcdV3Settings

README = (ROOT / "README.md").read_text()
README_LINES = 250
"""A front page: what torchspot is, the two commands, install, your own script, the figures, the
alternatives, the limits and where a change goes; everything else is the docs site's."""


def _page(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def test_the_readme_is_a_front_page_whose_links_all_resolve() -> None:
    assert len(README.splitlines()) <= README_LINES
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert {"docs/own-script.md", "docs/aks.md", "docs/recovery.md"} <= set(targets)
    broken = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert broken == []


def test_every_training_flag_is_in_the_trainers_pages() -> None:
    pages = _page("trainer.md") + _page("reference/trainer-flags.md")
    flags = [a.option_strings[0] for a in build_parser()._actions if a.option_strings[0].startswith("--")]
    missing = [f for f in flags if f != "--help" and f"`{f}`" not in pages]
    assert missing == []


def test_every_rendezvous_setting_is_in_the_launchers_reference() -> None:
    page = _page("reference/launcher.md")
    keys = [f.name for f in fields(EtcdV3Settings) if f.name not in ("host", "port", "run_id")]
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert missing == []


def test_the_launchers_reference_is_the_same_where_torchrun_variables_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's flags default to `PET_<FLAG>` where set: a machine with one set must not render, and so
    fail `make test`'s check of, another page."""
    expected = launcher_page()
    monkeypatch.setenv("PET_NNODES", "3:7")
    monkeypatch.setenv("PET_MAX_RESTARTS", "9")
    assert launcher_page() == expected
    assert os.environ["PET_NNODES"] == "3:7"  # (put back for the caller)


def test_the_layout_names_every_package_folder() -> None:
    """The layout is one tree in the contributors' page: a package folder added without a line there fails
    here."""
    page = _page("contributing.md")
    layout = page[page.index("## Layout") : page.index("## Development")]
    folders = {Path(folder).name for folder in package_folders()}
    missing = sorted(name for name in folders if f"{name}/" not in layout)
    assert folders >= {"torchspot_operator", "torchspot_trainer", "torchspot_lab", "rendezvous", "cluster"}
    assert missing == []


DIARY = re.compile(
    r"bench/README"  # a pointer into the results' prose
    r"|\b(?:goodput|soak|bench) runs? \d+|\(runs? \d+[,)]|\bruns? \d+ (?:and|in) "  # a numbered run
    r"|(?<!api-version=)\b20\d\d-\d\d-\d\d\b"  # a date, but an API version's
)
"""What belongs in results and docs rather than in product code (the house rules: a docstring states the
rule and its reason; which run measured what, and when, is bench/README.md's)."""


def test_product_code_names_no_run_numbers_dates_or_results_prose() -> None:
    found = []
    for package, root in SOURCE_ROOTS.items():
        for path in sorted((root / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if DIARY.search(line) and "API_VERSION" not in line and "since 2019" not in line:
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert found == []


def test_the_reference_pages_are_what_their_sources_give_and_the_site_builds_strictly(tmp_path: Path) -> None:
    """docs/reference/ is written from the CRD, the trainer's parser, the chart's values schema, the metrics'
    definitions and the API's docstrings (tools/docs_reference.py): a source changed without `make docs`
    fails here. The site then builds with warnings as errors (a broken internal link is one)."""
    pages = render()
    written = {*(ROOT / "docs" / "reference").glob("*.md"), *(ROOT / "docs" / "results").glob("*.md")}
    assert set(pages) == written
    assert {path.stem for path in pages if path.parent.name == "results"} >= {"index", "recovery", "soak"}
    stale = [path.name for path, text in pages.items() if path.read_text() != text]
    assert stale == [], "run `make docs`"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert "Manager" in (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()


MODULE_DOCSTRING_LINES = 30
"""A module docstring says what the module owns, its rules and their reasons; the reasoning beyond that is
the docs' design pages'."""


def test_no_trainer_module_docstring_runs_over_thirty_lines() -> None:
    root = SOURCE_ROOTS["torchspot_trainer"]
    long = {}
    for path in sorted((root / "torchspot_trainer").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > MODULE_DOCSTRING_LINES:
            long[str(path.relative_to(root))] = len(doc.splitlines())
    assert long == {}
