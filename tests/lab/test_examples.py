"""The user scripts of examples/ under torchspot-run: real etcd, real agents and gloo workers.

The DDP example (examples/ddp/train.py, plain DDP made elastic through `torchspot.elastic`) and the
Transformers one (examples/transformers/train.py, a GPT-2-style causal LM in a plain loop) go
through a kill, a freeze, a join and an eviction with notice, in place: no surviving process is
restarted, every sample is trained once per epoch, the leaving node writes the emergency checkpoint,
and the final model is the one the same script computes on one node that never changes (a fixed
global batch: float32 reduction order only).
"""

from __future__ import annotations

import difflib
import signal
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
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
TRANSFORMERS = ROOT / "examples" / "transformers"
STEPS = 300
EPOCH_STEPS = 20
"""Both examples' epochs: 960 samples at a global batch of 48 (examples/ddp/common.py), 480 sequences at
24 (examples/transformers/corpus.py); every step is full."""
EXTRA = {"transformers": ["--dtype", "float64", "--micro-batches", "2"]}
"""The Transformers example in float64: AdamW scales the gradients of its least-used parameters up to
full steps, so float32's reduction order alone moved a parameter by 1.7e-3 between runs on 1, 2 and 3
nodes that never changed (300 steps), about what a step redone would; in float64 by 2e-6 at most. It
accumulates each rank's share in two passes (DDP's `no_sync` for the first): accumulation through the
faults, in place, computes the same model too."""
TOLERANCE = {"ddp": 1e-4, "transformers": 1e-4}
"""Largest difference allowed between a parameter of the fixed and of the elastic run: float32
reduction order at world sizes 1, 2 and 3 (largest parameters about 1)."""


def _job(tmp: Path, etcd: EtcdServer, run_id: str, nnodes: str, script: Path, *, pace: float) -> JobConfig:
    events = tmp / "events.jsonl"
    program = [str(script), "--steps", str(STEPS), "--step-seconds", str(pace), *EXTRA.get(script.parent.name, [])]
    env = {
        "TORCHSPOT_EVENTS_FILE": str(events), "TORCHSPOT_CHECKPOINT_URI": str(tmp / "ckpt"),
        "TORCHSPOT_CHECKPOINT_EVERY": "50",
        # Its import, once per agent in the warm server: a joiner's workers start without it.
        "TORCHSPOT_FORK_PRELOAD": "transformers" if script.parent == TRANSFORMERS else "",
    }  # fmt: skip
    return JobConfig(
        workdir=tmp, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes=nnodes, program=program,
        extra_env={key: value for key, value in env.items() if value},
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


def _await(name: str, job: JobConfig, world: int, after: float, *, timeout: float, what: str) -> None:
    wait_for(partial(_stepped, job, world, after), timeout, f"{name}: {what}")


def _stepped(job: JobConfig, world: int, after: float) -> bool:
    """10 steps at `world` after `after`, by the records of each of its ranks."""
    return _steps_at(job, world, after) >= world * 10


def _check(name: str, job: JobConfig, fixed: JobConfig, nodes: list[LocalNode]) -> None:
    """No survivor restarted, the notice's emergency checkpoint written by the leaving node, every sample
    once per epoch, the fixed run's model."""
    events = _events(job)
    pids: dict[str, set[int]] = defaultdict(set)
    for event in events:
        if event["event"] == "generation":
            pids[event["node"]].add(event["pid"])
    assert {node: len(found) for node, found in pids.items()} == {n.name: 1 for n in nodes}, (name, pids)
    worlds = [e["world_size"] for e in events if e["event"] == "generation" and e["node"] == nodes[0].name]
    assert worlds[0] == 3
    assert {1, 2} <= set(worlds), worlds
    # A step's records (each rank that committed it writes one) name the same samples; one step of each
    # number in the line that went on, and each epoch's steps took every sample once.
    chunks: dict[int, list[int]] = {}
    for event in (e for e in events if e["event"] == "step"):
        assert chunks.setdefault(event["step"], event["samples"]) == event["samples"], (name, event)
    assert sorted(chunks) == list(range(1, STEPS + 1))
    (saved,) = [e for e in events if e["event"] == "emergency_checkpoint"]
    assert saved["ok"], (name, saved)
    assert saved["step"] in chunks, (name, saved)
    size = len(chunks[1]) * EPOCH_STEPS
    for epoch in range(STEPS // EPOCH_STEPS):
        taken = [s for step in range(epoch * EPOCH_STEPS + 1, (epoch + 1) * EPOCH_STEPS + 1) for s in chunks[step]]
        assert sorted(taken) == list(range(size)), f"{name}, epoch {epoch}: a sample trained twice or skipped"
    if name == "transformers":  # its mean loss, all-reduced by the API every 50 steps (in place, through the faults)
        said = [line for node in nodes for line in node.log_path.read_text().splitlines() if ": loss " in line]
        losses = [float(line.rsplit(" ", 1)[1]) for line in said]
        assert len(losses) >= 3, said
        assert all(0 < loss < 10 for loss in losses), said
    ours, theirs = _final_model(job), _final_model(fixed)
    difference = max(float((ours[key] - theirs[key]).abs().max()) for key in theirs)
    print(f"fixed vs elastic {name} example: largest parameter difference {difference:.3g}")
    assert difference <= TOLERANCE[name], name


def _drive(name: str, job: JobConfig, nodes: NodeFactory) -> list[LocalNode]:
    """3 nodes, then one killed, one frozen, one joining and the joiner evicted with notice (its agent
    SIGTERMed, as the kubelet does: 3 -> 2 -> 1 -> 2 -> 1), each once the job trained 10 steps at the
    world before; the run to its end. Its nodes, the joiner last."""
    started = nodes(job, 3)
    _await(name, job, 3, 0, timeout=120, what="10 steps at world 3")
    killed = time.time()
    started[2].kill()
    _await(name, job, 2, killed, timeout=30, what="10 steps at world 2 after the kill")
    frozen = time.time()
    started[1].freeze()
    _await(name, job, 1, frozen, timeout=30, what="10 steps at world 1 after the freeze")
    joined = time.time()
    (joiner,) = nodes(job, 1)
    _await(name, job, 2, joined, timeout=60, what="10 steps at world 2 after the join")
    noticed = time.time()
    joiner.terminate(grace=30)
    assert joiner.poll() == 128 + signal.SIGTERM, f"{name}: the evicted node's exit\n{joiner.log_tail(40)}"
    _await(name, job, 1, noticed, timeout=30, what="10 steps at world 1 after the notice")
    assert _finish([started[0]]) == [0], name
    started[1].kill()  # the frozen node's VM is deleted
    return [*started, joiner]


@pytest.mark.slow(seconds=90, cpu_heavy=True)
def test_the_examples_re_form_in_place_through_a_kill_a_freeze_and_a_join(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """Both examples side by side, each through its faults (`_drive`); beside them the same scripts on one
    node that never changes."""
    scripts = {"ddp": DDP / "train.py", "transformers": TRANSFORMERS / "train.py"}
    jobs = {n: _job(tmp_path / n, etcd, f"{run_id}-{n}", "1:3", s, pace=0.1) for n, s in scripts.items()}
    fixed = {n: _job(tmp_path / f"{n}-fixed", etcd, f"{run_id}-{n}-f", "1:1", s, pace=0.0) for n, s in scripts.items()}
    with ThreadPoolExecutor(2) as pool:  # the fixed runs after: the faulted runs' timelines have the cores
        driven = {name: pool.submit(_drive, name, job, nodes) for name, job in jobs.items()}
        ran = {name: run.result() for name, run in driven.items()}
        fixed_codes = {name: pool.submit(lambda job: _finish(nodes(job, 1)), job) for name, job in fixed.items()}
        assert {name: run.result() for name, run in fixed_codes.items()} == {"ddp": [0], "transformers": [0]}
    for name, job in jobs.items():
        _check(name, job, fixed[name], ran[name])


def test_the_ddp_example_is_the_plain_script_and_ten_lines() -> None:
    """The guide's diff (docs/own-script.md) is this one: the elastic script is the plain one with about ten
    lines added."""

    def code(name: str) -> list[str]:  # from the first import on: the docstrings differ by design
        lines = (DDP / name).read_text().splitlines()
        return lines[next(i for i, line in enumerate(lines) if line.startswith("import")) :]

    diff = list(difflib.unified_diff(code("plain.py"), code("train.py")))
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len([line for line in added if line.strip("+ ")]) <= 11, "\n".join(added)
    assert any("elastic.Manager(" in line for line in added)
