"""`make demo`: three local nodes, one lost, and a report that says what happened."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torchspot.lab.demo import main

pytestmark = pytest.mark.slow


def test_demo_loses_a_node_and_reports_the_recovery(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "150", "--kill-after", "30", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "EVICTED node-2" in out
    assert re.search(r"survivors training again in\s+\d+\.\d s at world size 2", out)
    assert re.search(r"finished\s+step 150 at world size 2", out)
    assert "agent exit codes              [0, 0]" in out
    assert "rendezvous keys left in etcd  0" in out
    redone = int(re.search(r"\((\d+) steps redone\)", out).group(1))  # type: ignore[union-attr]
    assert 0 <= redone < 10 + 5  # at most one checkpoint interval, plus steps in flight
    assert list(tmp_path.glob("demo-*/events.jsonl"))
