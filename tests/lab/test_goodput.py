"""The goodput arithmetic of bench/goodput (lab/torchspot_lab/goodput.py): pure, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from torchspot_lab import goodput
from torchspot_lab.scenario import parse_scenario

MARKET = parse_scenario(
    {
        "pools": {"spot": {"nodes": 3, "gpus": 1}},
        "timeout": 100,
        "events": [
            {"at": 20, "evict": "spot-1", "notice": True},
            {"at": 40, "addSpot": 1},
            {"at": 60, "freeze": "spot-2"},
            {"at": 80, "addSpot": 2},
        ],
    }
)


def _start(t: float, samples: int, world: int = 3) -> dict[str, Any]:
    return {"event": "start", "t": t, "trained_samples": samples, "world_size": world}


def _progress(t: float, samples: int, world: int = 3) -> dict[str, Any]:
    return {"event": "progress", "t": t, "trained_samples": samples, "world_size": world}


def test_capacity_counts_evicted_and_frozen_nodes_out_and_caps_at_the_maximum() -> None:
    assert goodput.capacity(MARKET, 3) == [(0.0, 3), (20, 2), (40, 3), (60, 2), (80, 3)]
    assert goodput.capacity(MARKET, 2)[-1] == (80, 2)


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [(0, 20, 20 * 30.0), (10, 30, 10 * 30.0 + 10 * 20.0), (0, 100, 60 * 30.0 + 40 * 20.0), (50, 50, 0.0)],
)
def test_expected_samples_integrates_the_rate_of_each_size(start: float, end: float, expected: float) -> None:
    points = goodput.capacity(MARKET, 3)
    assert goodput.expected_samples(points, {3: 30.0, 2: 20.0}, start, end) == pytest.approx(expected)


def test_useful_samples_counts_redone_work_once_and_stops_at_the_end() -> None:
    events = [_start(5, 0), _progress(10, 300), _progress(18, 540), _start(30, 480, 2), _progress(35, 600, 2)]
    assert goodput.useful_samples(events, 100) == 600
    assert goodput.useful_samples(events, 32) == 480  # resumed from 480: the 60 samples past it were lost
    assert goodput.useful_samples(events, 4) == 0


def test_resumptions_give_the_lost_work_in_samples_and_in_the_old_groups_steps() -> None:
    events = [_start(5, 0), _progress(18, 540), _start(30, 480, 2), _progress(35, 600, 2), _start(50, 600, 3)]
    found = goodput.resumptions(events, 100, batch=16)
    assert [(r.t, r.world_size, r.resumed_from, r.lost_samples) for r in found] == [(30, 2, 480, 60), (50, 3, 600, 0)]
    assert found[0].lost_steps == pytest.approx(60 / (16 * 3))


def test_rate_of_an_uninterrupted_run_is_measured_from_its_first_start() -> None:
    assert goodput.rate([_start(10, 0), _progress(20, 200), _progress(30, 400), _progress(90, 9999)], 40) == 20.0
    assert goodput.rate([_start(10, 0)], 40) == 0.0


def test_recovery_is_the_time_until_a_group_started_after_the_event_trains() -> None:
    events = [_start(5, 0), _progress(19, 500), _progress(21, 520), _start(28, 520, 2), _progress(30, 560, 2)]
    got = goodput.recoveries(MARKET, events, 100)
    at, what, took = got[0]
    assert (at, what, took) == (20.0, "evict spot-1 (notice)", 10.0)  # the progress line at 21 s is the old group's
    assert [took for _, _, took in got[1:]] == [None, None, None]
    assert got[2][1] == "freeze spot-2"


def test_expected_curve_ends_at_the_expected_total() -> None:
    points = goodput.capacity(MARKET, 3)
    curve = goodput.expected_curve(points, {3: 30.0, 2: 20.0}, 0, 100, step=10)
    assert curve[0] == (0.0, 0.0)
    assert curve[-1][0] == 100.0
    assert curve[-1][1] == pytest.approx(goodput.expected_samples(points, {3: 30.0, 2: 20.0}, 0, 100))
