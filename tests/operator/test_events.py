"""Every Event reason the operator's code names is in its one list (events.EVENTS), with the type it is
posted as: the docs' reference is generated from that list, so a reason added without it fails here."""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

from torchspot_operator import events

PACKAGE = Path(events.__file__).resolve().parent
TYPES = ("Normal", "Warning")


def _named_in_code() -> set[tuple[str, str]]:
    """(type, reason) for each tuple or call whose items hold a literal Event type followed by a literal
    reason: `("Warning", "Evicted", ...)`, `_event(body, "Warning", "InvalidSpec", ...)`."""
    found = set()
    for path in sorted(set(PACKAGE.glob("*.py")) - {Path(events.__file__).resolve()}):
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.elts if isinstance(node, ast.Tuple) else node.args if isinstance(node, ast.Call) else []
            for first, second in pairwise(items):
                if (isinstance(first, ast.Constant) and first.value in TYPES and isinstance(second, ast.Constant)
                        and isinstance(second.value, str)):  # fmt: skip
                    found.add((first.value, second.value))
    return found


def test_every_event_the_operator_names_is_listed_with_its_type() -> None:
    named = _named_in_code()
    assert ("Warning", "Evicted") in named  # the scan finds what it is for
    assert ("Warning", "InvalidSpec") in named
    listed = {(kind, reason) for reason, (kind, _when) in events.EVENTS.items()}
    assert named - listed == set()
