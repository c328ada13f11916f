"""Who leads among replicas (leader.py) and their default priorities (`__main__.start_priority`). Pure;
tests/operator/test_peering.py runs two real replicas."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from torchspot_operator import conditions
from torchspot_operator.__main__ import start_priority
from torchspot_operator.controller import Controller
from torchspot_operator.kube import Kube
from torchspot_operator.leader import outranked_by

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def _record(priority: int, seen_ago: float, lifetime: int = 60) -> dict[str, object]:
    return {
        "priority": priority,
        "lifetime": lifetime,
        "lastseen": conditions.timestamp(NOW - timedelta(seconds=seen_ago)),
    }


def test_a_replica_is_outranked_only_by_live_peers_of_higher_priority() -> None:
    peers = {
        "me": _record(500, 1),
        "older-alive": _record(900, 30),
        "older-dead": _record(800, 61),  # its record outlived its lifetime: a crashed pod
        "younger": _record(100, 1),
        "odd": {"priority": "not a number"},
    }
    assert outranked_by(peers, 500, NOW) == ["older-alive"]
    assert outranked_by(peers, 950, NOW) == []
    assert outranked_by({"me": _record(500, 1)}, 500, NOW) == []  # alone (or equal: itself)
    naive = {"old": {"priority": 900, "lifetime": 60, "lastseen": "2026-11-24T11:59:50"}}  # no zone: UTC
    assert outranked_by(naive, 500, NOW) == ["old"]


def test_the_earlier_a_replica_started_the_higher_its_priority() -> None:
    started = NOW.timestamp()
    assert start_priority(started, 999) > start_priority(started + 0.001, 0)  # a millisecond later: lower
    assert start_priority(started, 1) > start_priority(started, 0)  # the tiebreak only within a millisecond
    assert 0 < start_priority(started, 0) < 2**63  # fits the peering object's integer


def test_a_paused_replica_reports_no_phases_and_is_not_stalled() -> None:
    controller = Controller(Kube(server="http://127.0.0.1:1", headers={}, ssl_context=True))
    controller.phases[("default", "cifar")] = "Running"
    controller.last_reconcile -= 3600  # an active job, and no reconcile for an hour: stalled
    assert not controller.alive()
    controller.pause(["operator-a"])
    assert (controller.paused, controller.phases, controller.alive()) == (True, {}, True)  # the leader reports them
    controller.pause([])
    assert (controller.paused, controller.alive()) == (False, True)  # the liveness clock starts again
