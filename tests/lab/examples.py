"""The user scripts of examples/, each submitted as its ElasticJob to a sandbox that runs another job too
(test_sandbox.py's: `run_sandbox`'s `alongside`): the real operator, the node agent's pods as real
processes (torchspot-run, gloo workers, the managed etcd), Blob checkpoints in Azurite.

The DDP example (examples/ddp/train.py, plain DDP made elastic through `torchspot.elastic`) and the
Transformers one (examples/transformers/train.py, a GPT-2-style causal LM in a plain loop) train side
by side on three spot nodes each (a pool of their own: its taint keeps the other job's pods off) and go
through a hard eviction, a frozen node, capacity returning and an eviction with notice, in place: no
surviving process is restarted, every sample is trained once per epoch, the leaving node writes the
emergency checkpoint, the operator's status shows the last checkpoint, and the final model (from Blob) is
the one the same script computes on one node that never changes (a fixed global batch: float32 reduction
order only).
"""

from __future__ import annotations

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
from torchspot_lab.local import JobConfig, NodeFactory, read_events, wait_for
from torchspot_lab.report import IN_PLACE, Report, build_report, read_pod_events
from torchspot_lab.sandbox import TRAINER_STAND_IN, Sandbox, load_job
from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.checkpoint.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"ddp": ROOT / "examples" / "ddp", "transformers": ROOT / "examples" / "transformers"}
STEPS = 300
EPOCH_STEPS = 20
"""Both examples' epochs: 960 samples at a global batch of 48 (examples/ddp/common.py), 480 sequences at
24 (examples/transformers/corpus.py); every step is full."""
EXTRA = {"transformers": ["--dtype", "float64", "--micro-batches", "2", "--log-every", "1"]}
"""The Transformers example in float64: AdamW scales the gradients of its least-used parameters up to
full steps, so float32's reduction order alone moved a parameter by 1.7e-3 between runs on 1, 2 and 3
nodes that never changed (300 steps), about what a step redone would; in float64 by 2e-6 at most. It
accumulates each rank's share in two passes (DDP's `no_sync` for the first): accumulation through the
faults, in place, computes the same model too. It logs every step, so that every join's switch follows a
step after which the loop sums a figure (`Manager.all_reduce`): among the ranks that took the step, before
the joiner's group, or a joiner's first bucket meets the others' sum."""
TOLERANCE = {"ddp": 1e-4, "transformers": 1e-4}
"""Largest difference allowed between a parameter of the fixed and of the elastic run: float32
reduction order at world sizes 1, 2 and 3 (largest parameters about 1)."""
CHECKPOINT_EVERY = 50
PACE = 0.15
"""Least seconds a step takes in the faulted runs. The joiner's pod starts (torchspot-run, torch) while
the job trains on: alone, each job's last event came by its 90th step; on a CI run's 2 busy cores, with
the two jobs' events tied together at 0.1 s a step, the DDP job reached its 300th before its joiner."""
LANE = "sandbox.torchspot.dev/lane"
"""The label and the taint of each example's nodes (a pool of its own), which its pods select and
tolerate: a node that returns goes to the job it was added for, whatever another job has pending, and
no other job's pod lands on it."""


def _sandbox_job(name: str, events: Path) -> dict[str, Any]:
    """The example's ElasticJob, as shipped, with the run's length, pace and checkpoint interval, and the
    records of every rank in `events`."""
    job = load_job(EXAMPLES[name] / "elasticjob.yaml", code=EXAMPLES[name])  # as `torchspot lab run --code`
    assert job["metadata"]["name"] == _job_name(name)
    job["spec"]["checkpoint"]["intervalSteps"] = CHECKPOINT_EVERY
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == TRAINER_STAND_IN  # (what each example's image is built from)
    script = Path(container["args"][0])
    assert script == (EXAMPLES[name] / script.name).resolve()
    container["args"] = [str(script), "--steps", str(STEPS), "--step-seconds", str(PACE), *EXTRA.get(name, [])]
    container.setdefault("env", []).append({"name": "TORCHSPOT_EVENTS_FILE", "value": str(events)})
    pod = job["spec"]["template"]["spec"]
    pod["nodeSelector"] = {LANE: name}
    pod.setdefault("tolerations", []).append({"key": LANE, "operator": "Equal", "value": name, "effect": "NoSchedule"})
    return job


def _lane(name: str) -> dict[str, Any]:
    """`NodeAgent.add_spot`'s labels and taints for nodes of example `name` only."""
    return {"labels": {LANE: name}, "taints": [{"key": LANE, "value": name, "effect": "NoSchedule"}]}


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

    def stepped(self, name: str, world: int, after: float) -> bool:
        """The job trained 10 steps at `world` after `after`, by the records of each of its ranks."""
        steps = [e for e in self.records(name) if e["event"] == "step" and e["t"] > after]
        return sum(1 for e in steps if e["world_size"] == world) >= world * 10

    def wait(self, name: str, world: int, after: float, timeout: float, what: str) -> None:
        try:
            wait_for(partial(self.stepped, name, world, after), timeout, f"{name}: {what}", interval=0.2)
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n{self.tails()}")

    def tails(self, lines: int = 15) -> str:
        said = []
        for log in sorted(self.sandbox.workdir.glob("pods/*/log.txt")):
            said.append(f"--- {log.parent.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(said)

    def workers(self, name: str, count: int) -> dict[str, str]:
        """The job's running workers, once `count` of them run."""

        def enough() -> dict[str, str] | None:
            found = self.running(name)
            return found if len(found) >= count else None

        found: dict[str, str] = wait_for(enough, 30, f"{name}: {count} workers running")
        return found


def _drive(run: _Run, name: str) -> int:
    """One job on its lane: 3 workers, then a hard eviction, a frozen node, a node back and the joiner
    evicted with notice (3 -> 2 -> 1 -> 2 -> 1), each once the job trained 10 steps at the world before;
    the run to its end. The leaving joiner's exit status."""
    agent = run.sandbox.agent
    run.wait(name, 3, 0, timeout=180, what="10 steps at world 3")
    killed = time.time()  # the last worker's node vanishes: its pods SIGKILLed, its Node deleted
    workers = run.workers(name, 3)
    agent.evict(workers[max(workers)], notice=False)
    run.wait(name, 2, killed, timeout=45, what="10 steps at world 2 after the hard eviction")
    frozen = time.time()  # the next one's VM hangs: SIGSTOP, NotReady, its worker replaced by the operator
    workers = run.workers(name, 2)
    agent.freeze(workers[sorted(workers)[1]])
    run.wait(name, 1, frozen, timeout=45, what="10 steps at world 1 after the freeze")
    joined = time.time()  # capacity returns on the lane: its oldest pending worker (the hard eviction's) lands
    (added,) = agent.add_spot(1, **_lane(name))
    run.wait(name, 2, joined, timeout=90, what="10 steps at world 2 after the join")
    noticed = time.time()
    assert added in run.workers(name, 2).values()
    (leaving,) = agent.kubelet.on_node(added)
    agent.evict(added, notice=True)  # SIGTERM and the pod's grace period, as the kubelet's node shutdown
    run.wait(name, 1, noticed, timeout=45, what="10 steps at world 1 after the notice")
    wait_for(partial(_succeeded, run.sandbox, _job_name(name)), 120, f"{name}: the job Succeeded")
    assert leaving.process is not None
    return leaving.process.wait(30)


def _report(run: _Run, name: str, status: dict[str, Any]) -> Report:
    """The sandbox's report of one job, from its workers' output (rank 0's records on stdout)."""
    start = min(e["t"] for e in run.records(name))
    events = read_pod_events(run.sandbox.workdir / "pods", start, job=_job_name(name))
    return build_report(job=_job_name(name), submitted=start, status=status, timeline=[], api_events=[],
                        trainer_events=events, checkpoints=[], agent_errors=[])  # fmt: skip


def _succeeded(sandbox: Sandbox, name: str) -> bool:
    return sandbox.status(name).get("phase") == "Succeeded"


def _check(name: str, run: _Run, left: int) -> None:
    """From the job's records: no survivor restarted, a joiner healed beside a step, the notice's emergency
    checkpoint written by the leaving node and the leaving joiner's exit (`left`), every sample once per
    epoch, the loss lines."""
    events = run.records(name)
    pids: dict[str, set[int]] = defaultdict(set)
    for event in events:
        if event["event"] == "generation":
            pids[event["node"]].add(event["pid"])
    # One process on each node that ran a worker: the first three, the joiner, and any that came after (the
    # other job's nodes, free once it ended, take a replacement that joins).
    assert all(len(found) == 1 for found in pids.values()), (name, pids)
    assert set(run.nodes[name].values()) <= set(pids), (name, pids, run.nodes[name])
    assert len(pids) >= 4, (name, pids)
    assert left == 128 + signal.SIGTERM, f"{name}: the evicted joiner's exit"
    first = min(run.nodes[name].items())[1]  # worker 0's node: there from the start to the end
    worlds = [e["world_size"] for e in events if e["event"] == "generation" and e["node"] == first]
    assert worlds[0] == 3
    assert {1, 2} <= set(worlds), worlds
    # A join's heal went beside the next step: the holders trained it, the joiner received the state meanwhile.
    beside = [e for e in events if e["event"] == "generation" and e["trainers"] and e["rank"] not in e["trainers"]]
    assert beside, (name, [e for e in events if e["event"] == "generation"])
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


class Examples:
    """Both examples' jobs in a sandbox that runs another one (`run_sandbox`'s `alongside`), through their
    faults (`_drive`); beside them, started at once, the same scripts on one local node that never changes
    (they take the cores while the sandbox's parts start and wait). `check` then asserts what they did."""

    def __init__(self, tmp: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory) -> None:
        self.fixed = {name: _fixed_job(tmp / f"{name}-fixed", etcd, f"{run_id}-{name}", name) for name in EXAMPLES}
        self.fixed_nodes = {name: nodes(job, 1) for name, job in self.fixed.items()}
        self.events = {name: tmp / f"{name}.jsonl" for name in EXAMPLES}
        self.jobs = {name: _sandbox_job(name, path) for name, path in self.events.items()}
        self.statuses: dict[str, dict[str, Any]] = {}
        self.reports: dict[str, Report] = {}
        self.models: dict[str, dict[str, torch.Tensor]] = {}
        self.left: dict[str, int] = {}
        self.run: _Run | None = None

    def __call__(self, sandbox: Sandbox) -> None:
        """In the sandbox: three nodes of its own for each job, the jobs submitted and driven each at its own
        pace, then their statuses, reports and final models read."""
        self.run = run = _Run(sandbox, self.events)
        for name in EXAMPLES:
            sandbox.agent.add_spot(3, **_lane(name))
        for job in self.jobs.values():
            sandbox.submit(job)
        with ThreadPoolExecutor(2) as pool:
            self.left = dict(zip(EXAMPLES, pool.map(partial(_drive, run), EXAMPLES), strict=True))
        self.statuses = {name: sandbox.status(_job_name(name)) for name in self.jobs}
        self.reports = {name: _report(run, name, self.statuses[name]) for name in self.jobs}
        self.models = {name: _final_model(job["spec"]["checkpoint"]["uri"], sandbox.azurite.env())
                       for name, job in self.jobs.items()}  # fmt: skip

    def check(self) -> None:
        """Every re-form in place, no process restarted, every sample once, the operator's status, the same
        model as the fixed run's (module docstring)."""
        run = self.run
        assert run is not None, "the examples never ran in the sandbox"
        assert {name: [n.wait(120) for n in started] for name, started in self.fixed_nodes.items()} == {
            "ddp": [0], "transformers": [0]}  # fmt: skip
        for report in self.reports.values():  # what `torchspot lab run` would say of each: every re-form in place
            assert report.final_step == STEPS, report.summary()
            assert len(report.restarts) >= 5, report.summary()  # the first group, then kill, freeze, join, notice
            assert {r["path"] for r in report.restarts[1:]} == {IN_PLACE}, report.summary()
            assert report.samples_per_second > 0, report.summary()
        for name, status in self.statuses.items():  # the operator read the scripts' checkpoints from the rendezvous
            assert status["lastCheckpoint"]["step"] == STEPS, (name, status)
            assert status["failures"] == 0, (name, status)
        for name in EXAMPLES:
            _check(name, run, self.left[name])
            ours, theirs = self.models[name], _final_model(str(self.fixed[name].workdir / "ckpt"))
            difference = max(float((ours[key] - theirs[key]).abs().max()) for key in theirs)
            print(f"fixed vs elastic {name} example: largest parameter difference {difference:.3g}")
            assert difference <= TOLERANCE[name], name
