"""Exact-once elastic data order: resume mid-epoch at any world size.

torch's `DistributedSampler` splits an epoch by rank up front, so after a world-size
change there is no way to say which samples were already seen; the usual answer
(restart the epoch, or the Lab's `ElasticDistributedSampler` with a start index per
rank) repeats or skips data. Here the position is one number for the whole group:
`consumed`, the count of samples of the current epoch's permutation that earlier
steps used. Each step takes the next `world x batch` indices of the permutation and
deals them out across ranks. Resumed at any world size from a checkpoint taken after
global sample k, the group continues at index k, so each remaining sample of the
epoch is used exactly once. The epoch's last step may be short: its indices are
dealt as evenly as possible (some ranks may get one fewer, or none).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class ElasticSampler:
    """The group's position in the data, and the indices each rank uses per step.

    :param length: number of samples in the data set.
    :param batch_size: samples per rank per step.
    :param seed: base seed; epoch e uses permutation seed + e.
    :param shuffle: permute each epoch (False: natural order, for evaluation).
    """

    length: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    consumed: int = 0
    _cache: tuple[int, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError("the data set is empty")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size {self.batch_size}: must be at least 1")

    def _order(self) -> torch.Tensor:
        """This epoch's permutation (computed once per epoch: O(length))."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator)
        else:
            order = torch.arange(self.length)
        self._cache = (self.epoch, order)
        return order

    def step_chunk(self, world: int) -> list[int]:
        """The global indices the next step uses (all ranks together)."""
        order = self._order()
        return order[self.consumed : self.consumed + world * self.batch_size].tolist()

    def rank_indices(self, rank: int, world: int) -> list[int]:
        """The indices `rank` uses in the next step."""
        return self.step_chunk(world)[rank::world]

    def steps_left_in_epoch(self, world: int) -> int:
        """Steps until the epoch ends at this world size (the last one may be short)."""
        left = self.length - self.consumed
        per_step = world * self.batch_size
        return -(-left // per_step)

    def advance(self, world: int) -> int:
        """Mark one step done by a group of `world`; return the samples it used.

        Rolls over to the next epoch when the permutation is used up.
        """
        used = min(world * self.batch_size, self.length - self.consumed)
        self.consumed += used
        if self.consumed >= self.length:
            self.epoch += 1
            self.consumed = 0
        return used

    def epoch_batches(self, rank: int, world: int) -> Iterator[list[int]]:
        """This rank's index lists for the rest of the epoch (for a DataLoader's
        batch_sampler). Computed once from the current position; the trainer still
        calls `advance` after each completed step, which is what a checkpoint records."""
        order = self._order()
        per_step = world * self.batch_size
        for start in range(self.consumed, self.length, per_step):
            yield order[start : start + per_step].tolist()[rank::world]

    def state_dict(self) -> dict[str, int]:
        """Position for a checkpoint."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "length": self.length,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a checkpoint; refuses one taken on a different data set."""
        if state["length"] != self.length:
            raise ValueError(
                f"checkpoint was taken on a data set of {state['length']} samples, this one has {self.length}"
            )
        self.epoch, self.consumed, self.seed = state["epoch"], state["consumed"], state["seed"]
        self._cache = None
