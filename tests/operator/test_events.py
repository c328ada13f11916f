"""Every Event the operator posts goes through its one list (events.py): no Event type or reason is written
as a literal elsewhere in its code, and each reason it posts by a name known only at run time (a job's
final phase, a refused create's) is listed. The docs' reference is generated from that list, so a reason
added without it fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from torchspot_operator import conditions, events

PACKAGE = Path(events.__file__).resolve().parent
TYPES = ("Normal", "Warning")


def _literal_types(package: Path = PACKAGE) -> list[str]:
    """Where the code in `package` (but its events.py) writes an Event type as a literal: `file:line`."""
    found = []
    for path in sorted(set(package.glob("*.py")) - {package / "events.py"}):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in TYPES:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_event_type_is_written_outside_the_list() -> None:
    assert _literal_types() == []


def test_the_scan_finds_a_literal_event(tmp_path: Path) -> None:
    """The scan above finds `("Warning", "Evicted", ...)` where code writes one (what it is for)."""
    (tmp_path / "events.py").write_text('EVICTED = ("Evicted", "Warning")\n')
    (tmp_path / "reconcile.py").write_text('posted = ("Warning", "Evicted", "worker pod w-0 evicted")\n')
    assert _literal_types(tmp_path) == ["reconcile.py:1"]


def test_every_reason_posted_by_a_name_known_at_run_time_is_listed() -> None:
    """A job's final phase (reconcile.py) and a create's failure (writes.py): `events.of` looks them up."""
    for reason in (conditions.PHASE_SUCCEEDED, conditions.PHASE_FAILED, conditions.NAME_TAKEN,
                   conditions.FAILED_CREATE):  # fmt: skip
        kind, name, message = events.of(reason, "said")
        assert (name, message) == (reason, "said")
        assert kind in TYPES
    assert events.of(conditions.PHASE_SUCCEEDED, "")[0] == "Normal"
    assert events.of(conditions.PHASE_FAILED, "")[0] == "Warning"
    with pytest.raises(KeyError):
        events.of("NotListed", "a reason nobody listed")


def test_each_reason_is_listed_once_under_its_own_name() -> None:
    reasons = [value for value in vars(events).values() if isinstance(value, events.Reason)]
    assert sorted(r.name for r in reasons) == sorted(events.EVENTS)
    assert all(events.EVENTS[r.name] is r for r in reasons)
