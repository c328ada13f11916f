"""A soak of recovery in place: random kills, freezes, thaws and joins, then the same model as a run without them.

    .venv/bin/python bench/soak/run.py [--events 200] [--seed 0] [--actions kill,freeze,join]
        [--out FILE (default: bench/results/soak/DATE-COMMIT.json)]

The project's trainer with `--in-place` (tests/trainer/test_training.py's configuration: digits,
small_cnn, 48 samples per step whatever the world size) on the lab's local nodes: real
`torchspot-run` agents, real workers, Azurite for the checkpoints, and an etcd started with the
managed etcd's flags (`ETCD_SIZING`, as the operator starts it). Up to MAX_NODES nodes train; the
soak draws one fault at a time, each a random number of seconds after the last one (GAP_SECONDS)
and after at least one step since it:

- `kill`: SIGKILL of a node's whole tree (a VM gone);
- `freeze`: SIGSTOP of a node's tree (a hung VM; sockets stay open), detected by liveness;
- `thaw`: SIGCONT of a frozen node, which finds its round gone and comes back as a joiner would;
- `join`: a new node (capacity returning), while fewer than MAX_NODES + 1 are started.

Node n0 is never killed or frozen: its agent and worker live through every generation, so their
memory is the one to watch. A kill or a freeze needs two nodes that run, so that some node
always trains. Then the frozen nodes are thawed, the run trains on to its first checkpoint at least
SETTLE_STEPS after the last fault (step S) and is stopped there, and the same configuration runs
again to step S with nothing happening (`--max-steps`), on each of 1 to MAX_NODES nodes: the largest
difference between two of them is the part of a difference that is float32's reduction order over this
many steps (one pair's figure alone varies widely between soaks). The models are compared at S, and
the per-step losses against the faults (`divergence`). `--actions` draws some kinds of fault only (to
find which adds a difference).

Measured: the seconds from each fault to the next completed step; steps redone (a step logged
twice: at most the one in flight per kill or freeze); whether every step was trained once and
the final model equals the undisturbed run's (against the reduction order's difference); the resident
memory of n0's processes through the soak; the etcd's backend, data folder and memory against
its quota and the pod's limits.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import record as results  # noqa: E402
from tests.trainer.test_training import LOSS_TOLERANCE, SAME_MODEL, TOLERANCE  # noqa: E402
from torchspot_lab.azurite import Azurite  # noqa: E402
from torchspot_lab.etcd import EtcdServer  # noqa: E402
from torchspot_lab.local import JobConfig, LocalNode, read_events, wait_for  # noqa: E402
from torchspot_operator.builders import ETCD_DATA_LIMIT, ETCD_MEMORY, ETCD_SIZING  # noqa: E402
from torchspot_trainer.checkpoint.manager import CheckpointConfig, CheckpointManager  # noqa: E402
from torchspot_trainer.checkpoint.storage import open_storage  # noqa: E402
from torchspot_trainer.fork_server import SERVER_NAME  # noqa: E402
from torchspot_trainer.progress import whole_records  # noqa: E402

MAX_NODES = 3
"""The job's --nnodes maximum; one more node may be started (it waits for a place)."""
STEPS_PER_EPOCH = 29
"""digits' 1,347 training samples at 48 a step."""
GAP_SECONDS = (1.0, 4.0)
"""Seconds between two faults, drawn uniformly. They were steps (8-40) until 2026-11-27: once steps
took 10-20 ms in place, faults came 143 a minute, a joiner never finished its start-up (7-10 s)
before the next fault, and 200 faults formed only 10 generations."""
STEPS_PER_SECOND = 100
"""More steps a second than the soak's run trains here (about 40-60), for the run's epochs
(`epochs_for`): the run is stopped at a checkpoint after the last fault, not at its end."""
SETTLE_STEPS = 50
"""Steps after the last fault (the frozen nodes thawed) before the checkpoint the models are compared at."""
CHECKPOINT_EVERY = 50
STALL_SECONDS = 120.0
"""No step for this long after a fault: the soak stops and says so (a failure)."""
SAMPLE_SECONDS = 5.0
"""How often memory and etcd are sampled."""
ACTIONS = ("kill", "freeze", "thaw", "join")
JUMP_WINDOW = 5
"""Steps after a fault in which a loss difference that jumps counts as the fault's (`divergence`)."""
JUMP_LEAST = 1e-4
"""A per-step loss difference below this is float32's noise at any step (the median is about 1e-6)."""
PROGRAM = ["-m", "torchspot_trainer", *SAME_MODEL, "--checkpoint-every", str(CHECKPOINT_EVERY)]
"""The equivalence test's configuration; the epochs follow from the number of faults."""


def allowed(running: int, frozen: int, started: int, kinds: frozenset[str] = frozenset(ACTIONS)) -> list[str]:
    """The actions of `kinds` the soak may draw (pure): faults only while another node trains (n0 is
    never one of them), a thaw only of a frozen node, a join only below MAX_NODES + 1 started nodes.
    `running` counts the nodes that run, n0 included; `frozen` those stopped; `started` both."""
    actions = []
    if running >= 2:
        actions += ["kill", "freeze"]
    if frozen:
        actions.append("thaw")
    if started < MAX_NODES + 1:
        actions.append("join")
    return [action for action in actions if action in kinds]


def fault_kinds(text: str) -> frozenset[str]:
    """`--actions`' comma-separated kinds (pure). A join is always among them (without one the nodes
    run out: the soak would stall), and a freeze brings its thaw."""
    kinds = {kind.strip() for kind in text.split(",") if kind.strip()}
    unknown = kinds - set(ACTIONS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown action {sorted(unknown)[0]!r}: choose from {', '.join(ACTIONS)}")
    if not kinds & {"kill", "freeze"}:
        raise argparse.ArgumentTypeError("no fault among them: name kill or freeze (or both)")
    kinds.add("join")
    if "freeze" in kinds:
        kinds.add("thaw")
    return frozenset(kinds)


def divergence(
    ours: dict[int, float], theirs: dict[int, float], faults: list[Fault], *, window: int = JUMP_WINDOW
) -> dict[str, Any]:
    """Where the per-step loss of a run (`ours`) leaves the undisturbed run's (`theirs`), against the
    faults (pure). Float32's reduction order grows a difference slowly, over many steps; a step that
    trained on a wrong state or samples shows as a jump: the difference in the `window` steps from a step
    ten times its largest in the 4 * `window` steps before it, and over JUMP_LEAST. The share of the
    steps right after a fault (its step, by the records the soak read) that jump, against the share of
    all steps, says whether the faults add to the drift; `onset` is the first step whose difference
    passes JUMP_LEAST."""
    steps = sorted(set(ours) & set(theirs))
    gap = {s: abs(ours[s] - theirs[s]) for s in steps}
    index = {s: i for i, s in enumerate(steps)}

    def jumps(at: int) -> bool:
        i = index[at]
        before = max((gap[s] for s in steps[max(0, i - 4 * window) : i]), default=0.0)
        after = max(gap[s] for s in steps[i : i + window])
        return after > JUMP_LEAST and after > 10 * before

    at_faults = sorted({f.step + 1 for f in faults if f.step + 1 in index})
    jumped = [s for s in at_faults if jumps(s)]
    everywhere = sum(jumps(s) for s in steps)
    return {
        "onset": next((s for s in steps if gap[s] > JUMP_LEAST), None),
        "fault_steps": len(at_faults),
        "jumps_after_faults": jumped,
        "jump_share_after_faults": round(len(jumped) / len(at_faults), 4) if at_faults else None,
        "jump_share_all_steps": round(everywhere / len(steps), 4) if steps else None,
    }


def epochs_for(events: int) -> int:
    """Epochs enough for `events` faults at their longest gap and STEPS_PER_SECOND, with room after
    the last (pure). The run never gets there: it is stopped at a checkpoint after the last fault,
    and the undisturbed runs stop at the same step; the epochs only set the learning-rate schedule,
    the same for all three."""
    steps = events * GAP_SECONDS[1] * STEPS_PER_SECOND + 10 * STEPS_PER_EPOCH
    return int(steps // STEPS_PER_EPOCH) + 1


def comparison_step(last_fault_step: int) -> int:
    """The first checkpoint step at least SETTLE_STEPS after the last fault's (pure)."""
    step = last_fault_step + SETTLE_STEPS
    return -(-step // CHECKPOINT_EVERY) * CHECKPOINT_EVERY


@dataclass
class Fault:
    """One drawn action: when, on which node, at which step."""

    action: str
    node: str
    t: float
    step: int
    recovered_s: float | None = None
    """Seconds to the next completed step (for every action: a join or a thaw may pause the others)."""


@dataclass
class Watch:
    """Samples taken on a thread while the soak runs: n0's processes' memory and the etcd's sizes."""

    etcd: EtcdServer
    anchor: LocalNode
    samples: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        etcd = psutil.Process(self.etcd.pid)
        while not self.stop.wait(SAMPLE_SECONDS):
            sample: dict[str, Any] = {"t": time.time(), "etcd_rss_mib": etcd.memory_info().rss / 2**20}
            sample.update(_etcd_sizes(self.etcd))
            sample["n0"] = _tree_rss(self.anchor.pid)
            self.samples.append(sample)


def _tree_rss(pid: int) -> dict[str, float]:
    """Resident MiB of an agent and each of its descendants, by "<role> <pid>": the agent, its fork
    server (a fork of the agent named SERVER_NAME, or Python's own forkserver), the workers forked from
    it, and the others (the checkpoint saver, multiprocessing's resource tracker)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    servers = set()
    found = {}
    for proc in procs:
        try:
            parent, cmdline, rss = proc.ppid(), " ".join(proc.cmdline()), proc.memory_info().rss / 2**20
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        if proc.pid == pid:
            role = "agent"
        elif parent == pid and (name == SERVER_NAME.decode() or "forkserver" in cmdline):
            role = "fork-server"
            servers.add(proc.pid)
        elif parent in servers:
            role = "worker"
        else:
            role = "other"
        found[f"{role} {proc.pid}"] = rss
    return found


def _etcd_sizes(etcd: EtcdServer) -> dict[str, float]:
    metrics = etcd.gauges(("etcd_mvcc_db_total_size_in_bytes", "etcd_server_quota_backend_bytes"))
    data = sum(p.stat().st_size for p in etcd.data_dir.rglob("*") if p.is_file())
    return {
        "db_mib": metrics["etcd_mvcc_db_total_size_in_bytes"] / 2**20,
        "quota_mib": metrics["etcd_server_quota_backend_bytes"] / 2**20,
        "data_dir_mib": data / 2**20,
    }


def _alarms(etcd: EtcdServer) -> list[Any]:
    """etcd's raised alarms (NOSPACE when the backend passed its quota), through its JSON gateway."""
    request = urllib.request.Request(
        f"http://{etcd.endpoint}/v3/maintenance/alarm", data=json.dumps({"action": "GET"}).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        alarms: list[Any] = json.loads(answer.read()).get("alarms", [])
    return alarms


class Newest:
    """The newest step and world size the run logged, read from where the last look stopped: the
    event file grows to thousands of lines, and the soak looks at it 20 times a second."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.step = 0
        self.world = 0
        self.checkpoints: set[int] = set()

    def __call__(self) -> int:
        if self.path.exists():
            with self.path.open("rb") as file:
                file.seek(self.offset)
                chunk = file.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next look
            self.offset += len(complete)
            for line in complete.splitlines():
                if b'"progress"' in line:
                    record = json.loads(line)
                    self.step, self.world = max(self.step, record["step"]), record["world_size"]
                elif b'"checkpoint"' in line:
                    record = json.loads(line)
                    if record.get("ok"):
                        self.checkpoints.add(record["step"])
        return self.step

    def reached(self, step: int) -> bool:
        return self() >= step

    def checkpoint_from(self, step: int) -> int | None:
        """The first committed checkpoint (its event in the file) of `step` or later, if any yet."""
        self()
        return min((done for done in self.checkpoints if done >= step), default=None)


def _job(
    root: Path, etcd: EtcdServer, blob: Azurite, name: str, *, nnodes: str, epochs: int, extra: tuple[str, ...] = ()
) -> JobConfig:
    workdir = root / name
    return JobConfig(
        workdir=workdir, backend="etcd-v3", endpoint=etcd.endpoint, run_id=f"soak-{name}", nnodes=nnodes,
        extra_env=blob.env(), max_restarts=1000,
        program=[*PROGRAM, "--epochs", str(epochs), "--checkpoint-uri", f"az://ckpt/soak-{name}",
                 "--events-file", str(workdir / "train-events.jsonl"), *extra],
    )  # fmt: skip


def soak(
    root: Path, etcd: EtcdServer, blob: Azurite, events: int, rng: random.Random, *, kinds: frozenset[str]
) -> dict[str, Any]:
    """The faults (of `kinds`), the watch, and what the soak's run logged."""
    job = _job(root, etcd, blob, "soak", nnodes=f"1:{MAX_NODES}", epochs=epochs_for(events), extra=("--in-place",))
    events_file = job.workdir / "train-events.jsonl"
    newest = Newest(events_file)
    nodes: dict[str, LocalNode] = {}
    frozen: set[str] = set()
    count = 0

    def start() -> LocalNode:
        nonlocal count
        node = LocalNode(f"n{count}", job)
        count += 1
        node.start()
        nodes[node.name] = node
        return node

    anchor = start()
    for _ in range(MAX_NODES - 1):
        start()
    wait_for(lambda: newest() and newest.world == MAX_NODES, 180, "the first steps at full size", interval=0.5)
    watch = Watch(etcd, anchor)
    watcher = threading.Thread(target=watch.run, name="soak-watch", daemon=True)
    watcher.start()
    faults: list[Fault] = []
    began = time.monotonic()
    try:
        last = time.monotonic()
        for index in range(events):
            target = newest() + 1 if not faults else faults[-1].step + 1
            due = last + rng.uniform(*GAP_SECONDS)
            try:
                wait_for(functools.partial(newest.reached, target), STALL_SECONDS, f"step {target}")
                time.sleep(max(0.0, due - time.monotonic()))  # the gap is the point here: a time, not a condition
            except TimeoutError:
                if anchor.poll() is not None:
                    raise SystemExit(f"the run ended (n0: exit {anchor.poll()}) before fault {index + 1}") from None
                tails = "\n".join(f"--- {n.name}\n{n.log_tail(30)}" for n in nodes.values() if n.poll() is None)
                raise SystemExit(f"stalled before fault {index + 1} (last: {faults[-1:]}):\n{tails}") from None
            for name, node in list(nodes.items()):  # a node whose agent ended (a thawed one may) is gone
                if node.poll() is not None and name not in frozen:
                    del nodes[name]
            running = [n for n in nodes if n not in frozen]
            action = rng.choice(allowed(len(running), len(frozen), len(nodes), kinds))
            if action == "join":
                name = start().name
            elif action == "thaw":
                name = rng.choice(sorted(frozen))
                frozen.discard(name)
                nodes[name].thaw()
            else:
                name = rng.choice([n for n in running if n != anchor.name])
                if action == "kill":
                    nodes.pop(name).kill()
                else:
                    nodes[name].freeze()
                    frozen.add(name)
            faults.append(Fault(action, name, time.time(), newest()))
            last = time.monotonic()
            if (index + 1) % 10 == 0:
                rate = (index + 1) / (time.monotonic() - began)
                print(f"  {index + 1}/{events} faults ({rate * 60:.0f} a minute), step {faults[-1].step}, "
                      f"nodes {sorted(nodes)}, frozen {sorted(frozen)}", flush=True)  # fmt: skip
        for name in sorted(frozen):
            nodes[name].thaw()
        frozen.clear()
        due = comparison_step(newest())
        print(f"  faults done; training to the checkpoint of step {due}", flush=True)
        try:
            compared = wait_for(functools.partial(newest.checkpoint_from, due), STALL_SECONDS, f"checkpoint {due}+")
        except TimeoutError:
            tails = "\n".join(f"--- {n.name}\n{n.log_tail(30)}" for n in nodes.values() if n.poll() is None)
            raise SystemExit(f"no checkpoint from step {due}:\n{tails}") from None
    finally:
        watch.stop.set()
        watcher.join()
        for node in nodes.values():
            node.stop()
    alarms = _alarms(etcd)
    events_read = read_events(events_file)
    return {"faults": faults, "samples": watch.samples, "events": events_read, "alarms": alarms, "step": compared}


def undisturbed(
    root: Path, etcd: EtcdServer, blob: Azurite, events: int, *, nodes: int, step: int
) -> list[dict[str, Any]]:
    """The same configuration on `nodes` nodes with nothing happening (no --in-place: nothing to
    re-form), to `step`."""
    job = _job(root, etcd, blob, f"fixed-{nodes}", nnodes=f"{nodes}:{nodes}", epochs=epochs_for(events),
               extra=("--max-steps", str(step)))  # fmt: skip
    group = [LocalNode(f"f{nodes}-{index}", job) for index in range(nodes)]
    for node in group:
        node.start()
    for node in group:
        if node.wait(1800) != 0:
            raise SystemExit(f"the undisturbed run on {nodes} ended with {node.poll()}:\n{node.log_tail(40)}")
    return read_events(job.workdir / "train-events.jsonl")


def _model(blob: Azurite, name: str, step: int) -> dict[str, torch.Tensor]:
    loaded = CheckpointManager(open_storage(f"az://ckpt/soak-{name}", blob.env()), CheckpointConfig()).load_step(step)
    assert loaded is not None, (name, step)
    return {key: tensor.double() for key, tensor in loaded.state["user"]["model"].items()}  # (the trainer's part)


def _mib(text: str) -> float:
    """Kubernetes' quantity with a Mi suffix, in MiB."""
    assert text.endswith("Mi"), text
    return float(text[:-2])


def _losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """Each step's loss from its whole progress record (one rank's share, where the group broke before its
    sums, is left out)."""
    return {e["step"]: e["loss"] for e in records if e.get("event") == "progress" and not e.get("partial")}


def report(run: dict[str, Any], fixed: dict[int, list[dict[str, Any]]], blob: Azurite) -> dict[str, Any]:
    """The figures (module docstring), printed and returned. `fixed`: the undisturbed runs' records by their
    number of nodes (1 to MAX_NODES). The largest parameter difference between any two of them is float32's
    reduction order's share of a difference over this many steps (the equivalence test's TOLERANCE was set
    for 232): the soak's against the one on 1 node is compared with it."""
    faults: list[Fault] = run["faults"]
    compared: int = run["step"]
    progress = [e for e in run["events"] if e.get("event") == "progress" and e["step"] <= compared]
    for fault in faults:
        after = [e["t"] for e in progress if e["t"] > fault.t]
        fault.recovered_s = round(after[0] - fault.t, 3) if after else None
    by_action: dict[str, Any] = {}
    for action in ACTIONS:
        seconds = [f.recovered_s for f in faults if f.action == action and f.recovered_s is not None]
        if seconds:
            by_action[action] = {"count": len(seconds), "p50": round(statistics.median(seconds), 2),
                                 "max": round(max(seconds), 2)}  # fmt: skip
    generations = [e for e in run["events"] if e.get("event") == "generation"]  # who was in each (whole_records)
    steps = whole_records([*generations, *progress])  # partial: one from each rank it hit
    fixed_losses = _losses(fixed[1])  # (an undisturbed run's records are all whole)
    losses = {e["step"]: e["loss"] for e in progress if e.get("partial")}
    losses.update({e["step"]: e["loss"] for e in progress if not e.get("partial")})  # a whole record first
    partial = {e["step"] for e in progress if e.get("partial")} - set(steps)  # no whole record: a share only
    same_steps = sorted(losses) == sorted(fixed_losses)
    worst_loss = max(abs(losses[s] - fixed_losses[s]) for s in fixed_losses if s not in partial) if same_steps else None
    models = {name: _model(blob, name, compared) for name in ("soak", *(f"fixed-{n}" for n in sorted(fixed)))}

    def apart(a: str, b: str) -> float:
        return max(float((models[a][k] - models[b][k]).abs().max()) for k in models[b])

    difference = apart("soak", "fixed-1")
    against = {n: apart("soak", f"fixed-{n}") for n in sorted(fixed)}
    pairs = {f"{a}-{b}": apart(f"fixed-{a}", f"fixed-{b}") for a in sorted(fixed) for b in sorted(fixed) if a < b}
    floor = max(pairs.values())
    drift = {"soak": divergence(_losses(progress), fixed_losses, faults)}
    drift.update({f"fixed-{n}": divergence(_losses(fixed[n]), fixed_losses, faults) for n in sorted(fixed) if n != 1})
    samples = run["samples"]
    n0: dict[str, list[float]] = {}
    for sample in samples:
        for pid, rss in sample["n0"].items():
            n0.setdefault(pid, []).append(rss)
    third = max(1, len(samples) // 3)
    growth = {pid: round(max(rss[-third:]) - max(rss[:third]), 1) for pid, rss in n0.items() if len(rss) >= 3 * third}
    peak_etcd = max(s["etcd_rss_mib"] + s["data_dir_mib"] for s in samples)
    result: dict[str, Any] = {
        "faults": len(faults),
        "by_action": by_action,
        "steps": max(steps),
        "redone": sum(n - 1 for n in steps.values()),
        "partial_records": len(partial),
        "plan_mismatches": sum(e.get("event") == "plan_mismatch" for e in run["events"]),
        "kills_and_freezes": sum(f.action in ("kill", "freeze") for f in faults),
        "same_steps_as_undisturbed": same_steps,
        "parameter_difference": difference,
        "parameter_difference_by_nodes": against,
        "reduction_order_difference": floor,
        "reduction_order_pairs": pairs,
        "loss_divergence": drift,
        "loss_difference": worst_loss,
        "generations": len({e.get("generation") for e in run["events"] if e.get("event") == "start"}),
        "n0_pids": len({e["pid"] for e in run["events"] if e.get("event") == "generation" and e["node"] == "n0"}),
        "n0_rss_mib": {
            pid: {"first": round(rss[0], 1), "max": round(max(rss), 1), "last": round(rss[-1], 1)}
            for pid, rss in n0.items()
        },
        "n0_growth_mib": growth,
        "etcd": {
            "db_mib_max": round(max(s["db_mib"] for s in samples), 2),
            "quota_mib": samples[-1]["quota_mib"],
            "data_dir_mib_max": round(max(s["data_dir_mib"] for s in samples), 1),
            "data_dir_limit_mib": _mib(ETCD_DATA_LIMIT),
            "rss_mib_max": round(max(s["etcd_rss_mib"] for s in samples), 1),
            "rss_plus_data_mib_max": round(peak_etcd, 1),
            "memory_limit_mib": _mib(ETCD_MEMORY["limits"]["memory"]),
            "alarms": run["alarms"],
        },
        "fault_log": [vars(f) for f in faults],
    }
    print(f"\n{len(faults)} faults over {result['steps']} steps, {result['generations']} generations:")
    for action, figures in by_action.items():
        p50, most = figures["p50"], figures["max"]
        print(f"  {action:7} x{figures['count']:3}: the next step after p50 {p50:.2f} s, max {most:.2f} s")
    print(f"steps whose planned samples were not the sampler's (planned again): {result['plan_mismatches']}")
    print(f"steps redone: {result['redone']} (kills and freezes: {result['kills_and_freezes']}); progress records "
          f"with one rank's share of the loss (the group broke before its sums): {len(partial)}")  # fmt: skip
    print(f"against the undisturbed run on one node: same steps {same_steps}, largest parameter difference "
          f"{difference:.3g} (the undisturbed runs between them, at most: {floor:.3g} {pairs}; the soak against "
          f"each: {against}; the equivalence test allows "
          f"{TOLERANCE:g} over 232 steps), largest loss difference "
          f"{worst_loss if worst_loss is None else f'{worst_loss:.3g}'} (allowed {LOSS_TOLERANCE:g})")  # fmt: skip
    print(f"n0's worker processes over the soak: {result['n0_pids']}; memory growth, last third's peak against "
          f"the first third's (MiB): {growth}")  # fmt: skip
    for name, seen in drift.items():
        print(f"loss against the undisturbed run on one node, {name}: first past {JUMP_LEAST:g} at step "
              f"{seen['onset']}; a jump in the {JUMP_WINDOW} steps after {len(seen['jumps_after_faults'])} of "
              f"{seen['fault_steps']} faults ({seen['jump_share_after_faults']}), at any step "
              f"{seen['jump_share_all_steps']}")  # fmt: skip
    etcd = result["etcd"]
    print(
        f"etcd: backend max {etcd['db_mib_max']} MiB of a {etcd['quota_mib']:.0f} MiB quota, data folder max "
        f"{etcd['data_dir_mib_max']} MiB of {etcd['data_dir_limit_mib']:.0f}, memory and data max "
        f"{etcd['rss_plus_data_mib_max']} MiB of {etcd['memory_limit_mib']:.0f}, alarms {etcd['alarms']}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200, help="faults to draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--actions",
        type=fault_kinds,
        default=frozenset(ACTIONS),
        help="the fault kinds to draw, comma-separated (a join always; a freeze brings its thaw)",
    )
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/soak/DATE-COMMIT.json")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run's folders here")
    args = parser.parse_args()
    recording = results.Run("soak", args.out)
    with tempfile.TemporaryDirectory(prefix="torchspot-soak-") as tmp:
        root = args.keep or Path(tmp)
        with EtcdServer(root / "etcd", extra_flags=ETCD_SIZING) as etcd, Azurite(root / "azurite") as blob:
            print(f"soak: {args.events} faults, seed {args.seed}, {epochs_for(args.events)} epochs", flush=True)
            started = time.monotonic()
            run = soak(root, etcd, blob, args.events, random.Random(args.seed), kinds=args.actions)
            fixed = {}
            for nodes in range(1, MAX_NODES + 1):
                print(f"  {time.monotonic() - started:.0f} s; the undisturbed run on {nodes} node(s) to step "
                      f"{run['step']}...", flush=True)  # fmt: skip
                fixed[nodes] = undisturbed(root, etcd, blob, args.events, nodes=nodes, step=run["step"])
            with recording.captured():
                result = report(run, fixed, blob)
    result["args"] = {k: ",".join(sorted(v)) if isinstance(v, frozenset) else str(v) for k, v in vars(args).items()}
    faults = result.pop("fault_log", [])
    recording.write(faults, figures=result)


if __name__ == "__main__":
    main()
