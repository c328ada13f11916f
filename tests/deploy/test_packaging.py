"""The distribution as pip builds it, and the tree it is built from: one path per file."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.layout import ROOT, SOURCE_ROOTS, package_folders
from torchspot.cli import build_parser

SKIPPED = {".git", ".venv", "node_modules", "build", "runs"}


def test_the_wheel_holds_every_package_the_crd_and_the_commands(tmp_path: Path) -> None:
    """What an installed sandbox, operator or trainer needs comes with `pip install .`: a package folder
    that packages.find misses, or the CRD left out of the package data, fails here."""
    # Built from a copy of what the Dockerfile copies: a checkout's build/ and egg-info (setuptools reuses
    # both) would put stale packages and data files into the wheel and hide a missing one.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
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
        license_text = archive.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
        about = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    packages = {os.path.dirname(n) for n in names if n.endswith("/__init__.py")}
    assert packages == package_folders()
    assert {"torchspot_operator/py.typed", "torchspot_trainer/py.typed", "torchspot_lab/py.typed"} <= names
    assert crd == (ROOT / "manifests" / "crd.yaml").read_text()
    # The license pyproject.toml names is the one the tree and the wheel hold.
    assert "License-Expression: Apache-2.0" in about.splitlines()
    assert license_text == (ROOT / "LICENSE").read_text()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
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


def test_torchspot_says_its_version_as_installed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"torchspot {metadata.version('torchspot')}"
    assert metadata.version("torchspot") == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
