"""The user scripts of examples/, each submitted as its ElasticJob to the sandbox: the real operator,
the node agent's pods as real processes (torchspot-run, gloo workers, the managed etcd), Blob
checkpoints in Azurite.

The DDP example (examples/ddp/train.py, plain DDP made elastic through `torchspot.elastic`) and the
Transformers one (examples/transformers/train.py, a GPT-2-style causal LM in a plain loop) train side
by side on six spot nodes and go through a hard eviction, a frozen node, capacity returning and an
eviction with notice, in place: no surviving process is restarted, every sample is trained once per
epoch, the leaving node writes the emergency checkpoint, the operator's status shows the last
checkpoint, and the final model (from Blob) is the one the same script computes on one node that never
changes (a fixed global batch: float32 reduction order only).
"""

from __future__ import annotations

import difflib
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import JobConfig, NodeFactory, read_events, wait_for
from torchspot_lab.sandbox import Sandbox, load_job
from torchspot_lab.scenario import parse_scenario
from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.checkpoint.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"ddp": ROOT / "examples" / "ddp", "transformers": ROOT / "examples" / "transformers"}
TRAINER_IMAGE = "ghcr.io/torchspot/torchspot-trainer:0.1.0"
"""What each example's image is built from (its Dockerfile): the sandbox runs the trainer image's
torchspot-run with the checkout's copy of the script."""
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
CHECKPOINT_EVERY = 50
MARKET = {"pools": {"onDemand": {"nodes": 1}, "spot": {"nodes": 6, "gpus": 1}}, "notReadyAfter": 2, "timeout": 600}
"""Three one-GPU spot nodes for each job's three workers; the test plays the market itself, each
event once both jobs trained 10 steps at the world size before it."""


def _sandbox_job(name: str, events: Path) -> dict[str, Any]:
    """The example's ElasticJob, as shipped, with the run's length, pace and checkpoint interval, and the
    records of every rank in `events`."""
    job = load_job(EXAMPLES[name] / "elasticjob.yaml")
    assert job["metadata"]["name"] == _job_name(name)
    job["spec"]["checkpoint"]["intervalSteps"] = CHECKPOINT_EVERY
    container = job["spec"]["template"]["spec"]["containers"][0]
    script = Path(container["args"][0])
    assert script.parent.name == name
    container["image"] = TRAINER_IMAGE
    container["args"] = [str(EXAMPLES[name] / script.name), "--steps", str(STEPS), "--step-seconds", "0.1",
                         *EXTRA.get(name, [])]  # fmt: skip
    container.setdefault("env", []).append({"name": "TORCHSPOT_EVENTS_FILE", "value": str(events)})
    return job


def _job_name(example: str) -> str:
    return f"{example}-example"


def _fixed_job(tmp: Path, etcd: EtcdServer, run_id: str, name: str) -> JobConfig:
    """The same script on one local node that never changes: the model every elastic run must compute."""
    program = [str(EXAMPLES[name] / "train.py"), "--steps", str(STEPS), *EXTRA.get(name, [])]
    env = {"TORCHSPOT_EVENTS_FILE": str(tmp / "events.jsonl"), "TORCHSPOT_CHECKPOINT_URI": str(tmp / "ckpt"),
           "TORCHSPOT_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY)}  # fmt: skip
    if name == "transformers":
        env["TORCHSPOT_FORK_PRELOAD"] = "transformers"
    return JobConfig(workdir=tmp, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes="1:1",
                     program=program, extra_env=env)  # fmt: skip


def _final_model(uri: str, env: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    loaded = CheckpointManager(open_storage(uri, env, create_container=False)).load_latest()
    assert loaded is not None
    assert loaded.step == STEPS
    model: dict[str, torch.Tensor] = loaded.state["user"]["model"]
    return model


class _Run:
    """The two jobs in one sandbox, and what the test reads of them."""

    def __init__(self, sandbox: Sandbox, events: dict[str, Path]) -> None:
        self.sandbox, self.events = sandbox, events
        self.nodes: dict[str, dict[str, str]] = {name: {} for name in events}
        """Per job, each of its worker pods seen running, by pod name: its node."""

    def records(self, name: str) -> list[dict[str, Any]]:
        return read_events(self.events[name])

    def running(self, name: str) -> dict[str, str]:
        """The job's running workers by pod name, each with its node (remembered in `nodes`)."""
        found = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in self.sandbox.workers(_job_name(name))
                 if p.get("status", {}).get("phase") == "Running" and p["spec"].get("nodeName")}  # fmt: skip
        self.nodes[name].update(found)
        return found

    def stepped(self, world: int, after: float) -> bool:
        """Both jobs trained 10 steps at `world` after `after`, by the records of each of their ranks."""
        for name in self.events:
            steps = [e for e in self.records(name) if e["event"] == "step" and e["t"] > after]
            if sum(1 for e in steps if e["world_size"] == world) < world * 10:
                return False
        return True

    def wait(self, world: int, after: float, timeout: float, what: str) -> None:
        try:
            wait_for(lambda: self.stepped(world, after), timeout, what, interval=0.2)
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n{self.tails()}")

    def tails(self, lines: int = 15) -> str:
        said = []
        for log in sorted(self.sandbox.workdir.glob("pods/*/log.txt")):
            said.append(f"--- {log.parent.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(said)

    def each(self, act: Callable[[str, dict[str, str]], Any]) -> dict[str, Any]:
        """`act(job, its running workers)` for both jobs, after waiting for every worker of each to run."""
        done = {}
        for name in self.events:
            workers = wait_for(partial(self.running, name), 30, f"{name}: running workers")
            done[name] = act(name, workers)
        return done


def _drive(run: _Run) -> dict[str, int]:
    """3 workers each, then a hard eviction, a frozen node, two nodes back and the joiners evicted with
    notice (3 -> 2 -> 1 -> 2 -> 1), each once both jobs trained 10 steps at the world before; the run to its
    end. Each job's leaving joiner's exit status."""
    agent = run.sandbox.agent
    run.wait(3, 0, timeout=180, what="10 steps at world 3")
    killed = time.time()  # the last worker's node vanishes: its pods SIGKILLed, its Node deleted
    run.each(lambda name, workers: agent.evict(workers[max(workers)], notice=False))
    run.wait(2, killed, timeout=45, what="10 steps at world 2 after the hard eviction")
    frozen = time.time()  # the next one's VM hangs: SIGSTOP, NotReady, its worker replaced by the operator
    run.each(lambda name, workers: agent.freeze(workers[sorted(workers)[1]]))
    run.wait(1, frozen, timeout=45, what="10 steps at world 1 after the freeze")
    joined = time.time()  # capacity returns: the oldest pending worker of each job (the hard eviction's) lands
    added = set(agent.add_spot(2))
    run.wait(2, joined, timeout=90, what="10 steps at world 2 after the join")
    noticed = time.time()
    joiners = run.each(lambda name, workers: next(node for node in workers.values() if node in added))
    assert sorted(joiners.values()) == sorted(added), joiners
    leaving = {name: agent.kubelet.on_node(node)[0] for name, node in joiners.items()}
    for node in joiners.values():
        agent.evict(node, notice=True)  # SIGTERM and the pod's grace period, as the kubelet's node shutdown
    run.wait(1, noticed, timeout=45, what="10 steps at world 1 after the notice")
    for name in run.events:
        wait_for(partial(_succeeded, run.sandbox, _job_name(name)), 120, f"{name}: the job Succeeded")
    codes = {}
    for name, pod in leaving.items():
        assert pod.process is not None
        codes[name] = pod.process.wait(30)
    return codes


def _succeeded(sandbox: Sandbox, name: str) -> bool:
    return sandbox.status(name).get("phase") == "Succeeded"


def _check(name: str, run: _Run, left: int) -> None:
    """No survivor restarted, the notice's emergency checkpoint written by the leaving node, every sample
    once per epoch, the operator told of the last checkpoint, the fixed run's model."""
    events = run.records(name)
    pids: dict[str, set[int]] = defaultdict(set)
    for event in events:
        if event["event"] == "generation":
            pids[event["node"]].add(event["pid"])
    assert {node: len(found) for node, found in pids.items()} == dict.fromkeys(run.nodes[name].values(), 1), (
        name, pids, run.nodes[name])  # fmt: skip
    assert len(pids) == 4, (name, pids)  # the first three, and the joiner
    assert left == 128 + signal.SIGTERM, f"{name}: the evicted joiner's exit"
    first = min(run.nodes[name].items())[1]  # worker 0's node: there from the start to the end
    worlds = [e["world_size"] for e in events if e["event"] == "generation" and e["node"] == first]
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
        logs = run.sandbox.workdir.glob(f"pods/*{_job_name(name)}-worker*/log.txt")
        said = [line for log in logs for line in log.read_text(errors="replace").splitlines() if ": loss " in line]
        losses = [float(line.rsplit(" ", 1)[1]) for line in said]
        assert len(losses) >= 3, said
        assert all(0 < loss < 10 for loss in losses), said


@pytest.mark.slow(seconds=110, cpu_heavy=True)
def test_the_examples_jobs_re_form_in_place_through_the_sandboxs_evictions_freeze_and_join(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """Both examples' ElasticJobs in one sandbox, through their faults (`_drive`); after them the same
    scripts on one local node that never changes."""
    events = {name: tmp_path / f"{name}.jsonl" for name in EXAMPLES}
    jobs = {name: _sandbox_job(name, path) for name, path in events.items()}
    with Sandbox(tmp_path / "run", parse_scenario(MARKET), say=lambda line: None) as sandbox:
        for job in jobs.values():
            sandbox.submit(job)
        run = _Run(sandbox, events)
        left = _drive(run)
        statuses = {name: sandbox.status(_job_name(name)) for name in jobs}
        models = {name: _final_model(job["spec"]["checkpoint"]["uri"], sandbox.azurite.env())
                  for name, job in jobs.items()}  # fmt: skip
        assert sandbox.agent.errors == []
    for name, status in statuses.items():  # the operator read the scripts' checkpoints from the rendezvous
        assert status["lastCheckpoint"]["step"] == STEPS, (name, status)
        assert status["failures"] == 0, (name, status)
    fixed = {name: _fixed_job(tmp_path / f"{name}-fixed", etcd, f"{run_id}-{name}", name) for name in EXAMPLES}
    with ThreadPoolExecutor(2) as pool:
        codes = dict(
            zip(fixed, pool.map(lambda job: [n.wait(120) for n in nodes(job, 1)], fixed.values()), strict=True)
        )
    assert codes == {"ddp": [0], "transformers": [0]}
    for name in EXAMPLES:
        _check(name, run, left[name])
        ours, theirs = models[name], _final_model(str(fixed[name].workdir / "ckpt"))
        difference = max(float((ours[key] - theirs[key]).abs().max()) for key in theirs)
        print(f"fixed vs elastic {name} example: largest parameter difference {difference:.3g}")
        assert difference <= TOLERANCE[name], name


def test_the_ddp_example_is_the_plain_script_and_ten_lines() -> None:
    """The guide's diff (docs/own-script.md) is this one: the elastic script is the plain one with about ten
    lines added."""

    def code(name: str) -> list[str]:  # from the first import on: the docstrings differ by design
        lines = (EXAMPLES["ddp"] / name).read_text().splitlines()
        return lines[next(i for i, line in enumerate(lines) if line.startswith("import")) :]

    diff = list(difflib.unified_diff(code("plain.py"), code("train.py")))
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len([line for line in added if line.strip("+ ")]) <= 11, "\n".join(added)
    assert any("elastic.Manager(" in line for line in added)
