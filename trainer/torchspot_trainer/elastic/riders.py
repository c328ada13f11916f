"""What a step's last gradient bucket carries beside the gradients in place, built and read (pure).

Every rank that completes a step must learn the same things at the same step, without a collective
more: the model's floating-point buffers (BatchNorm's statistics: DDP broadcasts them from rank 0 at
each forward) as one rank that computed the step has them, and each rank's line of a small table. The
last bucket's all-reduce carries both: that rank sends its buffers and the others zeros, so the sum is
its; each rank fills only its own line of the table, so the sum is every rank's line. A line's values are small whole
numbers, exact in any float type a gradient may have (bfloat16 holds every whole number to 256).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["COLUMNS", "Line", "pack", "unpack"]

COLUMNS = 3
"""The values of a rank's line (`Line`)."""


@dataclass(frozen=True)
class Line:
    """One rank's line of the table."""

    ready: bool
    """Its deferred round (a joiner's) has its joiners ready: every rank switches after this step."""
    level: int
    """Its notice level (recovery/notices.py): 0 none, 1 its agent restarts it, 2 its node leaves."""
    node: int
    """Its node's place in the round: which ranks leave together."""


def pack(
    buffers: Sequence[torch.Tensor],
    rank: int,
    world: int,
    line: Line,
    *,
    source: int = 0,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The riders of `rank` of `world`: the buffers (rank `source`'s values, zeros elsewhere: DDP's rank
    0, or the first rank that computed a step others sat out), then the table with `line` in this rank's
    place."""
    table = torch.zeros(world * COLUMNS, dtype=dtype, device=device)
    values = [float(line.ready), float(line.level), float(line.node)]
    table[rank * COLUMNS : (rank + 1) * COLUMNS] = torch.tensor(values, dtype=dtype)
    if not buffers:
        return table
    parts = [(b.detach() if rank == source else torch.zeros_like(b)).reshape(-1).to(device, dtype) for b in buffers]
    return torch.cat([*parts, table])


def unpack(ride: torch.Tensor, buffers: Sequence[torch.Tensor], world: int) -> list[Line]:
    """Every rank's line from the summed riders; the buffers take the source's values (the one write here)."""
    offset = 0
    for buffer in buffers:
        buffer.copy_(ride[offset : offset + buffer.numel()].view_as(buffer))
        offset += buffer.numel()
    rows = ride[offset:].view(world, COLUMNS).tolist()
    return [Line(bool(round(r[0])), round(r[1]), round(r[2])) for r in rows]
