"""A sharded (FSDP2) run on the recovery API resumes at another world size: real gloo processes, real DCP
checkpoints on Azurite (checkpoint/sharded.py, elastic/saving.py); the checkpoints in a local folder."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer import sharded_loop
from torchspot_lab.azurite import Azurite
from torchspot_lab.etcd import free_port
from torchspot_trainer.checkpoint.dcp import committed
from torchspot_trainer.checkpoint.sharded import ShardedCheckpoints
from torchspot_trainer.checkpoint.storage import blob_container
from torchspot_trainer.data.sampler import ElasticSampler as Position
from torchspot_trainer.elastic import Manager, Refused
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.recovery.notices import EXIT_EVICTED, EXIT_FAILED

LOOP = Path(__file__).with_name("sharded_loop.py")
ROOT = Path(__file__).parents[2]
TOLERANCE = 1e-5
"""float32 reduction order: the ranks' shares of a step are summed in another order at another world size."""


def _start(world: int, uri: str, steps: int, env: dict[str, str], *extra: str) -> list[subprocess.Popen[str]]:
    """`world` ranks of sharded_loop.py, started (`extra`: its further arguments)."""
    port = free_port()
    common = {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    return [
        subprocess.Popen(
            [sys.executable, str(LOOP), uri, str(steps), *extra],
            env={**common, "RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]


def _lines(processes: list[subprocess.Popen[str]], codes: list[int] | None = None) -> list[dict[str, Any]]:
    """The loop's JSON lines (a step's, the final one; not the manager's records), once every process has
    exited, each with its status in `codes` (default 0)."""
    said = [process.communicate(timeout=180) for process in processes]
    expected = codes or [0] * len(processes)
    assert [process.returncode for process in processes] == expected, [err[-3000:] for _, err in said]
    lines = [json.loads(line) for out, _ in said for line in out.splitlines() if line.startswith("{")]
    return [line for line in lines if "ids" in line or "final" in line]


def _steps(lines: list[dict[str, Any]]) -> dict[int, tuple[float, list[int]]]:
    """Each step's loss (rank 0's line) and the samples every rank trained in it, sorted."""
    steps: dict[int, tuple[float, list[int]]] = {}
    for line in (line for line in lines if "step" in line):
        loss, ids = steps.get(line["step"], (line["loss"], []))
        steps[line["step"]] = (loss, sorted(ids + line["ids"]))
    return steps


def _alone(steps: int) -> tuple[dict[int, tuple[float, list[int]]], dict[str, torch.Tensor]]:
    """The same training in this process, unsharded, on one rank: each step's loss and samples, and the
    parameters at the end."""
    model, (inputs, targets) = sharded_loop.model(), sharded_loop.data()
    optimizer = sharded_loop.optimizer_of(model.parameters())
    position = Position(sharded_loop.SAMPLES, batch_size=1, seed=0, global_batch=sharded_loop.GLOBAL_BATCH)
    taken = {}
    for step in range(1, steps + 1):
        ids = position.step_chunk(1)
        optimizer.zero_grad()
        loss = (model(inputs[ids]) - targets[ids]).pow(2).mean()
        loss.backward()
        optimizer.step()
        position.advance(1)
        taken[step] = (loss.item(), sorted(ids))
    return taken, {name: parameter.detach() for name, parameter in model.named_parameters()}


@pytest.mark.slow(seconds=18)
def test_a_sharded_run_stopped_by_a_notice_at_two_ranks_resumes_at_three_as_one_unsharded_rank_trains(
    azurite: Azurite,
) -> None:
    """FSDP2 at a fixed global batch, checkpointing to Blob every 3 steps: two ranks train until rank 1's
    node gets a notice (SIGTERM) after step 3; at step 4's boundary both ranks write their shards of the
    emergency checkpoint, rank 1 leaves (143) and rank 0 for the restart path (1), each rank's shards
    in a blob of its own. Three ranks resume from step 4's checkpoint (each its shards of it: DCP
    reshards 2 to 3) and train to step 6, no step lost or redone. Every step's loss and samples are
    those of the same training unsharded on one rank, and so are the final parameters (float32
    reduction order apart)."""
    env, blob = azurite.env(), f"az://sharded/{uuid.uuid4().hex[:10]}"
    first = _lines(_start(2, blob, 6, env, "3"), codes=[EXIT_FAILED, EXIT_EVICTED])
    assert committed(blob, env=env) == [f"{blob}/step-000000000{step}" for step in (3, 4)]
    container, prefix = blob.removeprefix("az://").split("/", 1)
    written = [item.name for item in blob_container(container, env).list_blobs(name_starts_with=f"{prefix}/step-")]
    assert len([name for name in written if name.endswith(".distcp")]) == 4, written  # each rank its own shards
    resumed = _lines(_start(3, blob, 6, env))
    reference, parameters = _alone(6)
    before, after = _steps(first), _steps(resumed)
    assert sorted(before) == [1, 2, 3]  # (step 4 committed, and its boundary's notice ended the run in step())
    assert sorted(after) == [5, 6]  # from step 4's samples on: none lost or redone
    for step, (loss, ids) in {**before, **after}.items():
        assert ids == reference[step][1], step  # each sample once, the same ones
        assert loss == pytest.approx(reference[step][0], rel=TOLERANCE), step
    (end,) = [line for line in resumed if "final" in line]
    assert end["resumed_from"] == "checkpoint"
    for name, expected in parameters.items():
        found = torch.tensor(end["final"][name])
        torch.testing.assert_close(found, expected, rtol=TOLERANCE, atol=TOLERANCE, msg=name)


@pytest.mark.usefixtures("one_rank_group")
def test_sharded_checkpoints_in_a_folder_keep_the_step_saved_the_newest_two_and_pass_over_a_torn_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ShardedCheckpoints in a local folder, in this process's one-rank group: three saves beside the loop
    (each followed by an update as soon as `staged()` returned) keep the newest two, each holding its own
    step; a newer folder without metadata (a save that stopped) is said in one line and passed over."""
    checkpoints = ShardedCheckpoints(str(tmp_path), keep=2)
    state: dict[str, Any] = {"weight": torch.zeros(4, 3), "step": 0}
    for step in (1, 2, 3):
        state["weight"].fill_(step)
        state["step"] = step
        checkpoints.save_async(step, state)
        checkpoints.staged()
        state["weight"].fill_(-1.0)  # the next update
    checkpoints.close()
    torn = tmp_path / "step-0000000004"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"step-000000000{n}" for n in (2, 3, 4)]
    loaded: dict[str, Any] = {"weight": torch.zeros(4, 3), "step": 0}
    reader = ShardedCheckpoints(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        found = reader.load_latest(lambda: loaded)
    assert found is not None
    reader.close()
    assert found[0] == 3
    assert torch.equal(found[1]["weight"], torch.full((4, 3), 3.0))
    assert found[1]["step"] == 3
    assert [record.message for record in caplog.records if "no metadata" in record.message] == [
        "sharded checkpoints of steps [4] have no metadata (their saves stopped before they committed): not "
        "loaded; resuming from step 3"
    ]


def test_sharded_in_place_is_refused_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchspot-run (its agent's variable set) a sharded manager takes the restart path, saying why;
    asked for in place, it is refused at start."""
    monkeypatch.setenv(PEER_LOST_ENV, "1")
    with pytest.raises(Refused, match="in_place=True with sharded=True: a sharded state re-forms by the restart"):
        Manager(dict, lambda state: None, in_place=True, sharded=True, checkpoint_uri="")
