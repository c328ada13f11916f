"""What the trainer reports as it trains: progress records and their lines, the sums a record is made
from, and the counts read back from a run's records. Pure but `process_age` (it reads /proc)."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Progress",
    "Window",
    "format_progress",
    "process_age",
    "record_means",
    "stopwatch",
    "whole_records",
]


def format_progress(record: dict[str, Any]) -> str:
    """The human-readable progress line shown on a terminal. Pure."""
    ckpt = record["checkpoint_step"]
    line = (
        f"step {record['step']:>7} epoch {record['epoch']:>3} world {record['world_size']} "
        f"loss {record['loss']:.4f} acc {record['accuracy']:.3f} {record['samples_per_s']:.0f} samples/s "
        f"lr {record['lr']:.4g} batch {record['step_samples']} ckpt {ckpt if ckpt is not None else '-'}"
    )
    if record["checkpoint_error"]:
        line += f" CHECKPOINT FAILING: {record['checkpoint_error']}"
    return line


def whole_records(events: Iterable[Mapping[str, Any]]) -> Counter[int]:
    """How many times each step was applied in the run's surviving line, from its whole progress records
    (not `partial`): in place a record of a generation whose writer is not in the later generation that
    recorded the step again is that lost writer's (a double fault: rank 0 completed the step alone, wrote
    its record and was lost; the survivors, which never applied it, trained it again), not a second
    application. The members of each generation are its ranks' `generation` events. Pure."""
    events = list(events)
    members: dict[int, set[str]] = {}
    for event in events:
        if event.get("event") == "generation":
            members.setdefault(int(event["generation"]), set()).add(str(event.get("node")))
    whole = [e for e in events if e.get("event") == "progress" and not e.get("partial")]
    by_step: dict[int, list[Mapping[str, Any]]] = {}
    for event in whole:
        by_step.setdefault(int(event["step"]), []).append(event)

    def lost(record: Mapping[str, Any]) -> bool:
        generation = record.get("generation")
        return generation is not None and any(
            int(other.get("generation", -1)) > generation
            and int(other["generation"]) in members  # (unknown without the generation events: not lost)
            and str(record.get("node")) not in members[int(other["generation"])]
            for other in by_step[int(record["step"])]
        )

    return Counter(step for step, records in by_step.items() for record in records if not lost(record))


@dataclass
class Progress:
    """One progress record (a JSON line on stdout)."""

    step: int
    epoch: int
    world_size: int
    loss: float
    """Mean loss over every sample of the steps since the last record, the whole group's."""
    accuracy: float
    samples_per_s: float
    lr: float
    checkpoint_step: int | None
    checkpoint_error: str | None
    trained_samples: int = 0
    """Samples the run has trained on so far, all epochs counted (redone work not counted
    twice): the measure of progress that does not depend on the world size."""
    step_samples: int = 0
    """Samples a full optimizer step averages over (the global batch)."""
    partial: bool = False
    """The group broke after the step was applied and before its loss and accuracy were summed, so they
    are this rank's share only (the step itself counts: the group goes on after it). Such a record comes
    from every rank this happened to (with its `rank`): a reader takes one per step."""


def process_age() -> float:
    """Seconds since this process started (Linux; 0.0 elsewhere): the interpreter's and imports' share."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0.0
    return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def stopwatch(clock: dict[str, float]) -> Callable[[str], None]:
    """A stopwatch that adds, under each name it is called with, the time since its previous call (a
    name called twice sums its two parts: a re-form that enters a second round counts both)."""
    last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        clock[name], last = clock.get(name, 0.0) + now - last, now

    return lap


@dataclass
class Window:
    """Sums over the steps since the last progress record (this rank's share; on the device,
    read only when the record is made)."""

    device: torch.device
    started: float = field(default_factory=time.perf_counter)
    loss: torch.Tensor = field(init=False)
    correct: torch.Tensor = field(init=False)
    samples: int = 0
    """The steps' samples, every rank's (its rate)."""
    computed: int = 0
    """The samples this rank ran forward: those its `loss` and `correct` sum over."""

    def __post_init__(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.correct = torch.zeros((), dtype=torch.long, device=self.device)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, samples: int, computed: int) -> None:
        self.loss += loss
        self.correct += correct
        self.samples += samples
        self.computed += computed

    def sums(
        self, loss: torch.Tensor | None = None, correct: torch.Tensor | None = None, computed: int = 0
    ) -> list[torch.Tensor]:
        """What the group sums for a record: the window's loss, correct predictions and samples computed,
        with a step not added yet (its `loss`, `correct`, `computed`) counted in."""
        extra = torch.zeros((), device=self.device)
        return [
            self.loss + (extra if loss is None else loss),
            self.correct + (extra.long() if correct is None else correct),
            torch.tensor(float(self.computed + computed), dtype=torch.float64, device=self.device),
        ]


def record_means(loss: float, correct: float, computed: float) -> tuple[float, float]:
    """A progress record's mean loss and accuracy from the group's sums. Pure. The denominator is the
    samples the summed losses came from, summed alike: the step samples of the receiving rank's own
    window were not, where a heal's receiver that sorts first (rank 0) sat a step out with a one-step
    window while its trainers' windows spanned the record's steps (its accuracy could exceed 1)."""
    samples = max(computed, 1.0)
    return loss / samples, correct / samples
