"""Recovery benchmark: our etcd-v3 rendezvous against torch's stock backends, in one run.

For each backend and scenario, a local job of real agents and gloo workers (the
lab's toy program) trains; we apply the fault to a whole process tree and measure

- recovery: seconds from the fault (or the joiner's start) to the first completed
  training step at the new world size;
- steps lost: the last step completed before the fault minus the step the new
  group resumed from (work that has to be redone).

Scenarios: `join` (2 nodes, a third arrives), `hard` (3 nodes, one SIGKILLed with
its workers), `frozen` (3 nodes, one SIGSTOPped with its workers). The victim is the
node that holds the highest rank, so the surviving rank 0 keeps logging, and the
c10d store (hosted by the first agent) survives: the comparison is about noticing
the fault, not about that single point of failure.

Backends:
- `etcd-v3`: torchspot-run with our backend and its defaults;
- `etcd-v2`: stock torchrun, torch's etcd-v2 backend (etcd started with --enable-v2),
  torch's defaults;
- `etcd-v2-tuned`: the same with our heartbeat and last-call settings
  (keep_alive_interval=1, last_call_timeout=2), to separate tuning from design;
- `c10d`: stock torchrun, c10d backend, torch's defaults.

Usage: python bench/recovery/run.py [--reps 3] [--timeout 60] [--backends ...] [--scenarios ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

BACKENDS = ("etcd-v3", "etcd-v2", "etcd-v2-tuned", "c10d")
SCENARIOS = ("join", "hard", "frozen")
RESULTS = Path(__file__).resolve().parents[1] / "results" / "recovery.json"


@dataclass
class Trial:
    """One measured fault."""

    backend: str
    scenario: str
    recovery_s: float | None
    steps_lost: int | None


def _job(workdir: Path, backend: str, etcd: EtcdServer, nnodes: str) -> JobConfig:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = {
        "workdir": workdir,
        "run_id": run_id,
        "nnodes": nnodes,
        "steps": 100_000,
    }
    if backend == "etcd-v3":
        return JobConfig(backend="etcd-v3", endpoint=etcd.endpoint, launcher="torchspot", **common)
    if backend == "etcd-v2":
        return JobConfig(backend="etcd-v2", endpoint=etcd.endpoint, launcher="torchrun", **common)
    if backend == "etcd-v2-tuned":
        return JobConfig(
            backend="etcd-v2", endpoint=etcd.endpoint, launcher="torchrun",
            rdzv_conf="keep_alive_interval=1,last_call_timeout=2", **common,
        )  # fmt: skip
    return JobConfig(backend="c10d", endpoint=f"127.0.0.1:{free_port()}", launcher="torchrun", **common)


def _ranks(job: JobConfig, group: str) -> dict[int, str]:
    return ranks_of_group(read_events(job.events), group)


def _highest_rank_node(job: JobConfig, group: str) -> str:
    ranks = _ranks(job, group)
    return ranks[max(ranks)]


def run_trial(workdir: Path, backend: str, scenario: str, etcd: EtcdServer, timeout: float) -> Trial:
    """Start a job, apply one fault, and measure recovery and lost steps."""
    nnodes = "2:3" if scenario == "join" else "1:3"
    job = _job(workdir, backend, etcd, nnodes)
    initial = 2 if scenario == "join" else 3
    nodes = [LocalNode(f"n{i}", job) for i in range(initial)]
    try:
        for node in nodes:
            node.start()
        formed = wait_for(
            lambda: first_step_at(read_events(job.events), initial, 0),
            120,
            f"{backend}: world {initial}",
        )
        wait_for(lambda: len(_ranks(job, formed["group"])) == initial, 30, "all ranks to join")
        # Let it train past a checkpoint or two, as a real job would be mid-epoch.
        wait_for(
            lambda: last_step_before(read_events(job.events), time.time()) >= formed["step"] + 25,
            60,
            "steps",
        )

        if scenario == "join":
            fault = time.time()
            extra = LocalNode(f"n{initial}", job)
            nodes.append(extra)
            extra.start()
            target = 3
        else:
            victim_name = _highest_rank_node(job, formed["group"])
            victim = next(n for n in nodes if n.name == victim_name)
            fault = time.time()
            if scenario == "hard":
                victim.kill()
            else:
                victim.freeze()
            target = 2
        try:
            recovered = wait_for(lambda: first_step_at(read_events(job.events), target, fault), timeout, "recovery")
        except TimeoutError:
            return Trial(backend, scenario, None, None)
        events = read_events(job.events)
        resumed = resumed_step_after(events, fault)
        # Work redone: how far the old group got, minus where the new one resumed.
        reached = max(e["step"] for e in events if e["event"] == "step" and e["group"] == formed["group"])
        lost = None if resumed is None else reached - resumed
        return Trial(backend, scenario, round(recovered["t"] - fault, 2), lost)
    finally:
        for node in nodes:
            node.stop()


def _fmt(trials: list[Trial], timeout: float) -> tuple[str, float | None]:
    times = [t.recovery_s for t in trials if t.recovery_s is not None]
    if len(times) < len(trials):
        failed = len(trials) - len(times)
        return f"no recovery within {timeout:g} s ({failed}/{len(trials)})", None
    median = statistics.median(times)
    lost = [t.steps_lost for t in trials if t.steps_lost is not None]
    lost_text = f", steps lost median {statistics.median(lost):g}" if lost else ""
    return f"median {median:.1f} s (min {min(times):.1f}, max {max(times):.1f}){lost_text}", median


def main() -> None:
    """Run every (backend, scenario) pair `--reps` times and print a comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="trials per backend and scenario")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before 'no recovery'")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    args = parser.parse_args()

    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="torchspot-bench-") as tmp:
        root = Path(tmp)
        with EtcdServer(root / "etcd", enable_v2=True) as etcd:
            for rep in range(args.reps):
                for scenario in args.scenarios:
                    for backend in args.backends:
                        trial = run_trial(
                            root / f"{backend}-{scenario}-{rep}",
                            backend,
                            scenario,
                            etcd,
                            args.timeout,
                        )
                        trials.append(trial)
                        shown = "none" if trial.recovery_s is None else f"{trial.recovery_s:.1f} s"
                        print(
                            f"[{rep + 1}/{args.reps}] {scenario:6} {backend:14} "
                            f"recovery {shown}, steps lost {trial.steps_lost}",
                            flush=True,
                        )

    print("\nRecovery: fault -> first step at the new world size (toy gloo job, 1 process per node)")
    summary: dict[str, dict[str, Any]] = {}
    for scenario in args.scenarios:
        print(f"\n{scenario}:")
        medians: dict[str, float | None] = {}
        for backend in args.backends:
            mine = [t for t in trials if t.backend == backend and t.scenario == scenario]
            text, medians[backend] = _fmt(mine, args.timeout)
            print(f"  {backend:14} {text}")
        ours = medians.get("etcd-v3")
        stock = [m for b, m in medians.items() if b != "etcd-v3" and m is not None]
        if ours is not None:
            if stock:
                print(f"  ratio: best stock / etcd-v3 = {min(stock) / ours:.1f}x")
            elif len(medians) > 1:
                print(f"  ratio: no stock backend recovered within {args.timeout:g} s (> {args.timeout / ours:.1f}x)")
        summary[scenario] = {"medians_s": medians}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"trials": [t.__dict__ for t in trials], "summary": summary}, indent=2))
    print(f"\nraw results: {RESULTS}")


if __name__ == "__main__":
    main()
