"""A manager's records: what the sandbox's report, the operator's progress and the user's log read.

One JSON line per record, stamped with its time: on stdout (rank 0's, or any rank's where the record is
about that rank) and in the events file (every rank's, TORCHSPOT_EVENTS_FILE), appended with one write
each so that ranks sharing a file never interleave a line. A step's record goes to the file only: one
per rank and step would drown a log. Rank 0 adds a progress record every PROGRESS_SECONDS: the step,
the world size and the samples per second since its last record or the group's start (unless the loop
writes its own). Rank 0 also reports each step and each committed checkpoint to the operator, through
the job's etcd (rendezvous/milestones.py): a duty that follows rank 0 from group to group.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchspot_trainer.checkpoint.manager import SaveReport, step_dir
from torchspot_trainer.data.sampler import ElasticSampler as Position
from torchspot_trainer.elastic.metrics import WorkerMetrics
from torchspot_trainer.elastic.settings import PROGRESS_SECONDS, node_name
from torchspot_trainer.rendezvous.milestones import CheckpointReporter

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
    :param checkpoints: where the checkpoints go (the operator's milestones name a checkpoint's folder).
    :param progress: whether rank 0 writes progress records (False: the loop writes its own).
    :param metrics: the worker's Prometheus figures (metrics.py), where they are served.
    """

    def __init__(
        self, events: Path | None, *, checkpoints: str = "", progress: bool = True, metrics: WorkerMetrics | None = None
    ) -> None:
        self.events = events
        self.metrics = metrics
        self._checkpoints, self._progress = checkpoints, progress
        self._window = (time.monotonic(), 0)
        """Since rank 0's last progress record: (when, samples)."""
        self._reporter: CheckpointReporter | None = None

    def rank_is(self, rank: int) -> None:
        """This worker's rank in the group it entered: the operator's milestones are rank 0's."""
        if rank == 0 and self._reporter is None:
            self._reporter = CheckpointReporter.from_environment()
        elif rank != 0 and self._reporter is not None:
            self._reporter.close()
            self._reporter = None

    def checkpoint(self, report: SaveReport, *, rank: int) -> None:
        """A save's outcome; a committed one reported to the operator (rank 0's)."""
        self.emit({"event": "checkpoint", "step": report.step, "ok": report.ok, "seconds": round(report.seconds, 3),
                   "error": report.error, "saver": report.saver}, rank=rank)  # fmt: skip
        if report.ok and self.metrics is not None:
            self.metrics.checkpointed(report.step)
        if report.ok and self._reporter is not None:
            self._reporter.report(report.step, f"{self._checkpoints.rstrip('/')}/{step_dir(report.step)}")

    def close(self) -> None:
        """The operator's milestones stop."""
        self.rank_is(-1)

    def emit(self, record: dict[str, Any], *, rank: int, any_rank: bool = False, quiet: bool = False) -> None:
        """One record: on stdout (rank 0's, or any rank's with `any_rank`) unless `quiet`, and in the
        events file."""
        if quiet and self.events is None:
            return
        write_record(record, events=self.events, stdout=not quiet and (any_rank or rank == 0))

    def step(self, step: int, *, rank: int, world: int, generation: int | None, samples: list[int] | None,
             skipped: bool, trained: int, seconds: float) -> None:  # fmt: skip
        """A committed step's record (the events file only): in place its generation, the global
        indices of its samples where a sampler dealt them, and whether its update was skipped; rank 0's
        report of it to the operator, and its progress record where one is due (`trained`: the step's
        samples; `seconds`: from its start to its commit)."""
        if self.metrics is not None:
            self.metrics.stepped(step, world=world, seconds=seconds, samples=trained)
        if self._reporter is not None:
            self._reporter.report_step(step)
        if rank == 0 and self._progress:
            self._progress_of(trained, step=step, world=world)
        record: dict[str, Any] = {"event": "step", "step": step, "world_size": world, "rank": rank}
        if generation is not None:
            record["generation"] = generation
        if samples is not None:
            record["samples"] = samples
        if skipped:
            record["update_skipped"] = True
        self.emit(record, rank=rank, quiet=True)

    def started(self, *, step: int, world: int, rank: int, resumed_from: str, generation: int | None,
                position: Position | None) -> None:  # fmt: skip
        """A group's start record (every rank's in the events file, rank 0's on stdout: the sandbox's report
        counts the groups and the path each took from them): in place its generation (no process was
        restarted), and where a sampler deals the data its epoch, the samples trained so far and a step's
        (`position`: the first sampler's). The progress window begins again."""
        record: dict[str, Any] = {"event": "start", "step": step, "world_size": world, "rank": rank,
                                  "pid": os.getpid(), "node": node_name(), "resumed_from": resumed_from}  # fmt: skip
        if generation is not None:
            record["generation"] = generation
        if position is not None:
            record.update(
                epoch=position.epoch, trained_samples=position.trained, step_samples=position.step_size(world)
            )
        self.emit(record, rank=rank)
        self._window = (time.monotonic(), 0)
        if self.metrics is not None:
            self.metrics.entered(step=step, world=world)

    def _progress_of(self, samples: int, *, step: int, world: int) -> None:
        """Rank 0's step of `samples`: a progress record where PROGRESS_SECONDS have passed since the last."""
        began, counted = self._window
        now, counted = time.monotonic(), counted + samples
        if now - began < PROGRESS_SECONDS:
            self._window = (began, counted)
            return
        self._window = (now, 0)
        self.emit({"event": "progress", "step": step, "world_size": world,
                   "samples_per_s": round(counted / (now - began), 2)}, rank=0)  # fmt: skip
