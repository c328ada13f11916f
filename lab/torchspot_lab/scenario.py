"""A spot market, scripted: the sandbox's node pools and what happens to them when.

A scenario file (YAML)::

    pools:
      onDemand: {nodes: 1}            # CPU nodes: the operator's etcds go here
      spot: {nodes: 3, gpus: 1}       # GPU spot nodes (AKS's label and taint)
    notReadyAfter: 8                  # a frozen node turns NotReady this many seconds later
    timeout: 300                      # stop the run (and fail) after this many seconds
    clock: submitted                  # or firstCheckpoint: when the events' `at` counts from
    events:
      - {at: 40, evict: spot-3, notice: true}    # SIGTERM, SIGKILL after the pod's grace period
      - {at: 90, evict: spot-2}                  # hard: everything SIGKILLed at once
      - {at: 120, freeze: spot-1}                # SIGSTOP; NotReady after notReadyAfter
      - {at: 130, addSpot: 2}                    # capacity returns: two new spot nodes
      - {at: 150, suspend: true}                 # the job's spec.suspend is set (as Kueue would)
      - {at: 170, suspend: false}                # and cleared again: the job resumes

Nodes are named `ondemand-<n>` and `spot-<n>`, numbered from 1 in the order they
appear (added spot nodes continue the count). `at` counts seconds from the moment
the job was submitted, or with `clock: firstCheckpoint` from the moment the job's
status first shows a committed checkpoint: a market that must strike a job that
trains (an eviction with notice that writes an emergency checkpoint, say) then does
so however long the cluster took to start it. `timeout` always counts from the
submission. Parsing is pure and reports every problem at once, each naming its
field, before anything starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ACTIONS = ("evict", "freeze", "addSpot", "suspend")
DEFAULT_TIMEOUT = 600.0
CLOCK_SUBMITTED = "submitted"
CLOCK_FIRST_CHECKPOINT = "firstCheckpoint"
CLOCKS = (CLOCK_SUBMITTED, CLOCK_FIRST_CHECKPOINT)


class ScenarioError(ValueError):
    """Every problem found in a scenario file, each naming its field."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Pool:
    """Identical nodes: how many at the start, and what each offers to pods."""

    nodes: int
    gpus: int = 0
    cpu: int = 64
    """Cores a node offers. Generous by default: on one machine the pods share the real cores anyway."""


@dataclass(frozen=True)
class Event:
    """One thing the market does at time `at` (seconds after the job is submitted)."""

    at: float
    action: str
    node: str = ""
    notice: bool = False
    count: int = 0
    suspend: bool = False
    """For a `suspend` event: the value spec.suspend is set to."""


@dataclass(frozen=True)
class Scenario:
    """Pools, the events in time order, and the clocks."""

    on_demand: Pool = field(default_factory=lambda: Pool(nodes=1))
    spot: Pool = field(default_factory=lambda: Pool(nodes=3, gpus=1))
    events: tuple[Event, ...] = ()
    not_ready_after: float = 8.0
    timeout: float = DEFAULT_TIMEOUT
    clock: str = CLOCK_SUBMITTED
    """What the events' `at` counts from: the submission, or the job's first committed checkpoint."""

    def initial_nodes(self) -> list[tuple[str, bool]]:
        """(name, is_spot) of the nodes present at the start."""
        on_demand = [(f"ondemand-{i}", False) for i in range(1, self.on_demand.nodes + 1)]
        return on_demand + [(f"spot-{i}", True) for i in range(1, self.spot.nodes + 1)]


def _number(value: Any, path: str, problems: list[str], *, low: float, default: float | None = None) -> float:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
        problems.append(f"{path}: must be a number >= {low:g}, not {value!r}")
        return low
    return float(value)


def _count(value: Any, path: str, problems: list[str], *, low: int, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        problems.append(f"{path}: must be a whole number >= {low}, not {value!r}")
        return low
    return value


def _pool(raw: Any, path: str, problems: list[str], default: Pool) -> Pool:
    if raw is None:
        return default
    if not isinstance(raw, Mapping):
        problems.append(f"{path}: must be a mapping with nodes, gpus, cpu")
        return default
    unknown = sorted(set(raw) - {"nodes", "gpus", "cpu"})
    if unknown:
        problems.append(f"{path}: unknown keys {', '.join(unknown)} (expected nodes, gpus, cpu)")
    return Pool(
        nodes=_count(raw.get("nodes"), f"{path}.nodes", problems, low=0, default=default.nodes),
        gpus=_count(raw.get("gpus"), f"{path}.gpus", problems, low=0, default=default.gpus),
        cpu=_count(raw.get("cpu"), f"{path}.cpu", problems, low=1, default=default.cpu),
    )


def _event(raw: Any, path: str, problems: list[str]) -> Event | None:
    if not isinstance(raw, Mapping):
        problems.append(f"{path}: must be a mapping such as {{at: 30, evict: spot-1, notice: true}}")
        return None
    actions = [a for a in ACTIONS if a in raw]
    if len(actions) != 1:
        problems.append(f"{path}: needs exactly one of {', '.join(ACTIONS)}")
        return None
    action = actions[0]
    allowed = {"at", action} | ({"notice"} if action == "evict" else set())
    unknown = sorted(set(raw) - allowed)
    if unknown:
        problems.append(f"{path}: unknown keys {', '.join(unknown)} for {action}")
    at = _number(raw.get("at"), f"{path}.at", problems, low=0)
    if action == "addSpot":
        return Event(at, action, count=_count(raw[action], f"{path}.addSpot", problems, low=1, default=1))
    if action == "suspend":
        if not isinstance(raw[action], bool):
            problems.append(f"{path}.suspend: must be true or false, not {raw[action]!r}")
        return Event(at, action, suspend=raw[action] is True)
    node = raw[action]
    if not isinstance(node, str) or not node:
        problems.append(f"{path}.{action}: must be a node name such as spot-1")
        return None
    notice = raw.get("notice", False)
    if not isinstance(notice, bool):
        problems.append(f"{path}.notice: must be true or false, not {notice!r}")
    return Event(at, action, node=node, notice=notice is True)


def _check_nodes(scenario: Scenario, problems: list[str]) -> None:
    """Each evicted or frozen node exists at that time and is still alive."""
    alive = {name for name, _ in scenario.initial_nodes()}
    spot_count = scenario.spot.nodes
    for index, event in sorted(enumerate(scenario.events), key=lambda pair: pair[1].at):
        if event.action == "addSpot":
            alive |= {f"spot-{spot_count + i}" for i in range(1, event.count + 1)}
            spot_count += event.count
        elif event.action == "suspend":
            continue
        elif event.node not in alive:
            known = ", ".join(sorted(alive)) or "none"
            problems.append(f"events[{index}].{event.action}: no node {event.node} at t={event.at:g} (alive: {known})")
        elif event.action == "evict":
            alive.discard(event.node)


def parse_scenario(raw: Any, source: str = "scenario") -> Scenario:
    """A checked Scenario from parsed YAML; raises `ScenarioError` listing every problem."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ScenarioError(source, ["the file must hold a mapping (pools, events, notReadyAfter, timeout, clock)"])
    problems: list[str] = []
    top = ("pools", "events", "notReadyAfter", "timeout", "clock")
    unknown = sorted(set(raw) - set(top))
    if unknown:
        problems.append(f"unknown keys {', '.join(unknown)} (expected {', '.join(top)})")
    clock = raw.get("clock", CLOCK_SUBMITTED)
    if clock not in CLOCKS:
        problems.append(f"clock: must be one of {', '.join(CLOCKS)}, not {clock!r}")
        clock = CLOCK_SUBMITTED
    pools = raw.get("pools") or {}
    if not isinstance(pools, Mapping):
        problems.append("pools: must be a mapping with onDemand and spot")
        pools = {}
    unknown = sorted(set(pools) - {"onDemand", "spot"})
    if unknown:
        problems.append(f"pools: unknown keys {', '.join(unknown)} (expected onDemand, spot)")
    defaults = Scenario()
    raw_events = raw.get("events") or []
    if not isinstance(raw_events, list):
        problems.append("events: must be a list")
        raw_events = []
    events = [_event(item, f"events[{i}]", problems) for i, item in enumerate(raw_events)]
    scenario = Scenario(
        on_demand=_pool(pools.get("onDemand"), "pools.onDemand", problems, defaults.on_demand),
        spot=_pool(pools.get("spot"), "pools.spot", problems, defaults.spot),
        events=tuple(e for e in events if e is not None),
        not_ready_after=_number(raw.get("notReadyAfter"), "notReadyAfter", problems, low=0, default=8.0),
        timeout=_number(raw.get("timeout"), "timeout", problems, low=1, default=DEFAULT_TIMEOUT),
        clock=clock,
    )
    if scenario.on_demand.nodes < 1:
        problems.append("pools.onDemand.nodes: at least 1 (the managed etcd and nothing else runs there)")
    if len(events) == len(scenario.events):  # node names are only worth checking once the events parse
        _check_nodes(scenario, problems)
    if problems:
        raise ScenarioError(source, problems)
    return dataclasses.replace(scenario, events=tuple(sorted(scenario.events, key=lambda e: e.at)))


def load_scenario(path: Path) -> Scenario:
    """Read and check a scenario file; a YAML syntax error is reported as a ScenarioError too."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(str(path), [f"cannot read: {exc.strerror}"]) from exc
    except yaml.YAMLError as exc:
        raise ScenarioError(str(path), [f"not YAML: {exc}"]) from exc
    return parse_scenario(raw, str(path))
