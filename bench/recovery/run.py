"""Recovery benchmark: our etcd-v3 rendezvous against torch's stock backends and TorchFT, in one run.

For each backend and scenario, a local job of real agents and gloo workers (the
lab's toy program; TorchFT: torchft_replica.py, the same step under its Manager) trains;
we apply the fault to a whole process tree and measure

- recovery: seconds from the fault (or the joiner's start) to the first completed
  training step at the new world size (TorchFT: the first step a survivor commits with
  the new number of participants);
- steps lost: work redone (ours and stock: the last step completed before the fault minus
  the step the new group resumed from; TorchFT: steps the survivors did not commit);
- at a join, the others' training lost (`training_lost`): from the joiner's start to the first step
  at the new size, the time the nodes already training took beyond what as many steps took them just
  before (their pause at the switch, and their steps slowed by the joiner's start-up where it shares
  their cores).

Scenarios: `join` (2 nodes, a third arrives), `joinloss` (2 nodes, a third arrives, and one of
the two is SIGKILLed while the joiner still starts: JOIN_LOSS_WINDOW; recovery is then the
survivor's first step in a group the victim is not in, whatever its size), `hard` (3 nodes, one
SIGKILLed with its workers), `frozen` (3 nodes, one SIGSTOPped with its workers, at a random point of
the step), `notice` (3 nodes, one agent SIGTERMed as the kubelet does at an eviction;
TorchFT has no notice path: its replica is SIGTERMed), `falsealarm` (3 nodes, busy loops on
every core for 10 s while one node is stopped three times for 0.5 s: passes if nobody is
dropped), and, for our backends only, `wipe`, `wipefrozen` and `wipejoin`: `hard`, `frozen` and
`join` after the job's etcd lost its data under it (restarted empty, as the managed etcd comes back when its pod
moves), once the agents wrote their round back (rounds.py's `restored`). The victim is the node
that holds the highest rank, so the surviving rank 0 keeps logging, and the c10d store (hosted
by the first agent) survives: the comparison is about noticing the fault, not about that single
point of failure.

Backends:
- `etcd-v3`: torchspot-run with our backend and its defaults (the restart path: every
  worker restarted, forked from the agent's warm server);
- `etcd-v3-inplace`: the same agents, the toy program with `--in-place`: registered workers
  re-form their gloo group in the processes they run in (handover.py): the mechanism's cost
  without a model;
- `trainer-inplace`: the same agents, the project's trainer with `--in-place` (`-m
  torchspot_trainer`, a small CNN on the digits, global batch 48, a progress line per step): the
  in-place mode as a user runs it;
- `ddp-inplace`: the same agents, examples/ddp/train.py (a user's plain DDP script made elastic with
  `torchspot.elastic`: an MLP, global batch 48, each step paced to the toy's STEP_TIME): the recovery
  API as a user's own script gets it;
- `transformers-inplace`: the same with examples/transformers/train.py (a GPT-2-style causal LM of
  Hugging Face Transformers in a plain loop on the API, its import preloaded by the agent's warm server);
- `fsdp-restart`: examples/fsdp/train.py (a GPT-style LM sharded with FSDP2 over every rank, on the API
  with `sharded=True`): a sharded run's restart path, every worker restarted and resharded from the newest
  DCP checkpoint (a local folder, one every CHECKPOINT_EVERY steps) or, at a join, the shards every rank
  wrote at the boundary where the agents stopped it (`--restart-path`): what a sharded run gets where it
  cannot re-form in place, its replica groups spanning nodes (docs/sharded-in-place.md);
- `fsdp-restart-copies`: the same with each rank's shards traded with the next node's after every step
  (`--peer-copy-every 1`: recovery/peer_copy.py), so that a node lost without notice leaves them behind;
- `fsdp-inplace`: the same example with `--in-place`, 2 workers a node: each node one copy of the model
  sharded over its workers, the nodes re-forming in place by columns (docs/sharded-in-place.md);
- `fsdp-groups`: the same example in place with the job's replica groups of GROUP_NODES nodes (one worker
  each), each one copy of the model sharded over its nodes: two groups, a fault to a node of the second,
  whose other node's worker ends and stands by while the first group trains on alone; or, at a join, one
  group joined by a second (its nodes started together), healed by column beside the first one's step;
- `trainer-inplace-fast`: the same with faster liveness (`FAST`), the counterpart of TorchFT's
  aggressive settings below, as long as it passes the false-alarm check;
- `etcd-v2`: stock torchrun, torch's etcd-v2 backend (etcd started with --enable-v2),
  torch's defaults;
- `etcd-v2-tuned`: the same with our heartbeat and last-call settings
  (keep_alive_interval=1, last_call_timeout=2), to separate tuning from design;
- `c10d`: stock torchrun, c10d backend, torch's defaults;
- `torchft`, `torchft-1s`, `torchft-0.5s`: TorchFT 0.2.0 with its defaults, a 1 s heartbeat
  timeout, and its tests' 0.5 s (torchft_peer.py), each step the toy's;
- `torchft-0.5s-trainer`, `torchft-1s-trainer`: its tests' settings and the 1 s ones, each step our
  trainer's (torchft_replica.py's `--work trainer`): the counterparts of `trainer-inplace*` (the 1 s
  ones for where the 0.5 s ones fail the false-alarm check, as they did once on 2026-11-27).

Usage: python bench/recovery/run.py [--reps 20] [--timeout 60] [--backends ...] [--scenarios ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.record
import torchft_peer  # type: ignore[import-not-found]  # a sibling, found through the path above

from bench import record as results
from torchspot_lab.etcd import EtcdServer, free_port
from torchspot_lab.local import (
    JobConfig,
    LocalNode,
    first_step_at,
    last_step_before,
    ranks_of_group,
    read_events,
    resumed_step_after,
    wait_for,
)
from torchspot_trainer import REPLICA_GROUP_ENV, REPLICA_GROUP_SIZE_ENV
from torchspot_trainer.rendezvous.settings import KEY_ROOT

BACKENDS = (
    "etcd-v3", "etcd-v3-inplace", "trainer-inplace", "trainer-inplace-fast", "ddp-inplace", "transformers-inplace",
    "fsdp-restart", "fsdp-restart-copies", "fsdp-inplace", "fsdp-groups", "etcd-v2", "etcd-v2-tuned", "c10d",
    *torchft_peer.SETTINGS,
)  # fmt: skip
OURS = (
    "etcd-v3", "etcd-v3-inplace", "trainer-inplace", "trainer-inplace-fast", "ddp-inplace", "transformers-inplace",
    "fsdp-restart", "fsdp-restart-copies", "fsdp-inplace", "fsdp-groups",
)  # fmt: skip
FAST = "liveness_interval=0.1,liveness_timeout=0.8"
"""`trainer-inplace-fast`'s liveness settings: puts every 0.1 s, a node lost after 0.8 s without one
(0.25 s after a local collective failed), where the defaults are 0.2 s and 1 s."""
TRAINER = [
    "-m", "torchspot_trainer", "--dataset", "digits", "--model", "small_cnn", "--data", "", "--epochs", "100000",
    "--global-batch-size", "48", "--workers", "0", "--log-every", "1", "--scheduled-events", "off", "--in-place",
]  # fmt: skip
"""`trainer-inplace`'s program (its --events-file is added per job)."""
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
API_PROGRAMS = {
    "ddp-inplace": EXAMPLES / "ddp" / "train.py",
    "transformers-inplace": EXAMPLES / "transformers" / "train.py",
    "fsdp-restart": EXAMPLES / "fsdp" / "train.py",
    "fsdp-restart-copies": EXAMPLES / "fsdp" / "train.py",
    "fsdp-inplace": EXAMPLES / "fsdp" / "train.py",
    "fsdp-groups": EXAMPLES / "fsdp" / "train.py",
}
"""The modes whose program is a user's script on the recovery API (its events go to the file
TORCHSPOT_EVENTS_FILE names)."""
FSDP_PER_NODE = 2
"""`fsdp-inplace`'s workers a node: the model sharded over them, the nodes' copies its replicas."""
GROUP_NODES = 2
"""`fsdp-groups`'s nodes a replica group, one worker each (the job's `replicaGroupSize`)."""
GROUP_SCENARIOS = ("join", "hard", "frozen", "notice")
"""What `fsdp-groups` measures: a second group's join, or a fault to a node of the second of two groups."""
CHECKPOINT_EVERY = 20
"""`fsdp-restart`'s steps between checkpoints (a second of the paced step): a restart after a lost node
resumes from the newest, so about half of them are trained again."""
SCENARIOS = ("join", "joinloss", "hard", "frozen", "notice", "falsealarm", "wipe", "wipefrozen", "wipejoin")
AFTER_WIPE = {"wipe": "hard", "wipefrozen": "frozen", "wipejoin": "join"}
"""The scenarios that wipe the job's etcd first, and the fault each then applies. Only for OURS: the
others keep no state to lose (TorchFT) or were not built to survive it (torch's backends)."""
JOINS = ("join", "joinloss")
"""The faults that start from 2 nodes and start a third."""
RESTORED_WAIT = 10.0
"""The most a `wipe` trial waits for the agents to write their round back before its fault: past it
the fault comes all the same (and finds the state empty, as before the agents restored it)."""
STEP_TIME = 0.05
"""Seconds of work per step, for every backend (the toy's default)."""
HOG_SECONDS = 10.0
PAUSES = 3
PAUSE_SECONDS = 0.5
"""The false-alarm check: busy loops on every core for HOG_SECONDS, and the victim stopped PAUSES
times for PAUSE_SECONDS meanwhile."""
JOIN_LOSS_WINDOW = (2.0, 3.0)
"""`joinloss`: seconds from the joiner's start to the kill, drawn uniformly. Here a joiner's agent has
joined the round by about 2 s and its worker is training about 4 s after its start (the `join`
rows of bench/results/recovery/): the kill lands while the others wait for it, not yet trained with it."""
NOTICE_GRACE = 30.0
"""Seconds between SIGTERM and SIGKILL at a notice (the kubelet's default grace)."""


@dataclass
class Trial:
    """One measured fault (or false-alarm check)."""

    backend: str
    scenario: str
    recovery_s: float | None
    steps_lost: int | None
    false_alarm: bool | None = None
    pause_s: float | None = None
    """At a join: the longest the nodes already training went without completing a step, from the
    joiner's start until the first step at the new size. On nodes that share cores this also counts
    steps slowed by the joiner's start-up (its imports and set-up take a core): a compute-bound step
    (the trainer's) shows it, a sleeping one (the toy's, TorchFT's here) does not."""
    switch_s: float | None = None
    """At a join: from the last step at the old size to the first at the new, the switch itself (the
    group's re-form, the joiner's state, one step at the new size)."""
    restarted: int | None = None
    """Survivors whose worker process is not the one they had before the fault (0 in place)."""
    rejoined_s: float | None = None
    """At `joinloss`: from the kill to the first step with the joiner (at world size 2), after the
    survivor's recovery: the joiner is not lost, only later."""
    lost_s: float | None = None
    """At a join: the others' training lost to it (`training_lost`), in seconds of their training."""


BASELINE_S = 2.0
"""`training_lost`'s reference: the steps of the BASELINE_S seconds before the joiner's start. A join
trial trains that long after its first 25 steps before the joiner starts, so the reference is that
many seconds of steady steps, not the job's first quarter-second."""


def fault_of(scenario: str) -> str:
    """The fault a scenario applies: its own name, or for a wipe scenario the one after the wipe."""
    return AFTER_WIPE.get(scenario, scenario)


def lead_in(scenario: str, rng: random.Random) -> float:
    """Seconds from a job's 25th step (or the restore after a wipe) to its fault: a random point of the
    step, after BASELINE_S more of steady steps at a join (`training_lost`'s reference)."""
    return (BASELINE_S if fault_of(scenario) == "join" else 0.0) + rng.uniform(0, STEP_TIME + 0.01)


def wipe_and_await_restore(etcd: EtcdServer, run_id: str) -> bool:
    """Restart `etcd` without its data, then wait until the job's agents wrote their round back (its
    state key is there again); whether they did within RESTORED_WAIT."""
    etcd.restart(wipe=True)
    client = etcd.client()
    try:
        state = f"{KEY_ROOT}/{run_id}/state"
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: client.get(state) is not None, RESTORED_WAIT, "the round written back")
            return True
        return False
    finally:
        client.close()


def training_lost(times: list[float], fault: float, recovered: float) -> float | None:
    """What a join cost the nodes already training, in seconds of their training: from `fault` (the
    joiner's start) to `recovered` (the first step at the new size), the time beyond what as many steps
    took them at the median pace of the BASELINE_S seconds before; None with fewer than 5 steps there.
    `times`: when one of them completed each step (every step a global batch, before the join and
    after). A pause at the switch counts, and so do steps slowed by the joiner's start-up on the cores
    they share: what the issue's "a join costs the others at most 0.5 s of training" asks. Pure."""
    before = sorted(t for t in times if fault - BASELINE_S <= t <= fault)
    if len(before) < 5:
        return None
    pace = statistics.median(b - a for a, b in itertools.pairwise(before))
    done = sum(1 for t in times if fault < t <= recovered)
    return recovered - fault - done * pace


def _job(workdir: Path, backend: str, etcd: EtcdServer, nnodes: str) -> JobConfig:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = {
        "workdir": workdir,
        "run_id": run_id,
        "nnodes": nnodes,
        "steps": 100_000,
        "step_time": STEP_TIME,
    }
    if backend == "etcd-v3":
        return JobConfig(backend="etcd-v3", endpoint=etcd.endpoint, launcher="torchspot", **common)
    if backend.startswith("trainer-inplace"):
        program = [*TRAINER, "--events-file", str(workdir / "events.jsonl")]
        return JobConfig(
            backend="etcd-v3", endpoint=etcd.endpoint, launcher="torchspot", program=program,
            rdzv_conf=FAST if backend == "trainer-inplace-fast" else "", **common,
        )  # fmt: skip
    if backend in API_PROGRAMS:
        program = [str(API_PROGRAMS[backend]), "--steps", "100000000", "--step-seconds", str(STEP_TIME)]
        env = {"TORCHSPOT_EVENTS_FILE": str(workdir / "events.jsonl")}
        if backend == "transformers-inplace":
            env["TORCHSPOT_FORK_PRELOAD"] = "transformers"
        if backend.startswith("fsdp-restart"):
            program += ["--log-every", "1000000", "--restart-path"]
            program += ["--peer-copy-every", "1"] if backend == "fsdp-restart-copies" else []
            env |= {"TORCHSPOT_CHECKPOINT_URI": str(workdir / "checkpoints"),
                    "TORCHSPOT_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY)}  # fmt: skip
        if backend == "fsdp-inplace":
            program += ["--log-every", "1000000", "--in-place"]
            common["nproc_per_node"] = FSDP_PER_NODE
        if backend == "fsdp-groups":
            program += ["--log-every", "1000000", "--in-place"]
            env[REPLICA_GROUP_SIZE_ENV] = str(GROUP_NODES)
        return JobConfig(
            backend="etcd-v3", endpoint=etcd.endpoint, launcher="torchspot", program=program, extra_env=env, **common
        )
    if backend == "etcd-v3-inplace":
        return JobConfig(
            backend="etcd-v3", endpoint=etcd.endpoint, launcher="torchspot", toy_args=["--in-place"], **common
        )
    if backend == "etcd-v2":
        return JobConfig(backend="etcd-v2", endpoint=etcd.endpoint, launcher="torchrun", **common)
    if backend == "etcd-v2-tuned":
        return JobConfig(
            backend="etcd-v2", endpoint=etcd.endpoint, launcher="torchrun",
            rdzv_conf="keep_alive_interval=1,last_call_timeout=2", **common,
        )  # fmt: skip
    return JobConfig(backend="c10d", endpoint=f"127.0.0.1:{free_port()}", launcher="torchrun", **common)


def manager_as_toy_events(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recovery API's records (elastic/manager.py; the trainer's too, its first user) in the toy's
    terms: each rank's `generation` record its `joined`, rank 0's also the group's `start`, and rank 0's
    `step` records the steps (every rank writes them). The group is the generation; on the restart path
    (`start` records, no generation: `fsdp-restart`) it is the processes' incarnation, named by rank 0's
    start (`restart_groups`). Pure."""
    found: list[dict[str, Any]] = []
    restarts = restart_groups(records)
    for record in sorted(records, key=lambda r: float(r.get("t", 0.0))):
        kind = record.get("event")
        if kind == "start" and "generation" not in record:
            group = restarts.of_start(record)
            found.append({"event": "joined", "t": record["t"], "rank": record["rank"], "world": record["world_size"],
                          "pid": record["pid"], "node": record["node"], "group": group})  # fmt: skip
            if record["rank"] == 0:
                found.append({"event": "start", "t": record["t"], "step": record["step"],
                              "world": record["world_size"], "group": group})  # fmt: skip
        elif kind == "step" and record["rank"] == 0 and "generation" not in record and restarts.starts:
            found.append({"event": "step", "t": record["t"], "step": record["step"], "world": record["world_size"],
                          "group": restarts.at(float(record["t"]))})  # fmt: skip
        elif kind == "generation":
            group = str(record["generation"])
            found.append({"event": "joined", "t": record["t"], "rank": record["rank"], "world": record["world_size"],
                          "pid": record["pid"], "node": record["node"], "group": group})  # fmt: skip
            if record["rank"] == 0:
                found.append({"event": "start", "t": record["t"], "step": record["step"],
                              "world": record["world_size"], "group": group})  # fmt: skip
        elif kind == "step" and record["rank"] == 0:
            found.append({"event": "step", "t": record["t"], "step": record["step"], "world": record["world_size"],
                          "group": str(record.get("generation", "?"))})  # fmt: skip
    return found


@dataclass
class RestartGroups:
    """The restart path's groups in a job's records: rank 0's `start` records in time order, each one a new
    incarnation of the processes (`restart-N`)."""

    starts: list[tuple[float, int, int]]
    """(time, step, world size) of each rank-0 start, in time order."""
    times: list[float]
    """Each start's time (`at` bisects them for every step record)."""

    def at(self, t: float) -> str:
        """The group rank 0 was in at time `t`: the newest start before it."""
        return f"restart-{max(0, bisect.bisect_right(self.times, t) - 1)}"

    def of_start(self, record: dict[str, Any]) -> str:
        """The group of any rank's start record: rank 0's start of the same step and world size nearest in
        time (every rank of an incarnation resumes the same step at the same size, within moments)."""
        same = [(abs(t - float(record["t"])), n) for n, (t, step, world) in enumerate(self.starts)
                if step == record["step"] and world == record["world_size"]]  # fmt: skip
        return f"restart-{min(same)[1]}" if same else "restart-?"


def restart_groups(records: list[dict[str, Any]]) -> RestartGroups:
    """The restart path's groups (`RestartGroups`) of a job's manager records. Pure."""
    starts = sorted(
        (float(r["t"]), int(r["step"]), int(r["world_size"]))
        for r in records
        if r.get("event") == "start" and "generation" not in r and r.get("rank") == 0
    )
    return RestartGroups(starts, [start[0] for start in starts])


def _read(job: JobConfig) -> list[dict[str, Any]]:
    """The job's events: the toy's, or those of a program on the recovery API (the trainer, the examples)
    in the toy's terms (`manager_as_toy_events`)."""
    records = read_events(job.events)
    if not job.program:
        return records
    events = manager_as_toy_events(records)
    per_copy = job.nproc_per_node * int(job.extra_env.get(REPLICA_GROUP_SIZE_ENV, "1"))  # (a group's: one unit)
    return events if per_copy == 1 else by_node(events, per_copy)


def by_node(events: list[dict[str, Any]], per_node: int) -> list[dict[str, Any]]:
    """A job of `per_node` workers a node in the toy's terms, where a node is a rank: its first worker's
    joins (ranked by its node), every world size counted in nodes. Pure."""
    found: list[dict[str, Any]] = []
    for event in events:
        seen = {**event, "world": event["world"] // per_node} if "world" in event else dict(event)
        if seen["event"] == "joined" and seen["rank"] % per_node:
            continue
        if seen["event"] == "joined":
            seen["rank"] //= per_node
        found.append(seen)
    return found


def _ranks(job: JobConfig, group: str) -> dict[int, str]:
    return ranks_of_group(_read(job), group)


def _pids(events: list[dict[str, Any]], group: str) -> dict[str, int]:
    """Node -> its worker's process id in one group, from the group's `joined` events."""
    return {e["node"]: e["pid"] for e in events if e["event"] == "joined" and e["group"] == group and "pid" in e}


def _highest_rank_node(job: JobConfig, group: str) -> str:
    ranks = _ranks(job, group)
    return ranks[max(ranks)]


def hog_and_pause(stop: Callable[[], None], go: Callable[[], None]) -> None:
    """The false-alarm check's load: busy loops on every core for HOG_SECONDS, during which the
    victim is stopped (`stop`) and resumed (`go`) PAUSES times, PAUSE_SECONDS each."""
    loop = f"import time\nend = time.monotonic() + {HOG_SECONDS}\nwhile time.monotonic() < end: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(os.cpu_count() or 2)]
    try:
        for _ in range(PAUSES):
            time.sleep((HOG_SECONDS - PAUSES * PAUSE_SECONDS) / (PAUSES + 1))
            stop()
            time.sleep(PAUSE_SECONDS)
            go()
        for hog in hogs:
            hog.wait(timeout=HOG_SECONDS * 3)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    time.sleep(2.0)  # a verdict formed under the load is acted on by now


def run_trial(
    workdir: Path, backend: str, scenario: str, etcd: EtcdServer, *, timeout: float, rng: random.Random
) -> Trial:
    """Start a job, apply one fault, and measure recovery and lost steps."""
    fault_kind = fault_of(scenario)
    nnodes = "2:3" if fault_kind == "join" else "1:3"  # joinloss: a survivor may train alone
    grouped = backend == "fsdp-groups"  # (two groups of GROUP_NODES nodes: a unit below is a group)
    job = _job(workdir, backend, etcd, f"2:{2 * GROUP_NODES}" if grouped else nnodes)
    initial = (1 if grouped else 2) if fault_kind in JOINS else (2 if grouped else 3)
    nodes = (
        [LocalNode(f"n{i}", _in_group(job, "ab"[i // GROUP_NODES])) for i in range(initial * GROUP_NODES)]
        if grouped
        else [LocalNode(f"n{i}", job) for i in range(initial)]
    )
    try:
        for node in nodes:
            node.start()
        formed = wait_for(
            lambda: first_step_at(_read(job), initial, 0),
            120,
            f"{backend}: world {initial}",
        )
        wait_for(lambda: len(_ranks(job, formed["group"])) == initial, 30, "all ranks to join")
        # Let it train past a checkpoint or two, as a real job would be mid-epoch.
        wait_for(
            lambda: last_step_before(_read(job), time.time()) >= formed["step"] + 25,
            60,
            "steps",
        )
        if scenario in AFTER_WIPE and not wipe_and_await_restore(etcd, job.run_id):
            print(f"  {backend}: the round was not written back within {RESTORED_WAIT:g} s of the wipe", flush=True)
        time.sleep(lead_in(scenario, rng))
        victim_name = _highest_rank_node(job, formed["group"])
        victim = next(n for n in nodes if n.name == victim_name)
        if scenario == "falsealarm":
            began = time.time()
            hog_and_pause(victim.freeze, victim.thaw)
            regrouped = any(e["event"] == "start" and e["t"] > began for e in _read(job))
            return Trial(backend, scenario, None, None, false_alarm=regrouped)
        groups: set[str] = set()  # joinloss: the groups that had stepped before the kill
        if fault_kind in JOINS:
            fault = time.time()
            extra = (
                [LocalNode(f"n{initial * GROUP_NODES + i}", _in_group(job, "b")) for i in range(GROUP_NODES)]
                if grouped
                else [LocalNode(f"n{initial}", job)]
            )
            nodes.extend(extra)
            for node in extra:
                node.start()
            target = initial + 1
            if fault_kind == "joinloss":
                time.sleep(rng.uniform(*JOIN_LOSS_WINDOW))
                groups = {e["group"] for e in _read(job) if e["event"] == "step"}
                fault = time.time()
                victim.kill()
        else:
            fault = time.time()
            if fault_kind == "hard":
                victim.kill()
            elif fault_kind == "frozen":
                victim.freeze()
            else:  # notice: the agent is told, as the kubelet tells it; its grace runs beside us
                threading.Thread(target=victim.terminate, args=(NOTICE_GRACE,), daemon=True).start()
            target = initial - 1
        try:
            recovered = wait_for(
                lambda: (
                    first_step_in_new_group(_read(job), fault, groups)
                    if scenario == "joinloss"
                    else first_step_at(_read(job), target, fault)
                ),
                timeout,
                "recovery",
            )
        except TimeoutError:
            return Trial(backend, scenario, None, None)
        rejoined = None
        if scenario == "joinloss":
            with contextlib.suppress(TimeoutError):
                rejoined = wait_for(lambda: first_step_at(_read(job), 2, recovered["t"]), timeout, "the joiner")
        events = _read(job)
        stepped = [e["t"] for e in events if e["event"] == "step"]  # rank 0's, an old node's at a join
        steps = [t for t in stepped if fault - 1.0 <= t <= recovered["t"]]
        pause = max((b - a for a, b in itertools.pairwise(steps)), default=None)
        switch = recovered["t"] - steps[-2] if len(steps) >= 2 else None
        resumed = resumed_step_after(events, fault)
        # Work redone: how far the old group got, minus where the new one resumed.
        reached = max(e["step"] for e in events if e["event"] == "step" and e["group"] == formed["group"])
        # In place a step can be committed by some ranks and not by the old rank 0, which logs: the new
        # generation then goes on from one step past rank 0's last line (healed, not redone): 0 lost.
        lost = None if resumed is None else max(0, reached - resumed)
        before, after = _pids(events, formed["group"]), _pids(events, recovered["group"])
        restarted = sum(1 for name, pid in before.items() if name in after and after[name] != pid)
        joined = fault_kind == "join"
        return Trial(
            backend, scenario, round(recovered["t"] - fault, 2), lost, pause_s=_rounded(pause),
            switch_s=_rounded(switch) if joined else None, restarted=restarted,
            rejoined_s=None if rejoined is None else round(rejoined["t"] - fault, 2),
            lost_s=_rounded(training_lost(stepped, fault, recovered["t"])) if joined else None,
        )  # fmt: skip
    finally:
        for node in nodes:
            node.stop()


def _in_group(job: JobConfig, name: str) -> JobConfig:
    """`job` as a node of replica group `name` runs it (`fsdp-groups`)."""
    return dataclasses.replace(job, extra_env={**job.extra_env, REPLICA_GROUP_ENV: name})


def first_step_in_new_group(events: list[dict[str, Any]], after: float, old: set[str]) -> dict[str, Any] | None:
    """The first step completed after `after` in a group none of `old` (those that had stepped by
    then): `joinloss`'s recovery, at whatever world size the survivors re-formed. Pure."""
    for event in events:
        if event["event"] == "step" and event["t"] > after and event["group"] not in old:
            return event
    return None


def run_torchft_trial(workdir: Path, backend: str, scenario: str, *, timeout: float, rng: random.Random) -> Trial:
    """The same fault to TorchFT's replica groups (torchft_peer.py), measured the same way."""
    initial = 2 if scenario in JOINS else 3
    cluster = torchft_peer.Cluster(workdir, backend, STEP_TIME)
    victim = initial - 1
    old: set[int] = set()  # joinloss: the quorums that had committed before the kill
    try:
        for replica in range(initial):
            cluster.start(replica)
        wait_for(lambda: torchft_peer.steady(read_events(cluster.events), initial, 25), 120,
                 f"{backend}: {initial} replicas committing")  # fmt: skip
        time.sleep(lead_in(scenario, rng))
        if scenario == "falsealarm":
            began = time.time()
            hog_and_pause(
                lambda: cluster.signal(victim, signal.SIGSTOP), lambda: cluster.signal(victim, signal.SIGCONT)
            )
            events = [e for e in read_events(cluster.events) if e["t"] > began and e["committed"]]
            return Trial(backend, scenario, None, None, false_alarm=any(e["participants"] < initial for e in events))
        fault = time.time()
        if scenario in JOINS:
            cluster.start(initial)
            target, skip = 3, initial
            if scenario == "joinloss":  # the survivor's first commit after the kill, in a new quorum
                time.sleep(rng.uniform(*JOIN_LOSS_WINDOW))
                old = torchft_peer.quorums(read_events(cluster.events))
                fault = time.time()
                cluster.signal(victim, signal.SIGKILL)
                target, skip = 0, victim
        else:
            sig = {"hard": signal.SIGKILL, "frozen": signal.SIGSTOP, "notice": signal.SIGTERM}[scenario]
            cluster.signal(victim, sig)
            target, skip = 2, victim
        try:
            recovered = wait_for(
                lambda: (
                    torchft_peer.first_commit_in_new_quorum(read_events(cluster.events), 0, fault, old)
                    if scenario == "joinloss"
                    else torchft_peer.first_commit_at(read_events(cluster.events), target, fault, skip)
                ),
                timeout,
                "recovery",
            )
        except TimeoutError:
            return Trial(backend, scenario, None, None)
        rejoined = None
        if scenario == "joinloss":
            with contextlib.suppress(TimeoutError):
                rejoined = wait_for(
                    lambda: torchft_peer.first_commit_at(read_events(cluster.events), 2, recovered["t"], victim),
                    timeout,
                    "the joiner",
                )
        events = read_events(cluster.events)
        lost = torchft_peer.failed_commits(events, fault, recovered["t"], skip)
        pause = torchft_peer.longest_pause(events, fault - 1.0, recovered["t"], skip)
        switch = torchft_peer.switch_gap(events, recovered)
        committed = [e["t"] for e in events if e["replica"] == recovered["replica"] and e["committed"]]  # an old one
        return Trial(
            backend, scenario, round(recovered["t"] - fault, 2), lost, pause_s=_rounded(pause),
            switch_s=_rounded(switch) if scenario == "join" else None,
            rejoined_s=None if rejoined is None else round(rejoined["t"] - fault, 2),
            lost_s=_rounded(training_lost(committed, fault, recovered["t"])) if scenario == "join" else None,
        )  # fmt: skip
    finally:
        cluster.close()


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest rank: with 20 trials, p95 is the 19th."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _fmt(trials: list[Trial], timeout: float) -> tuple[str, dict[str, float] | None]:
    if trials and trials[0].scenario == "falsealarm":
        dropped = sum(1 for t in trials if t.false_alarm)
        verdict = "passed" if dropped == 0 else "FAILED"
        return f"{verdict}: a node dropped in {dropped} of {len(trials)}", None
    times = [t.recovery_s for t in trials if t.recovery_s is not None]
    if not times:
        return f"no recovery within {timeout:g} s (0 of {len(trials)})", None
    # A trial without recovery counts as the timeout: the percentiles are then lower bounds.
    counted = times + [timeout] * (len(trials) - len(times))
    stats = {"p50": statistics.median(counted), "p95": percentile(counted, 95), "max": max(counted)}
    lost = [t.steps_lost for t in trials if t.steps_lost is not None]
    lost_text = f", steps lost median {statistics.median(lost):g} (max {max(lost)})" if lost else ""
    restarted = [t.restarted for t in trials if t.restarted is not None]
    if restarted:
        lost_text += f", survivors' processes restarted max {max(restarted)}"
    text = f"p50 {stats['p50']:.2f} s, p95 {stats['p95']:.2f} s, max {stats['max']:.2f} s over {len(trials)}"
    pauses = [t.pause_s for t in trials if t.pause_s is not None]
    if fault_of(trials[0].scenario) == "join" and pauses:
        stats["pause_max"] = max(pauses)
        text += f"; the others' longest pause p50 {statistics.median(pauses):.2f} s, max {max(pauses):.2f} s"
    costs = [t.lost_s for t in trials if t.lost_s is not None]
    if costs:
        stats["training_lost_p50"], stats["training_lost_max"] = statistics.median(costs), max(costs)
        text += f"; the others' training lost p50 {statistics.median(costs):.2f} s, max {max(costs):.2f} s"
    switches = [t.switch_s for t in trials if t.switch_s is not None]
    if switches:
        stats["switch_max"] = max(switches)
        text += f"; the switch p50 {statistics.median(switches):.2f} s, max {max(switches):.2f} s"
    rejoins = [t.rejoined_s for t in trials if t.rejoined_s is not None]
    if trials[0].scenario == "joinloss":
        stats["rejoined"] = len(rejoins)
        text += f"; the joiner training {len(rejoins)} of {len(trials)} times" + (
            f", p50 {statistics.median(rejoins):.2f} s after the kill, max {max(rejoins):.2f} s" if rejoins else ""
        )
    if len(times) < len(trials):
        text += f" ({len(trials) - len(times)} with no recovery within {timeout:g} s, counted as {timeout:g})"
        stats["failed"] = len(trials) - len(times)
    return text + lost_text, stats


def main() -> None:
    """Run every (backend, scenario) pair `--reps` times and print a comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="trials per backend and scenario")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before 'no recovery'")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--falsealarm-reps", type=int, default=1, help="false-alarm checks per backend (20 s each)")
    parser.add_argument("--seed", type=int, default=0, help="of the random point in the step each fault lands at")
    parser.add_argument(
        "--keep", type=Path, default=None, metavar="DIR",
        help="keep each trial's folder (its nodes' logs, its events) under DIR, to trace an odd trial; by "
        "default they go to a temporary folder that is removed",
    )  # fmt: skip
    parser.add_argument(
        "--results", type=Path, default=None,
        help="where the raw results go (a JSON file; default bench/results/recovery/DATE-COMMIT.json)",
    )  # fmt: skip
    args = parser.parse_args()
    recording = results.Run("recovery", args.results)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    rng = random.Random(args.seed)
    trials: list[Trial] = []
    with contextlib.ExitStack() as cleanup:
        root = args.keep or Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="torchspot-bench-")))
        root.mkdir(parents=True, exist_ok=True)
        with EtcdServer(root / "etcd", enable_v2=True) as etcd:
            for rep in range(args.reps):
                for scenario in args.scenarios:
                    if scenario == "falsealarm" and rep >= args.falsealarm_reps:
                        continue
                    for backend in args.backends:
                        if scenario in AFTER_WIPE and backend not in OURS:
                            continue
                        if backend == "fsdp-groups" and scenario not in GROUP_SCENARIOS:
                            continue
                        workdir = root / f"{backend}-{scenario}-{rep}"
                        if backend in torchft_peer.SETTINGS:
                            trial = run_torchft_trial(workdir, backend, scenario, timeout=args.timeout, rng=rng)
                        else:
                            trial = run_trial(workdir, backend, scenario, etcd, timeout=args.timeout, rng=rng)
                        trials.append(trial)
                        if scenario == "falsealarm":
                            shown = "a node dropped" if trial.false_alarm else "nobody dropped"
                        else:
                            shown = "none" if trial.recovery_s is None else f"{trial.recovery_s:.2f} s"
                            shown = f"recovery {shown}, steps lost {trial.steps_lost}, restarted {trial.restarted}"
                        kept = f" ({workdir})" if args.keep else ""
                        print(f"[{rep + 1}/{args.reps}] {scenario:10} {backend:14} {shown}{kept}", flush=True)

    say("\nRecovery: fault -> first step at the new world size (toy gloo step, 1 process per node)")
    summary: dict[str, dict[str, Any]] = {}
    for scenario in args.scenarios:
        say(f"\n{scenario}:")
        stats: dict[str, dict[str, float] | None] = {}
        for backend in args.backends:
            mine = [t for t in trials if t.backend == backend and t.scenario == scenario]
            if not mine:  # (a pair not run: a wipe for torch's backends, a join for fsdp-groups)
                continue
            text, stats[backend] = _fmt(mine, args.timeout)
            say(f"  {backend:14} {text}")
        others = {b: v for b, v in stats.items() if b not in OURS and v is not None}
        for mode in OURS:
            ours = stats.get(mode)
            if ours is not None and others:
                best = min(others, key=lambda b: others[b]["max"])
                bound = ">= " if "failed" in others[best] else ""
                say(f"  ratio of the maxima, {best} / {mode}: {bound}{others[best]['max'] / ours['max']:.2f}x")
            elif ours is not None and len(stats) > 1:
                say(f"  ratio ({mode}): no other backend recovered every trial within {args.timeout:g} s")
        summary[scenario] = stats
    recording.write([t.__dict__ for t in trials], figures=summary, summary=[line for line in lines if line.strip()])


if __name__ == "__main__":
    main()
