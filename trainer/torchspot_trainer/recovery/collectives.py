"""The loop's collectives over a worker's current generation (`LiveCollectives`): the gathers, sums and
broadcasts of the trainer's notices, heals, evaluation and progress, and its gradient average, on a
`LiveGroup`'s staging copies and deadlines (live.py), each raising `GroupChanged` where the default
group's would raise or hang."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from torchspot_trainer.recovery.group import Group
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome

if TYPE_CHECKING:
    from torchspot_trainer.recovery.buckets import GradientBuckets

__all__ = ["EXACT_ROWS", "LiveCollectives"]

EXACT_ROWS = (torch.float32, torch.float64)
"""Gradient dtypes whose sums carry a boundary's rows exactly (integers below 2**24)."""


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
        """`Group.gather_ints`, with two more columns: whether this rank's deferred round has its
        joiners ready (`LiveGroup.offer`), and its rank in that round. Any rank's yes ends the
        generation here, on every rank alike (they all read the same table): GroupChanged, and the
        loop switches at this boundary (`LiveGroup.roster`)."""
        return self.gather_ints_beside(row)()

    def gather_ints_beside(self, row: list[int]) -> Callable[[], list[list[int]]]:
        """`gather_ints` started now; the returned function waits for its rows (or raises as it)."""
        table = torch.zeros(self.world, len(row) + 2, dtype=torch.long)
        table[self.rank] = torch.tensor(self._with_joiners(row), dtype=torch.long)
        finish = self.live.post(table, control=True)

        def rows() -> list[list[int]]:
            self._done(finish(time.monotonic() + self.op_seconds))
            return self._switch_or(table.tolist())

        return rows

    def boundary(self, step: int, row: Callable[[], list[int]]) -> list[list[int]]:
        """`Group.boundary`: the rows `average_gradients` gathered with `step`'s gradients if it did
        (one all-reduce a step instead of two: on 2 CPU cores a gloo all-reduce of three ranks costs
        several milliseconds, most of it waiting for the slowest), else gathered now."""
        agreed, self.live.agreed = self.live.agreed, None
        if agreed is not None and agreed[0] == step:
            return self._switch_or(agreed[1])
        return self.gather_ints(row())

    def _with_joiners(self, row: list[int]) -> list[int]:
        return [*row, int(self.live.joiners_ready.is_set()), self.live.pending_rank()]

    def _switch_or(self, rows: list[list[int]]) -> list[list[int]]:
        """The rows without their joiners' columns, or GroupChanged where any rank's says ready (the
        ranks' places in the round switched to kept: `LiveGroup.switching`)."""
        if any(line[-2] for line in rows):
            self.live.switching([line[-1] for line in rows])
            raise GroupChanged(Outcome.BROKEN)
        return [line[:-2] for line in rows]

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

    def average_gradients(
        self,
        parameters: list[torch.Tensor],
        buffers: list[torch.Tensor],
        *,
        boundary: tuple[int, Callable[[], list[int]]] | None = None,
        buffers_from: int = 0,
        buckets: GradientBuckets | None = None,
        sums: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """What DDP does to a step: the gradients averaged over ranks (each divided by the world, then
        summed, in DDP's order of operations), and the model's floating-point buffers (BatchNorm's
        running statistics) taken from rank `buffers_from` (DDP's rank 0; after a heal whose
        receivers sat out the step, a rank that trained it: in_place.py); a parameter without a
        gradient counts as zero. With `buckets` (buckets.py: `parameters` are theirs) the gradients
        went in DDP's buckets, posted while the backward pass computed (the rest are posted now),
        and the buffers go in one more all-reduce; without, everything goes in one all-reduce of one
        flat buffer after the step's last backward pass.

        `boundary`: (the step these gradients make, its agreement's row function). Where the gradients
        travel on the agreements' group (gloo: not on a GPU, whose host would then wait for the
        device), the rows ride along, each rank's on its line of a table (sums of small integers are
        exact in float32) and `boundary` reads them; the step is not applied unless every all-reduce
        completed, so the agreement's rows and its update stand or fall together.

        `sums` (values every rank gives, or None): summed over the ranks in the same all-reduce and
        returned (on the gradients' device, unread: the host need not wait for it before the update),
        where the gradients are float32 or float64 (else None: the caller sums them apart).
        The trainer's progress record rides so (its loss and accuracy over the group): a second
        collective for it after the update was 12% of a step's time on 2 CPU cores with a record a
        step (a sampling profile of the small CNN at 2 ranks)."""
        floating = [buffer for buffer in buffers if buffer.is_floating_point()]
        mine = self.rank == buffers_from
        dtype = parameters[0].dtype if parameters else None
        launched = []
        if buckets is not None:
            assert len(buckets.parameters) == len(parameters)
            assert all(ours is given for ours, given in zip(buckets.parameters, parameters, strict=True))
            launched = buckets.complete(partial(self.live.post, control=False, owned=True), self.world)
            grads: list[torch.Tensor] = []
        else:
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in parameters]
        parts = [grad.reshape(-1) / self.world for grad in grads]
        parts += [buffer.reshape(-1) if mine else torch.zeros_like(buffer).reshape(-1) for buffer in floating]
        packed = sums.detach().reshape(-1).to(self.device, dtype) if sums is not None and dtype in EXACT_ROWS else None
        if packed is not None:
            parts.append(packed)
        table = None
        if boundary is not None and not self.live.plane.separate and dtype in EXACT_ROWS:
            row = self._with_joiners(boundary[1]())
            table = torch.zeros(self.world, len(row), dtype=dtype)
            table[self.rank] = torch.tensor(row, dtype=table.dtype)
            parts.append(table.reshape(-1))
        if not parts and launched:  # one collective after the buckets all the same: it settles a heal's sends
            parts.append(torch.zeros(1, dtype=dtype))
        flat = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
        deadline = time.monotonic() + self.op_seconds
        self._done(self.live.all_reduce(flat, deadline))
        for _bucket, finish in launched:
            self._done(finish(deadline))
        if boundary is not None and table is not None:
            rows = flat[flat.numel() - table.numel() :].view(table.shape)
            self.live.agreed = (boundary[0], [[round(value) for value in line] for line in rows.tolist()])
        offset = 0
        if buckets is not None:
            buckets.assign([bucket for bucket, _finish in launched])
        else:
            for parameter, grad in zip(parameters, grads, strict=True):
                parameter.grad = flat[offset : offset + grad.numel()].view_as(grad)
                offset += grad.numel()
        for buffer in floating:
            buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()
        return None if packed is None else flat[offset : offset + packed.numel()].clone()

    @staticmethod
    def _done(outcome: Outcome) -> None:
        if outcome is not Outcome.DONE:
            raise GroupChanged(outcome)
