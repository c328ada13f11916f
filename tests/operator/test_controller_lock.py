"""The per-job lock (`Controller._lock`) keeps a job's reconciles one at a time, also across the job
being forgotten (deleted) and re-created under its name while others wait; triggers that arrive while
one waits are folded into it (`Controller.reconcile`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kopf._core.engines import posting

from tests.operator.cluster import NS, Cluster
from tests.operator.jobs import good_job
from torchspot_operator import constants
from torchspot_operator.controller import Controller
from torchspot_operator.kube import Kube
from torchspot_operator.reconcile import Plan


def test_a_forgotten_jobs_lock_stays_while_reconciles_wait_on_it() -> None:
    async def scene() -> tuple[int, int]:
        controller = Controller(Kube(server="http://127.0.0.1:1", headers={}, ssl_context=True))
        inside, most = 0, 0
        released = asyncio.Event()

        async def reconcile(forget: bool) -> None:
            nonlocal inside, most
            async with controller._lock("default", "cifar"):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.01)
                if forget:  # the job was deleted: what _reconcile does then
                    controller._forget("default", "cifar")
                inside -= 1
            if forget:
                released.set()

        first = asyncio.create_task(reconcile(forget=True))
        await asyncio.sleep(0)  # it holds the lock
        waiting = asyncio.create_task(reconcile(forget=False))  # an event of the re-created job
        await released.wait()  # the first has forgotten the job and released
        late = asyncio.create_task(reconcile(forget=False))  # another event, after the forget
        await asyncio.gather(first, waiting, late)
        return most, len(controller._locks)

    most, left = asyncio.run(scene())
    assert most == 1  # never two at once
    assert left == 0  # and the lock went with its last user, the job being forgotten


def test_a_burst_of_triggers_for_a_job_queues_one_reconcile(api: Cluster) -> None:
    """Ten pod events for a job while it is being reconciled: one more reconcile, which reads the job
    (and the indices) when it starts and so covers all ten."""
    api.create(good_job("burst"))
    controller = Controller(api.kube)
    reads = f"{constants.GROUP}/{constants.VERSION}/{constants.PLURAL}"

    async def scene() -> list[Plan | None]:
        quiet = kopf.OperatorSettings()
        quiet.posting.enabled = False  # kopf posts Events only inside a running operator; none here
        posting.settings_var.set(quiet)
        async with controller._lock(NS, "burst"):  # a reconcile of the job in progress
            triggers = [asyncio.create_task(controller.reconcile(NS, "burst")) for _ in range(10)]
            while sum(trigger.done() for trigger in triggers) < len(triggers) - 1:  # nine folded into the tenth,
                await asyncio.sleep(0)  # which waits on the lock
        return await asyncio.gather(*triggers)

    before = api.requests("GET", reads)
    done = api.api.run(scene())
    assert sum(plan is not None for plan in done) == 1
    assert api.requests("GET", reads) - before == 1  # one read of the job for the ten
    assert len(api.pods("burst")) == 3  # and that reconcile did the work


def test_a_namespace_list_slower_than_its_freshness_still_serves_the_jobs_that_waited_on_it(
    api: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs whose caches are due a check wait on one namespace snapshot. When listing the namespace takes
    longer than `SNAPSHOT_SECONDS` (12,000 AKS-sized objects on a busy API server), the snapshot still
    serves them: its age counts from its last page. Counted from its first, every waiting job listed
    the namespace again, one job per listing (1,000 jobs took minutes to start)."""
    monkeypatch.setattr(constants, "SNAPSHOT_SECONDS", 0.05)
    controller = Controller(api.kube)
    pages = controller.api.pages

    async def slow(*args: Any, **kwargs: Any) -> AsyncIterator[list[dict[str, Any]]]:
        async for page in pages(*args, **kwargs):
            await asyncio.sleep(0.03)  # five kinds: the listing takes three times the freshness
            yield page

    monkeypatch.setattr(controller.api, "pages", slow)
    pods = "v1/pods"

    async def waiting_jobs() -> None:
        await asyncio.gather(*(controller.listings.snapshot(NS, after=0.0) for _ in range(5)))

    before = api.requests("GET", pods)
    api.api.run(waiting_jobs())
    assert api.requests("GET", pods) - before == 1  # one listing for the five
