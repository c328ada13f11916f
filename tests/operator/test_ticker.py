"""The ticker that replaced kopf's per-job timers and TTL daemons (`handlers._tick_jobs`): each active job
once per interval, never an inactive one, a slow tick not stacked, a finished job deleted once its TTL ran
out, and nothing while the replica stands by.

The controller here records ticks and deletions instead of acting: what is under test is when they happen,
which the operator tests (clocks acted on without events, a TTL, against the emulator) cover end to end."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from torchspot_operator import handlers

INTERVAL = 0.2


class _Ticked:
    """What `_tick_jobs` asks of the controller: whether it is paused, and a tick."""

    def __init__(self) -> None:
        self.paused = False
        self.ticks: Counter[str] = Counter()
        self.slow: set[str] = set()
        self.expired: list[str] = []

    async def tick(self, namespace: str, name: str) -> None:
        self.ticks[name] += 1
        if name in self.slow:
            await asyncio.sleep(10 * INTERVAL)

    async def expire(self, namespace: str, name: str, uid: str) -> None:
        self.expired.append(uid)


@pytest.fixture
def ticked(monkeypatch: pytest.MonkeyPatch) -> _Ticked:
    monkeypatch.setattr(handlers, "RECONCILE_INTERVAL", INTERVAL)
    recorder = _Ticked()
    monkeypatch.setitem(handlers._state, "controller", recorder)
    past, later = datetime.now(UTC) - timedelta(seconds=1), datetime.now(UTC) + timedelta(hours=1)
    jobs = {
        ("ns", "active"): handlers.Tracked(active=True, uid="a"),
        ("ns", "done"): handlers.Tracked(active=False, uid="d"),
        ("ns", "slow"): handlers.Tracked(active=True, uid="s"),
        ("ns", "expired"): handlers.Tracked(active=False, uid="e", expires=past),
        ("ns", "kept"): handlers.Tracked(active=False, uid="k", expires=later),
    }
    monkeypatch.setitem(handlers._state, "jobs", jobs)
    recorder.slow.add("slow")
    return recorder


def test_active_jobs_tick_once_an_interval_and_a_standby_ticks_none(ticked: _Ticked) -> None:
    async def scene() -> None:
        ticker = asyncio.get_running_loop().create_task(handlers._tick_jobs())
        began = time.monotonic()
        try:
            await asyncio.sleep(5.5 * INTERVAL)
            intervals = (time.monotonic() - began) / INTERVAL  # as long as the loop actually took
            assert 1 <= ticked.ticks["active"] <= intervals + 1, (
                ticked.ticks
            )  # ticked, never more than once an interval
            assert ticked.ticks["done"] == 0  # finished, invalid or suspended: never ticked
            assert ticked.ticks["slow"] == 1  # its first tick still runs: not stacked
            assert ticked.expired[0] == "e"  # its TTL ran out; the one an hour away waits
            assert set(ticked.expired) == {"e"}
            ticked.paused = True
            await asyncio.sleep(0)  # a tick started before the pause has counted (it counts as it starts)
            before = sum(ticked.ticks.values())
            await asyncio.sleep(3 * INTERVAL)
            assert sum(ticked.ticks.values()) == before
        finally:
            ticker.cancel()

    asyncio.run(scene())
