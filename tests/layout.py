"""The checkout's source roots and the packages in them, for the tests that hold the layout to its docs
and to the wheel."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {"torchspot": ROOT, "torchspot_operator": ROOT / "operator", "torchspot_trainer": ROOT / "trainer",
                "torchspot_lab": ROOT / "lab"}  # fmt: skip
"""Each import package and the source root (pyproject's packages.find where=) that holds it."""


def package_folders() -> set[str]:
    """Every package in the checkout, as its path inside the wheel (`torchspot_trainer/data`)."""
    found = set()
    for package, root in SOURCE_ROOTS.items():
        for init in (root / package).glob("**/__init__.py"):
            found.add(init.parent.relative_to(root).as_posix())
    return found
