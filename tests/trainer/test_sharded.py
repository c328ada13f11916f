"""A sharded (FSDP2) run on the recovery API resumes at another world size: real gloo processes, real DCP
checkpoints on Azurite and in a local folder (checkpoint/sharded.py, elastic/saving.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from torchspot_lab.azurite import Azurite
from torchspot_lab.etcd import free_port
from torchspot_trainer.elastic import Manager, Refused
from torchspot_trainer.markers import PEER_LOST_ENV

LOOP = Path(__file__).with_name("sharded_loop.py")
ROOT = Path(__file__).parents[2]
TOLERANCE = 1e-5
"""float32 reduction order: the ranks' shares of a step are summed in another order at another world size."""


def _start(world: int, uri: str, steps: int, env: dict[str, str]) -> list[subprocess.Popen[str]]:
    port = free_port()
    common = {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    return [
        subprocess.Popen(
            [sys.executable, str(LOOP), uri, str(steps)],
            env={**common, "RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]


def _lines(processes: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """The loop's JSON lines (a step's, the final one; not the manager's records), once every process has
    exited, each with status 0."""
    said = [process.communicate(timeout=180) for process in processes]
    assert [process.returncode for process in processes] == [0] * len(processes), [err[-3000:] for _, err in said]
    lines = [json.loads(line) for out, _ in said for line in out.splitlines() if line.startswith("{")]
    return [line for line in lines if "ids" in line or "final" in line]


def _steps(lines: list[dict[str, Any]]) -> dict[int, tuple[float, list[int]]]:
    """Each step's loss (rank 0's line) and the samples every rank trained in it, sorted."""
    steps: dict[int, tuple[float, list[int]]] = {}
    for line in (line for line in lines if "step" in line):
        loss, ids = steps.get(line["step"], (line["loss"], []))
        steps[line["step"]] = (loss, sorted(ids + line["ids"]))
    return steps


def test_a_sharded_run_saved_at_two_ranks_resumes_at_three_as_the_uninterrupted_run_at_one(
    azurite: Azurite, tmp_path: Path
) -> None:
    """FSDP2 at a fixed global batch: one rank trains 6 steps, checkpointing into a local folder; two ranks
    train 3 steps, checkpointing to Blob; three ranks resume from that checkpoint (each its shards of
    it: DCP reshards 2 to 3) and train to step 6. Every step's loss and samples are the one rank's, and so
    are the final parameters (float32 reduction order apart)."""
    env, blob = azurite.env(), f"az://sharded/{uuid.uuid4().hex[:10]}"
    both = _lines(_start(1, str(tmp_path / "one"), 6, env) + _start(2, blob, 3, env))
    alone, first = ([line for line in both if line["world"] == world] for world in (1, 2))
    resumed = _lines(_start(3, blob, 6, env))
    reference, before, after = _steps(alone), _steps(first), _steps(resumed)
    assert sorted(before) == [1, 2, 3]
    assert sorted(after) == [4, 5, 6]
    for step, (loss, ids) in {**before, **after}.items():
        assert ids == reference[step][1], step  # each sample once, the same ones
        assert loss == pytest.approx(reference[step][0], rel=TOLERANCE), step
    (end,) = [line for line in resumed if "final" in line]
    (expected,) = [line["final"] for line in alone if "final" in line]
    assert end["resumed_from"] == "checkpoint"
    for name, values in expected.items():
        torch.testing.assert_close(
            torch.tensor(end["final"][name]), torch.tensor(values), rtol=TOLERANCE, atol=TOLERANCE
        )
    assert sorted(path.name for path in (tmp_path / "one").iterdir()) == ["step-0000000003", "step-0000000006"]


def test_sharded_in_place_is_refused_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchspot-run (its agent's variable set) a sharded manager takes the restart path, saying why;
    asked for in place, it is refused at start."""
    monkeypatch.setenv(PEER_LOST_ENV, "1")
    with pytest.raises(Refused, match="in_place=True with sharded=True: a sharded state re-forms by the restart"):
        Manager(dict, lambda state: None, in_place=True, sharded=True, checkpoint_uri="")
