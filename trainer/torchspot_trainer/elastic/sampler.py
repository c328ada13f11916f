"""Exact-once data for a loop on the recovery API: which samples each rank takes in each step.

The position is one number for the whole group (data/sampler.py): the samples of the current epoch's
permutation that committed steps used. Each step takes the next `global_batch` of them, whatever the
world size, and deals them over the ranks; the manager moves the position on only at a commit, carries
it in every heal and checkpoint, so after any membership change each remaining sample of the epoch is
taken exactly once. With a global batch that each world size divides, DDP's mean of the ranks' mean
losses is the global batch's mean: the same steps as an uninterrupted run (up to float reduction order).
"""

from __future__ import annotations

from torchspot_trainer.data.sampler import ElasticSampler as _Position
from torchspot_trainer.elastic.manager import Manager


class ElasticSampler:
    """This rank's sample indices for each step, exact-once at any world size (module docstring).

    :param manager: the loop's manager (make the sampler before the first step).
    :param length: samples in the data set.
    :param global_batch: samples per step for the whole group.
    :param seed: epoch e's permutation is seeded with seed + e.
    :param shuffle: False takes each epoch in order.
    """

    def __init__(
        self, manager: Manager, length: int, *, global_batch: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch={global_batch}: must be at least 1")
        self.manager = manager
        self._position = _Position(length, batch_size=1, seed=seed, shuffle=shuffle, global_batch=global_batch)
        manager.add_position(self._position)

    @property
    def epoch(self) -> int:
        """The epoch the next step belongs to."""
        return self._position.epoch

    def indices(self) -> list[int]:
        """This rank's sample indices in the step begun (call after `optimizer.zero_grad()`: a re-form
        there may change the rank and the world). In the step after a heal beside it, the ranks that
        hold the state deal it among themselves (`Manager.share`)."""
        self.manager.require_step("ElasticSampler.indices()")
        return self._position.rank_indices(*self.manager.share())
