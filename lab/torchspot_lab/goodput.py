"""Goodput of a sandbox run on a spot market: what bench/goodput computes, as pure functions.

Progress is counted in samples (`trained_samples` of the trainer's start and progress
lines), which does not depend on the world size the way a step count does. Times are
seconds since the job was submitted.

- useful progress at time T: the position of the last line before T, where a group
  that resumed from an earlier position pulls it back (work done twice counts once);
- capacity: the spot nodes that exist and are not frozen, at most the job's maximum;
- expected progress: what an uninterrupted run makes of that capacity, the integral
  of `rates[k]` (samples per second measured on k nodes without interruptions) over
  the window, which starts when the run first trains (start-up costs the same with or
  without a market);
- goodput: useful progress / expected progress, over the same window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchspot_lab.scenario import Scenario


def capacity(scenario: Scenario, max_nodes: int) -> list[tuple[float, int]]:
    """(time, usable spot nodes) at each change, starting at 0: evicted and frozen nodes are unusable."""
    usable = scenario.spot.nodes
    points = [(0.0, min(usable, max_nodes))]
    for event in scenario.events:
        if event.action == "addSpot":
            usable += event.count
        elif event.node.startswith("spot-"):
            usable -= 1
        points.append((event.at, min(max(usable, 0), max_nodes)))
    return points


def expected_samples(
    points: Sequence[tuple[float, int]], rates: Mapping[int, float], start: float, end: float
) -> float:
    """Samples an uninterrupted run would train between `start` and `end` on the capacity `points`."""
    total = 0.0
    bounds = [*points[1:], (end, 0)]
    for (at, nodes), (until, _) in zip(points, bounds, strict=True):
        low, high = max(at, start), min(until, end)
        if high > low and nodes > 0:
            total += rates[nodes] * (high - low)
    return total


def _training(events: Sequence[Mapping[str, Any]], end: float) -> list[Mapping[str, Any]]:
    return [e for e in events if e["event"] in ("start", "progress") and e["t"] <= end and "trained_samples" in e]


def first_start(events: Sequence[Mapping[str, Any]]) -> float | None:
    """When the run first trained (its first start line), or None."""
    return next((float(e["t"]) for e in events if e["event"] == "start"), None)


def useful_samples(events: Sequence[Mapping[str, Any]], end: float) -> int:
    """The run's position at `end`: the last line's, a resumption pulling it back."""
    position = 0
    for event in _training(events, end):
        position = int(event["trained_samples"])
    return position


def rate(events: Sequence[Mapping[str, Any]], end: float) -> float:
    """Samples per second of an uninterrupted run, from its first start line to its last line before `end`."""
    lines = _training(events, end)
    began = first_start(lines)
    if began is None or len(lines) < 2:
        return 0.0
    last = lines[-1]
    return float(last["trained_samples"]) / max(float(last["t"]) - began, 1e-9)


@dataclass(frozen=True)
class Resumption:
    """A worker group that started from a checkpoint after another trained."""

    t: float
    world_size: int
    resumed_from: int
    lost_samples: int
    lost_steps: float
    """Lost samples in steps of the group that lost them (batch x its world size)."""


def resumptions(events: Sequence[Mapping[str, Any]], end: float, batch: int) -> list[Resumption]:
    """Each resumption with the work it redid: how far the group before it got beyond its starting point."""
    found: list[Resumption] = []
    newest, world = 0, 1
    started = False
    for event in _training(events, end):
        position = int(event["trained_samples"])
        if event["event"] == "start":
            if started:
                lost = max(newest - position, 0)
                found.append(
                    Resumption(float(event["t"]), int(event["world_size"]), position, lost, lost / (batch * world))
                )
            started, newest, world = True, position, int(event["world_size"])
        else:
            newest, world = max(newest, position), int(event["world_size"])
    return found


def recoveries(
    scenario: Scenario, events: Sequence[Mapping[str, Any]], end: float
) -> list[tuple[float, str, float | None]]:
    """For each market event: (time, what, seconds until a worker group started after it trained), None if none did."""
    lines = _training(events, end)
    result: list[tuple[float, str, float | None]] = []
    for event in scenario.events:
        what = f"add {event.count}" if event.action == "addSpot" else f"{event.action} {event.node}"
        if event.action == "evict":
            what += " (notice)" if event.notice else " (no notice)"
        trained = None
        after_start = False
        for line in lines:
            if line["t"] <= event.at:
                continue
            if line["event"] == "start":
                after_start = True
            elif after_start:
                trained = float(line["t"]) - event.at
                break
        result.append((event.at, what, trained))
    return result


def progress_curve(events: Sequence[Mapping[str, Any]], end: float) -> list[tuple[float, int]]:
    """(time, position) of every start and progress line up to `end`, for the plot."""
    return [(float(e["t"]), int(e["trained_samples"])) for e in _training(events, end)]


def expected_curve(
    points: Sequence[tuple[float, int]], rates: Mapping[int, float], start: float, end: float, step: float = 1.0
) -> list[tuple[float, float]]:
    """The uninterrupted run's position over time (for the plot), sampled every `step` seconds."""
    times = [start + i * step for i in range(int(max(end - start, 0.0) / step) + 1)]
    return [(t, expected_samples(points, rates, start, t)) for t in times]
