"""TorchFT (PyPI `torchft` 0.2.0) in bench/recovery's trials: a peer measured side by side, not quoted.

Replica groups of one process each (torchft_replica.py, the lab toy's step under TorchFT's Manager
with gloo) and its Lighthouse (the Rust server from the wheel, in the bench process), under three
settings:

- `torchft`: its defaults (heartbeat timeout 5 s, join timeout 60 s, gloo and Manager timeouts 60 s);
- `torchft-1s`: a 1 s heartbeat timeout (what TorchFT's issue #35 suggests for 100 ms beats), gloo and
  Manager timeouts 5 s (its DDP example's gloo timeout), join timeout 10 s (its README's advice);
- `torchft-0.5s`: the settings of TorchFT's own tests (500 ms heartbeat timeout, 2 s gloo timeout);
- `torchft-0.5s-trainer`: the same settings, each step our trainer's work in `trainer-inplace*` (the
  same small CNN on the same digits, the global batch of 48 shared by the participants) instead of
  the toy's 0.05 s sleep: the side-by-side of the trainer in place, where a step is compute that a
  joiner's start-up on the same cores slows, as it slows ours;
- `torchft-1s-trainer`: `torchft-1s`'s settings with our trainer's step: the next setting where the
  0.5 s ones fail the false-alarm check (the issue compares each system at its most aggressive
  settings that pass it).

A fault is measured as ours is: from the fault (or the joiner's start) until a survivor commits a
step with the new number of participants.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchspot_lab.local import SHARED_CORES_ENV

HERE = Path(__file__).resolve().parent
REPLICA = HERE / "torchft_replica.py"


@dataclass(frozen=True)
class Settings:
    """One way to run TorchFT (module docstring)."""

    heartbeat_timeout_ms: int | None
    join_timeout_ms: int | None
    gloo_timeout: float
    manager_timeout: float
    work: str = "sleep"
    """A step's work (torchft_replica.py's --work): the toy's sleep, or our trainer's step."""


SETTINGS = {
    "torchft": Settings(None, None, 60.0, 60.0),
    "torchft-1s": Settings(1000, 10_000, 5.0, 5.0),
    "torchft-0.5s": Settings(500, 10_000, 2.0, 2.0),
    "torchft-0.5s-trainer": Settings(500, 10_000, 2.0, 2.0, work="trainer"),
    "torchft-1s-trainer": Settings(1000, 10_000, 5.0, 5.0, work="trainer"),
}


class Cluster:
    """A Lighthouse and replica processes for one trial."""

    def __init__(self, workdir: Path, name: str, step_time: float) -> None:
        try:
            from torchft.coordination import LighthouseServer  # noqa: PLC0415 - installed by make bench-recovery only
        except ImportError:
            raise SystemExit("TorchFT is not installed: `make bench-recovery` installs it (torchft==0.2.0)") from None
        settings = SETTINGS[name]
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.events = workdir / "steps.jsonl"
        self.settings = settings
        self.step_time = step_time
        options: dict[str, int] = {"quorum_tick_ms": 100}
        if settings.heartbeat_timeout_ms is not None:
            options["heartbeat_timeout_ms"] = settings.heartbeat_timeout_ms
        if settings.join_timeout_ms is not None:
            options["join_timeout_ms"] = settings.join_timeout_ms
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, **options)
        self.replicas: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, replica: int) -> None:
        """Start replica group `replica` (a process of its own; its log beside the events)."""
        log = (self.workdir / f"replica-{replica}.log").open("ab")
        env = {**SHARED_CORES_ENV, **os.environ}  # as each of our nodes has (LocalNode)
        self.replicas[replica] = subprocess.Popen(
            [
                sys.executable, str(REPLICA),
                "--replica", str(replica),
                "--lighthouse", self.lighthouse.address(),
                "--events", str(self.events),
                "--step-time", str(self.step_time),
                "--work", self.settings.work,
                "--gloo-timeout", str(self.settings.gloo_timeout),
                "--manager-timeout", str(self.settings.manager_timeout),
            ],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        log.close()

    def signal(self, replica: int, sig: signal.Signals) -> None:
        os.killpg(self.replicas[replica].pid, sig)

    def close(self) -> None:
        for process in self.replicas.values():
            try:
                os.killpg(process.pid, signal.SIGCONT)
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        self.lighthouse.shutdown()


def steady(events: list[dict[str, Any]], replicas: int, steps: int) -> bool:
    """Whether every one of `replicas` has committed `steps` steps with all of them participating."""
    counts: dict[int, int] = {}
    for event in events:
        if event["committed"] and event["participants"] == replicas:
            counts[event["replica"]] = counts.get(event["replica"], 0) + 1
    return len(counts) >= replicas and min(counts.values()) >= steps


def first_commit_at(events: list[dict[str, Any]], participants: int, after: float, skip: int) -> dict[str, Any] | None:
    """The first step a replica other than `skip` committed with `participants` after `after`."""
    for event in sorted(events, key=lambda e: e["t"]):
        fresh = event["t"] > after and event["replica"] != skip
        if fresh and event["committed"] and event["participants"] == participants:
            return event
    return None


def first_commit_in_new_quorum(
    events: list[dict[str, Any]], replica: int, after: float, old: set[int]
) -> dict[str, Any] | None:
    """The first step `replica` committed after `after` in a quorum none of `old` (those that had
    committed by then), with however many participants: `joinloss`'s recovery. A replica commits
    on its own group's vote, so its step in flight at a kill may commit in the old quorum."""
    for event in sorted(events, key=lambda e: e["t"]):
        fresh = event["t"] > after and event["replica"] == replica and event["committed"]
        if fresh and event["quorum"] not in old:
            return event
    return None


def quorums(events: list[dict[str, Any]]) -> set[int]:
    """The quorums some replica committed a step in."""
    return {e["quorum"] for e in events if e["committed"]}


def failed_commits(events: list[dict[str, Any]], after: float, before: float, skip: int) -> int:
    """Steps the survivors did not commit between the fault and the recovery (work redone)."""
    survivors = [e for e in events if e["replica"] != skip and after < e["t"] <= before]
    per_replica: dict[int, int] = {}
    for event in survivors:
        per_replica[event["replica"]] = per_replica.get(event["replica"], 0) + (0 if event["committed"] else 1)
    return max(per_replica.values(), default=0)


def switch_gap(events: list[dict[str, Any]], recovered: dict[str, Any]) -> float | None:
    """From the recovered replica's last committed step before `recovered` (its first commit at the new
    size) to that commit: the switch itself, as `run.Trial.switch_s`."""
    before = [
        e["t"] for e in events if e["replica"] == recovered["replica"] and e["committed"] and e["t"] < recovered["t"]
    ]
    return recovered["t"] - max(before) if before else None


def longest_pause(events: list[dict[str, Any]], after: float, before: float, skip: int) -> float | None:
    """The longest a replica other than `skip` went between committed steps in [after, before]."""
    longest: float | None = None
    for replica in {e["replica"] for e in events if e["replica"] != skip}:
        times = sorted(
            e["t"] for e in events if e["replica"] == replica and e["committed"] and after <= e["t"] <= before
        )
        for a, b in itertools.pairwise(times):
            longest = b - a if longest is None else max(longest, b - a)
    return longest
