"""Exact-once elastic data order: resume mid-epoch at any world size.

torch's `DistributedSampler` splits an epoch by rank up front, so after a world-size
change there is no way to say which samples were already seen; the usual answer
(restart the epoch, or the Lab's `ElasticDistributedSampler` with a start index per
rank) repeats or skips data. Here the position is one number for the whole group:
`consumed`, the count of samples of the current epoch's permutation that earlier
steps used. Each step takes the next `step_size(world)` indices of the permutation (a
fixed global batch, or `world x batch` per worker) and deals them out across ranks.
Resumed at any world size from a checkpoint taken after global sample k, the group
continues at index k, so each remaining sample of the epoch is used exactly once. The
epoch's last step may be short: its indices are dealt as evenly as possible (some ranks
may get one fewer, or none).

A rank's share of a step is cut into micro-batches (`micro_batches`) for gradient
accumulation. Every rank runs the same number of them in a step, counted from the
largest share, so a collective inside the forward pass (SyncBatchNorm) lines up.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class ElasticSampler:
    """The group's position in the data, and the indices each rank uses per step.

    :param length: number of samples in the data set.
    :param batch_size: samples per rank per step (used when `global_batch` is 0).
    :param seed: base seed; epoch e uses permutation seed + e.
    :param shuffle: permute each epoch (False: natural order, for evaluation).
    :param global_batch: samples per step for the whole group, whatever its size (0: per rank).
    :param micro_batch: most samples per rank per forward/backward pass (0: the whole share).
    """

    length: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    global_batch: int = 0
    micro_batch: int = 0
    epoch: int = 0
    consumed: int = 0
    _cache: tuple[int, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError("the data set is empty")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size {self.batch_size}: must be at least 1")
        if self.global_batch < 0 or self.micro_batch < 0:
            raise ValueError("global and micro batch sizes must be 0 (off) or more")

    @property
    def trained(self) -> int:
        """Samples trained so far, every epoch counted (a step redone counts once: only completed steps move
        the position): the measure of progress that does not depend on the world size."""
        return self.epoch * self.length + self.consumed

    def step_size(self, world: int) -> int:
        """Samples a full step uses: the global batch, or `batch_size` per rank."""
        return self.global_batch or world * self.batch_size

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

    def next_step_samples(self, world: int) -> int:
        """Samples the next step uses: a full step, or what is left of the epoch."""
        return min(self.step_size(world), self.length - self.consumed)

    def step_chunk(self, world: int) -> list[int]:
        """The global indices the next step uses (all ranks together)."""
        order = self._order()
        return order[self.consumed : self.consumed + self.step_size(world)].tolist()

    def rank_indices(self, rank: int, world: int) -> list[int]:
        """The indices `rank` uses in the next step."""
        return self.step_chunk(world)[rank::world]

    def steps_left_in_epoch(self, world: int) -> int:
        """Steps until the epoch ends at this world size (the last one may be short)."""
        return -(-(self.length - self.consumed) // self.step_size(world))

    def advance(self, world: int) -> int:
        """Mark one step done by a group of `world`; return the samples it used.

        Rolls over to the next epoch when the permutation is used up.
        """
        used = self.next_step_samples(world)
        self.consumed += used
        if self.consumed >= self.length:
            self.epoch += 1
            self.consumed = 0
        return used

    def micro_batches(self, rank: int, world: int, *, among: int = 0) -> list[list[int]]:
        """The index lists `rank` runs forward and backward in the next step of a group of `world`.
        `among`: the step's samples are dealt over that many of its ranks only, `rank` counted
        among them (0: all). A heal in place deals a step so while its receivers wait for the state
        (train.py): the same samples, the same step, computed by fewer ranks."""
        return split_share(self.step_chunk(world), rank, among or world, self.micro_batch)

    def epoch_steps(self, rank: int, world: int) -> Iterator[list[list[int]]]:
        """This rank's micro-batches for each remaining step of the epoch. Computed once
        from the current position; the trainer still calls `advance` after each completed
        step, which is what a checkpoint records."""
        order = self._order()
        per_step = self.step_size(world)
        for start in range(self.consumed, self.length, per_step):
            yield split_share(order[start : start + per_step].tolist(), rank, world, self.micro_batch)

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


def split_share(chunk: list[int], rank: int, world: int, micro: int) -> list[list[int]]:
    """`rank`'s share of a step's `chunk` (every world-th index), cut into as many contiguous
    micro-batches as the largest share needs at most `micro` per pass (0: one). Pure.

    The count is the same on every rank; the parts are as even as possible, so a rank with
    a smaller share (the short last step) runs smaller, possibly empty, micro-batches.
    """
    share = chunk[rank::world]
    largest = -(-len(chunk) // world)
    parts = max(1, -(-largest // micro)) if micro else 1
    base, extra = divmod(len(share), parts)
    cuts = [0]
    for part in range(parts):
        cuts.append(cuts[-1] + base + (part < extra))
    return [share[a:b] for a, b in itertools.pairwise(cuts)]
