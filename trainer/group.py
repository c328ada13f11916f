"""The few collectives the training loop itself calls, over the default process group.

Each one moves a handful of numbers; they are here so the loop reads as what it asks
("every rank's notice", "the group's sums") rather than as tensor plumbing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """This worker's place in the current group."""

    rank: int
    world: int
    device: torch.device

    def gather_ints(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (the same length on all), by rank: one all-gather and one copy to
        the host (this runs after every step)."""
        mine = torch.tensor(row, dtype=torch.long, device=self.device)
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        gathered: list[list[int]] = torch.stack(rows).tolist()
        return gathered

    def sums(self, values: list[torch.Tensor]) -> list[float]:
        """The group's sums of these scalars (float64 on the device, one all-reduce)."""
        totals = torch.stack([value.detach().to(self.device, torch.float64).reshape(()) for value in values])
        dist.all_reduce(totals)
        result: list[float] = totals.tolist()
        return result
