"""The user scripts of examples/ under torchspot-run: real etcd, real agents and gloo workers.

The DDP example (examples/ddp/train.py, plain DDP made elastic through `torchspot.elastic`) goes
through a kill, a freeze and a join, in place: no surviving process is restarted, every sample is
trained once per epoch, and the final model is the one the same script computes on one node that
never changes (a fixed global batch: float32 reduction order only).
"""

from __future__ import annotations

import difflib
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import JobConfig, LocalNode, NodeFactory, read_events, wait_for
from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.checkpoint.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
DDP = ROOT / "examples" / "ddp"
STEPS = 200
EPOCH_STEPS = 20
"""960 samples at a global batch of 48 (examples/ddp/common.py): every step is full."""
TOLERANCE = 1e-4
"""Largest difference allowed between a parameter of the fixed and of the elastic run (float32
reduction order at world sizes 1, 2 and 3; largest parameter about 1)."""


def _job(tmp: Path, etcd: EtcdServer, run_id: str, nnodes: str, *, pace: float) -> JobConfig:
    events = tmp / "events.jsonl"
    program = [
        str(DDP / "train.py"), "--steps", str(STEPS), "--step-seconds", str(pace),
        "--checkpoint-uri", str(tmp / "ckpt"), "--checkpoint-every", "50",
    ]  # fmt: skip
    return JobConfig(
        workdir=tmp, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes=nnodes, program=program,
        extra_env={"TORCHSPOT_EVENTS_FILE": str(events)},
    )  # fmt: skip


def _events(job: JobConfig) -> list[dict[str, Any]]:
    return read_events(job.workdir / "events.jsonl")


def _steps_at(job: JobConfig, world: int, after: float) -> int:
    return sum(1 for e in _events(job) if e["event"] == "step" and e["world_size"] == world and e["t"] > after)


def _final_model(job: JobConfig) -> dict[str, torch.Tensor]:
    loaded = CheckpointManager(open_storage(str(job.workdir / "ckpt"))).load_latest()
    assert loaded is not None
    assert loaded.step == STEPS
    model: dict[str, torch.Tensor] = loaded.state["user"]["model"]
    return model


def _finish(nodes: list[LocalNode]) -> list[int]:
    codes = []
    for node in nodes:
        try:
            codes.append(node.wait(120))
        except Exception:
            pytest.fail(f"{node.name} did not finish:\n{node.log_tail(60)}")
    return codes


@pytest.mark.slow(seconds=35)
def test_the_ddp_example_re_forms_in_place_through_a_kill_a_freeze_and_a_join(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    fixed = _job(tmp_path / "fixed", etcd, run_id + "-fixed", "1:1", pace=0.0)
    elastic = _job(tmp_path / "elastic", etcd, run_id, "1:3", pace=0.1)
    fixed_codes: list[int] = []
    fixed_run = threading.Thread(target=lambda: fixed_codes.extend(_finish(nodes(fixed, 1))))
    fixed_run.start()

    started = nodes(elastic, 3)
    wait_for(lambda: _steps_at(elastic, 3, 0) >= 3 * 10, 90, "10 steps at world 3")
    killed = time.time()
    started[2].kill()
    wait_for(lambda: _steps_at(elastic, 2, killed) >= 2 * 10, 30, "10 steps at world 2 after the kill")
    frozen = time.time()
    started[1].freeze()
    wait_for(lambda: _steps_at(elastic, 1, frozen) >= 10, 30, "10 steps at world 1 after the freeze")
    joined = time.time()
    (joiner,) = nodes(elastic, 1)
    wait_for(lambda: _steps_at(elastic, 2, joined) >= 2 * 10, 60, "10 steps at world 2 after the join")
    assert _finish([started[0], joiner]) == [0, 0]
    fixed_run.join(120)
    assert fixed_codes == [0]
    started[1].kill()  # the frozen node's VM is deleted

    events = _events(elastic)
    # No survivor restarted: each node's worker kept one process through every group it was in.
    pids: dict[str, set[int]] = defaultdict(set)
    for event in events:
        if event["event"] == "generation":
            pids[event["node"]].add(event["pid"])
    assert {node: len(found) for node, found in pids.items()} == {n.name: 1 for n in [*started, joiner]}, pids
    worlds = [e["world_size"] for e in events if e["event"] == "generation" and e["node"] == started[0].name]
    assert worlds[0] == 3
    assert {1, 2} <= set(worlds)
    # Every sample once per epoch: a step's records (each rank that committed it writes one) name the
    # same samples; one step of each number in the line that went on.
    chunks: dict[int, list[int]] = {}
    for event in (e for e in events if e["event"] == "step"):
        assert chunks.setdefault(event["step"], event["samples"]) == event["samples"], event
    assert sorted(chunks) == list(range(1, STEPS + 1))
    for epoch in range(STEPS // EPOCH_STEPS):
        taken = [s for step in range(epoch * EPOCH_STEPS + 1, (epoch + 1) * EPOCH_STEPS + 1) for s in chunks[step]]
        assert sorted(taken) == list(range(960)), f"epoch {epoch}: a sample trained twice or skipped"
    # The same model as the run that never changed.
    ours, theirs = _final_model(elastic), _final_model(fixed)
    difference = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
    print(f"fixed vs elastic DDP example: largest parameter difference {difference:.3g}")
    assert difference <= TOLERANCE


def test_the_ddp_example_is_the_plain_script_and_ten_lines() -> None:
    """The README's diff is this one: the elastic script is the plain one with about ten lines added."""
    plain = (DDP / "plain.py").read_text().splitlines()
    ours = (DDP / "train.py").read_text().splitlines()
    body = slice(next(i for i, line in enumerate(plain) if line.startswith("import")), None)
    diff = list(
        difflib.unified_diff(plain[body], ours[next(i for i, x in enumerate(ours) if x.startswith("import")) :])
    )
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len(added) <= 14, "\n".join(added)
    assert any("elastic.Manager(" in line for line in added)
