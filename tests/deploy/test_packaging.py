"""The distribution as pip builds it, and the tree it is built from: one path per file."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.layout import ROOT, SOURCE_ROOTS, package_folders

SKIPPED = {".git", ".venv", "node_modules", "build", "runs"}


def test_the_wheel_holds_every_package_the_crd_and_the_commands(tmp_path: Path) -> None:
    """What an installed sandbox, operator or trainer needs comes with `pip install .`: a package folder
    that packages.find misses, or the CRD left out of the package data, fails here."""
    # Built from a copy of what the Dockerfile copies: a checkout's build/ and egg-info (setuptools reuses
    # both) would put stale packages and data files into the wheel and hide a missing one.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package, root in SOURCE_ROOTS.items():
        shutil.copytree(root / package, source / (root / package).relative_to(ROOT),
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True)  # fmt: skip
    (wheel,) = tmp_path.glob("torchspot-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        crd = archive.read("torchspot_operator/crd.yaml").decode()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    packages = {os.path.dirname(n) for n in names if n.endswith("/__init__.py")}
    assert packages == package_folders()
    assert {"torchspot_operator/py.typed", "torchspot_trainer/py.typed", "torchspot_lab/py.typed"} <= names
    assert crd == (ROOT / "manifests" / "crd.yaml").read_text()
    scripts = configparser.ConfigParser()
    scripts.read_string(entry_points)
    assert dict(scripts["console_scripts"]) == {
        "torchspot": "torchspot.cli:main",
        "torchspot-operator": "torchspot_operator.__main__:main",
        "torchspot-run": "torchspot_trainer.launch:main",
    }


def test_the_tree_has_no_symlinks() -> None:
    """One path per file: a link would give grep, mypy, editors and import-graph tools two names for one file."""
    links = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED]
        links += [os.path.join(folder, n) for n in [*dirs, *files] if os.path.islink(os.path.join(folder, n))]
    assert links == []
