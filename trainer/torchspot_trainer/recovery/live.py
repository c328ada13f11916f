"""A worker's process group rebuilt in place at a membership change: the group mechanics of recovery
without a restart (issue 28, item 3). Built and tested on CPU with gloo; the trainer does not use it
yet (README, "Recovery, in place").

At a membership change the agent forms the new round and hands the live workers an `Assignment`
(the round, their new rank and world, the round's store); each worker drops its group, builds the
next one on the new store, and the ranks agree on the newest committed step before they go on. What
experiments with gloo showed, and how this module answers each:

- **An abandoned collective completes when a frozen peer thaws, and writes into whatever buffer it
  was given.** Every collective here runs on a *staging copy* of the caller's tensor and copies the
  result back only if it completed in time: a zombie writes into a copy nobody reads.
- **Neither `abort()` nor `shutdown()` cancels a gloo collective blocked on a frozen peer**, so the
  calling thread never blocks in one: it polls the work's completion against a deadline and the
  `broken` event (set by whoever learns of a new assignment), and reports failure as a flag
  (`Outcome`), never by hanging.
- **An old group's destructor blocks for its op timeout** (about 10 s with a 10 s timeout) while a
  zombie op is pending: old groups go to a *graveyard* that holds them, never freed on the training
  thread; at most `GRAVEYARD` of them, after which the worker must take the restart path.
- **One TCPStore client serialises every thread that shares it**: each generation has a client of
  its own, used only by the thread that builds the group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore  # what torch.distributed re-exports

log = logging.getLogger(__name__)

POLL_SECONDS = 0.001
"""Between looks at a collective's completion: a gloo all-reduce of a toy's gradient takes about
a millisecond here, and a look costs microseconds."""
GRAVEYARD = 8
"""Old groups held at most (each keeps its staging buffers until its zombie op ends); beyond it a
worker takes the restart path instead of another re-form."""


class Outcome(Enum):
    """How a collective ended: errors are flags, so a failed step is skipped, not raised through."""

    DONE = "done"
    FAILED = "failed"
    """A peer's socket closed (gloo raised) or the op timed out: the group is gone."""
    BROKEN = "broken"
    """The caller's `broken` event was set (a new assignment) or its deadline passed."""


@dataclass(frozen=True)
class Assignment:
    """What the agent hands its live workers at a membership change (one per round)."""

    generation: int
    """The rendezvous round: every group and store key of the round is named by it."""
    rank: int
    world: int
    store_host: str
    store_port: int
    """The round's store, started by its rank-0 agent before the round was published."""


class LiveGroup:
    """The current generation's gloo group, its re-forms, and its graveyard (module docstring).

    :param op_timeout: gloo's own timeout for an op: how long a zombie op lives (and so a grave).
    """

    def __init__(self, op_timeout: timedelta = timedelta(seconds=30)) -> None:
        self.op_timeout = op_timeout
        self.assignment: Assignment | None = None
        self.broken = threading.Event()
        self._group: Any = None
        self._store: Any = None
        self._graveyard: list[tuple[Any, Any, list[torch.Tensor]]] = []
        self._staging: list[torch.Tensor] = []

    @property
    def rank(self) -> int:
        return self._require().rank

    @property
    def world(self) -> int:
        return self._require().world

    def reconfigure(self, assignment: Assignment) -> None:
        """Leave the current group for `assignment`'s: the old one goes to the graveyard, the new one
        is built on the round's store under `generation/<g>/` (a key of an older round is never read).
        Raises RuntimeError when the graveyard is full (the caller takes the restart path)."""
        if len(self._graveyard) >= GRAVEYARD:
            raise RuntimeError(f"{GRAVEYARD} old groups still held: restart instead of another re-form")
        if self._group is not None:
            self._graveyard.append((self._group, self._store, self._staging))
        self._group = self._store = None
        self._staging = []
        store = TCPStore(assignment.store_host, assignment.store_port, is_master=False, timeout=self.op_timeout)
        prefixed = PrefixStore(f"generation/{assignment.generation}/", store)
        self._group = dist.ProcessGroupGloo(prefixed, assignment.rank, assignment.world, self.op_timeout)
        self._store = store
        self.assignment = assignment
        self.broken.clear()

    def all_reduce(self, tensor: torch.Tensor, deadline: float) -> Outcome:
        """Sum `tensor` over the group, in place, through a staging copy (module docstring); the
        tensor is unchanged unless the outcome is DONE. `deadline` is a `time.monotonic()` time."""
        staging = tensor.detach().clone()
        outcome = self._wait(self._require_group().allreduce([staging]), staging, deadline)
        if outcome is Outcome.DONE:
            tensor.copy_(staging)
        return outcome

    def broadcast(self, tensor: torch.Tensor, src: int, deadline: float) -> Outcome:
        """`tensor` from rank `src` to every rank, through a staging copy, as `all_reduce`."""
        staging = tensor.detach().clone()
        options = dist.BroadcastOptions()
        options.rootRank = src
        outcome = self._wait(self._require_group().broadcast([staging], options), staging, deadline)
        if outcome is Outcome.DONE:
            tensor.copy_(staging)
        return outcome

    def agree(self, row: list[float], deadline: float) -> list[list[float]] | None:
        """Every rank's `row` (the same length on every rank), by rank; None if the group failed.
        One all-reduce of a world x len(row) table in which each rank fills its own line."""
        table = torch.zeros(self.world, len(row), dtype=torch.float64)
        table[self.rank] = torch.tensor(row, dtype=torch.float64)
        if self.all_reduce(table, deadline) is not Outcome.DONE:
            return None
        return [[float(value) for value in line] for line in table.tolist()]

    def graves(self) -> int:
        """Old groups held (for tests and logs)."""
        return len(self._graveyard)

    def _wait(self, work: Any, staging: torch.Tensor, deadline: float) -> Outcome:
        self._staging.append(staging)  # held with its group: a zombie may still write into it
        while not work.is_completed():
            if self.broken.is_set() or time.monotonic() > deadline:
                return Outcome.BROKEN
            time.sleep(POLL_SECONDS)
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: a peer's connection closed, or the op timed out
            log.warning("generation %s: collective failed (%s)", self.assignment and self.assignment.generation, exc)
            return Outcome.FAILED
        self._staging.remove(staging)
        return Outcome.DONE

    def _require(self) -> Assignment:
        if self.assignment is None:
            raise RuntimeError("no generation yet: call reconfigure first")
        return self.assignment

    def _require_group(self) -> Any:
        self._require()
        return self._group


def newest(rows: list[list[float]]) -> tuple[int, int]:
    """(the newest committed step, the lowest rank that holds it) from `agree` rows whose first value
    is each rank's committed step. Pure. A rank that committed a step the others did not (its
    all-reduce completed, a peer's failed) is the one the others heal from."""
    step = max(int(row[0]) for row in rows)
    return step, next(rank for rank, row in enumerate(rows) if int(row[0]) == step)


def wait_for_assignment(read: Callable[[], Assignment | None], after: int, deadline: float) -> Assignment | None:
    """Poll `read` until it returns an assignment of a generation newer than `after`, or None at the
    deadline (the caller then takes the restart path)."""
    while time.monotonic() < deadline:
        found = read()
        if found is not None and found.generation > after:
            return found
        time.sleep(POLL_SECONDS * 5)
    return None
