"""Exact-once elastic data order across world-size changes."""

from __future__ import annotations

from collections import Counter

import pytest

from torchspot_trainer.data.sampler import ElasticSampler


def _run_steps(sampler: ElasticSampler, world: int, steps: int) -> list[int]:
    seen: list[int] = []
    for _ in range(steps):
        for rank in range(world):
            seen += sampler.rank_indices(rank, world)
        sampler.advance(world)
    return seen


@pytest.mark.parametrize("length", [97, 100, 120])
def test_three_two_three_sees_every_sample_exactly_once(length: int) -> None:
    """Resume from a checkpoint at 3 -> 2 -> 3 workers: the epoch covers each sample once."""
    sampler = ElasticSampler(length, batch_size=4, seed=7)
    seen = _run_steps(sampler, 3, 3)  # 36 samples with three workers

    checkpoint = sampler.state_dict()
    resumed = ElasticSampler(length, batch_size=4, seed=7)
    resumed.load_state_dict(checkpoint)
    seen += _run_steps(resumed, 2, 4)  # two workers after an eviction

    again = ElasticSampler(length, batch_size=4, seed=7)
    again.load_state_dict(resumed.state_dict())
    seen += _run_steps(again, 3, again.steps_left_in_epoch(3))  # capacity is back

    assert again.epoch == 1
    assert again.consumed == 0
    counts = Counter(seen)
    assert sorted(counts) == list(range(length))
    assert set(counts.values()) == {1}


def test_short_last_step_is_dealt_evenly() -> None:
    sampler = ElasticSampler(10, batch_size=4)
    sampler.consumed = 8  # two samples left for three ranks
    sizes = [len(sampler.rank_indices(r, 3)) for r in range(3)]
    assert sizes == [1, 1, 0]
    assert sampler.advance(3) == 2
    assert (sampler.epoch, sampler.consumed) == (1, 0)


def test_epochs_use_different_orders_and_batches_match_indices() -> None:
    sampler = ElasticSampler(50, batch_size=5, seed=1)
    first = sampler.step_chunk(2)
    sampler.epoch = 1
    assert sampler.step_chunk(2) != first
    steps = list(sampler.epoch_steps(1, 2))
    assert steps[0] == [sampler.rank_indices(1, 2)]
    assert len(steps) == sampler.steps_left_in_epoch(2)


def test_refuses_a_checkpoint_from_another_data_set() -> None:
    state = ElasticSampler(100, batch_size=4).state_dict()
    with pytest.raises(ValueError, match="100 samples"):
        ElasticSampler(90, batch_size=4).load_state_dict(state)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_a_global_batch_uses_the_same_samples_per_step_at_any_world_size(world: int) -> None:
    """With --global-batch-size every step of the group takes the same indices, however many
    ranks share them: the steps of a 1-rank and a 5-rank run are the same sets of samples."""
    alone = ElasticSampler(100, batch_size=999, seed=3, global_batch=24)
    group = ElasticSampler(100, batch_size=999, seed=3, global_batch=24)
    for _ in range(alone.steps_left_in_epoch(1)):
        dealt = [i for rank in range(world) for i in group.rank_indices(rank, world)]
        assert sorted(dealt) == sorted(alone.step_chunk(1))
        assert alone.advance(1) == group.advance(world)
    assert (group.epoch, group.consumed) == (1, 0)
    assert group.steps_left_in_epoch(world) == 5  # 24, 24, 24, 24 and a short 4


@pytest.mark.parametrize(("chunk", "world", "micro"), [(24, 3, 3), (24, 5, 2), (4, 3, 1), (7, 2, 0), (2, 4, 3)])
def test_micro_batches_cover_the_share_once_in_the_same_count_on_every_rank(chunk: int, world: int, micro: int) -> None:
    sampler = ElasticSampler(chunk, batch_size=1, global_batch=chunk, micro_batch=micro)
    plans = [sampler.micro_batches(rank, world) for rank in range(world)]
    assert len({len(plan) for plan in plans}) == 1  # every rank runs as many passes
    for rank, plan in enumerate(plans):
        assert [i for part in plan for i in part] == sampler.rank_indices(rank, world)
        if micro:
            assert max(len(part) for part in plan) <= micro
        else:
            assert len(plan) == 1
    counts = Counter(i for plan in plans for part in plan for i in part)
    assert sorted(counts) == sorted(sampler.step_chunk(world))
    assert set(counts.values()) == {1}


@pytest.mark.parametrize(("world", "among"), [(3, 2), (3, 1), (5, 3)])
def test_a_step_dealt_among_fewer_ranks_is_the_same_step(world: int, among: int) -> None:
    """A heal in place whose receivers sit out a step deals it over its trainers only: the same samples,
    each once, and the step counted as the world's (what the next step starts from is unchanged)."""
    sampler = ElasticSampler(100, batch_size=1, seed=5, global_batch=24, micro_batch=8)
    dealt = [i for rank in range(among) for part in sampler.micro_batches(rank, world, among=among) for i in part]
    assert sorted(dealt) == sorted(sampler.step_chunk(world))
    assert max(len(part) for rank in range(among) for part in sampler.micro_batches(rank, world, among=among)) <= 8
    assert sampler.advance(world) == 24
