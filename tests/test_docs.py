"""The README documents every flag and setting the code has."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from tests.layout import SOURCE_ROOTS, package_folders
from torchspot_trainer.config import build_parser
from torchspot_trainer.rendezvous.settings import EtcdV3Settings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_training_flag_is_in_the_readme() -> None:
    flags = [a.option_strings[0] for a in build_parser()._actions if a.option_strings[0].startswith("--")]
    missing = [f for f in flags if f != "--help" and f"`{f}`" not in README]
    assert missing == []


def test_every_rendezvous_setting_is_in_the_readme() -> None:
    keys = [f.name for f in fields(EtcdV3Settings) if f.name not in ("host", "port", "run_id")]
    missing = [k for k in keys if f"| `{k}` |" not in README]
    assert missing == []


def test_the_readme_layout_names_every_package_folder() -> None:
    """The layout is one tree in the README: a package folder added without a line there fails here."""
    layout = README[README.index("## Layout") : README.index("## Development")]
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
