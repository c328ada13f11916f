"""The loop's collectives over a worker's current generation (`LiveCollectives`): the gathers, sums and
broadcasts of the recovery API's notices and the loop's own figures, on a `LiveGroup`'s staging copies
and deadlines (live.py), each raising `GroupChanged` where the default group's would raise or hang."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchspot_trainer.recovery.group import Group
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome

__all__ = ["LiveCollectives"]


@dataclass(frozen=True)
class LiveCollectives(Group):
    """The loop's collectives (`Group`'s) over the current generation of a `LiveGroup`: what the
    trainer's notices, resume, evaluation and progress lines call, run on the staging copies and
    deadlines above, raising `GroupChanged` where the default group's collective would raise or hang.

    :param live: the worker's generations.
    :param op_seconds: the deadline of each collective (--collective-timeout): a frozen peer's round
        is normally superseded long before it."""

    live: LiveGroup = None  # type: ignore[assignment]  # a dataclass field after Group's defaulted one
    op_seconds: float = 300.0

    def gather_ints(self, row: list[int]) -> list[list[int]]:
        """`Group.gather_ints`, with one more column: whether this rank's deferred round has its joiners
        ready (`LiveGroup.offer`). Any rank's yes ends the generation here, on every rank alike (they all
        read the same table): GroupChanged, and the loop switches at this boundary."""
        table = torch.zeros(self.world, len(row) + 1, dtype=torch.long)
        table[self.rank] = torch.tensor(self._with_joiners(row), dtype=torch.long)
        self._done(self.live.post(table, control=True)(time.monotonic() + self.op_seconds))
        return self._switch_or(table.tolist())

    def boundary(self, step: int, row: Callable[[], list[int]]) -> list[list[int]]:
        """`Group.boundary`: the rows gathered now (`gather_ints`)."""
        del step  # (nothing is gathered ahead)
        return self.gather_ints(row())

    def _with_joiners(self, row: list[int]) -> list[int]:
        return [*row, int(self.live.joiners_ready.is_set())]

    def _switch_or(self, rows: list[list[int]]) -> list[list[int]]:
        """The rows without their joiners' column, or GroupChanged where any rank's says ready."""
        if any(line[-1] for line in rows):
            raise GroupChanged(Outcome.BROKEN)
        return [line[:-1] for line in rows]

    def ping(self, timeout: float) -> bool:
        """False when the zero did not come back within `timeout` (a peer frozen or gone, no newer round
        yet); GroupChanged when a newer round broke it or a peer's socket closed."""
        outcome = self.live.all_reduce(torch.zeros(1), time.monotonic() + timeout, control=True)
        if outcome is Outcome.BROKEN and not self.live.broken.is_set():
            return False
        self._done(outcome)
        return True

    def agree(self, timeout: float) -> bool:
        return self.ping(timeout)

    def sums(self, values: list[torch.Tensor]) -> list[float]:
        totals = torch.stack([value.detach().to("cpu", torch.float64).reshape(()) for value in values])
        self._done(self.live.all_reduce(totals, time.monotonic() + self.op_seconds, control=True))
        result: list[float] = totals.tolist()
        return result

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._done(self.live.broadcast(tensor, src, time.monotonic() + self.op_seconds))

    @staticmethod
    def _done(outcome: Outcome) -> None:
        if outcome is not Outcome.DONE:
            raise GroupChanged(outcome)
