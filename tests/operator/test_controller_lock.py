"""The per-job lock (`Controller._lock`) keeps a job's reconciles one at a time, also across the job
being forgotten (deleted) and re-created under its name while others wait."""

from __future__ import annotations

import asyncio

from torchspot_operator.controller import Controller
from torchspot_operator.kube import Kube


def test_a_forgotten_jobs_lock_stays_while_reconciles_wait_on_it() -> None:
    async def scene() -> tuple[int, int]:
        controller = Controller(Kube(server="http://127.0.0.1:1", headers={}, ssl_context=True))
        inside, most = 0, 0

        async def reconcile(forget: bool) -> None:
            nonlocal inside, most
            async with controller._lock("default", "cifar"):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.01)
                if forget:  # the job was deleted: what _reconcile does then
                    controller._forget("default", "cifar")
                inside -= 1

        first = asyncio.create_task(reconcile(forget=True))
        await asyncio.sleep(0)  # it holds the lock
        waiting = asyncio.create_task(reconcile(forget=False))  # an event of the re-created job
        await asyncio.sleep(0.015)  # the first has forgotten the job and released
        late = asyncio.create_task(reconcile(forget=False))  # another event, after the forget
        await asyncio.gather(first, waiting, late)
        return most, len(controller._locks)

    most, left = asyncio.run(scene())
    assert most == 1  # never two at once
    assert left == 0  # and the lock went with its last user, the job being forgotten
