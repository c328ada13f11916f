"""A manager's records: what the sandbox's report, the operator's progress and the user's log read.

One JSON line per record, stamped with its time: on stdout (rank 0's, or any rank's where the record is
about that rank) and in the events file (every rank's, TORCHSPOT_EVENTS_FILE), appended with one write
each so that ranks sharing a file never interleave a line. A step's record goes to the file only: one
per rank and step would drown a log. Rank 0 adds a progress record every PROGRESS_SECONDS: the step,
the world size and the samples per second since its last record or the group's start.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchspot_trainer.elastic.settings import PROGRESS_SECONDS

__all__ = ["Records", "write_record"]


def write_record(
    record: dict[str, Any],
    *,
    events: Path | None,
    stdout: bool,
    readable: Callable[[dict[str, Any]], str | None] | None = None,
) -> None:
    """One record as a JSON line, stamped with the time now unless it has its own (a record written again
    keeps the time its step completed): appended to `events` (one O_APPEND write, so that processes
    sharing the file never interleave a line) and, with `stdout`, printed, and, given `readable`,
    mirrored on a terminal's stderr as it writes the record (None: as the JSON line). The manager's
    records and the trainer's (events.py) are written here."""
    stamped = {"t": time.time(), **record}
    line = json.dumps(stamped)
    if stdout:
        print(line, flush=True)
        if readable is not None and sys.stderr.isatty():
            print(readable(stamped) or f"[torchspot] {line}", file=sys.stderr, flush=True)
    if events is not None:
        with events.open("a") as out:
            out.write(line + "\n")


class Records:
    """One worker's record output.

    :param events: the events file, or None: records on stdout only (a step's, none).
    """

    def __init__(self, events: Path | None) -> None:
        self.events = events
        self._window = (time.monotonic(), 0)
        """Since rank 0's last progress record: (when, samples)."""

    def emit(self, record: dict[str, Any], *, rank: int, any_rank: bool = False, quiet: bool = False) -> None:
        """One record: on stdout (rank 0's, or any rank's with `any_rank`) unless `quiet`, and in the
        events file."""
        if quiet and self.events is None:
            return
        write_record(record, events=self.events, stdout=not quiet and (any_rank or rank == 0))

    def step(self, step: int, *, rank: int, world: int, generation: int | None, samples: list[int] | None,
             skipped: bool) -> None:  # fmt: skip
        """A committed step's record (the events file only): in place its generation, the global
        indices of its samples where a sampler dealt them, and whether its update was skipped."""
        record: dict[str, Any] = {"event": "step", "step": step, "world_size": world, "rank": rank}
        if generation is not None:
            record["generation"] = generation
        if samples is not None:
            record["samples"] = samples
        if skipped:
            record["update_skipped"] = True
        self.emit(record, rank=rank, quiet=True)

    def started(self, record: dict[str, Any], *, rank: int) -> None:
        """A group's start record; the progress window begins again."""
        self.emit({"event": "start", **record}, rank=rank)
        self._window = (time.monotonic(), 0)

    def progress(self, samples: int, *, step: int, world: int) -> None:
        """Rank 0's step of `samples`: a progress record where PROGRESS_SECONDS have passed since the last."""
        began, counted = self._window
        now, counted = time.monotonic(), counted + samples
        if now - began < PROGRESS_SECONDS:
            self._window = (began, counted)
            return
        self._window = (now, 0)
        self.emit({"event": "progress", "step": step, "world_size": world,
                   "samples_per_s": round(counted / (now - began), 2)}, rank=0)  # fmt: skip
