"""What the run itself reports (rendezvous round, last committed checkpoint), read from the job's etcd.

The agents and trainer rank 0 write two small keys (trainer/torchspot_trainer/rendezvous/milestones.py).
Reading them must never slow a reconcile: the etcd client is synchronous, the
managed etcd may not be up yet, and a name may not resolve. So `latest()` answers at
once from a cache and starts at most one background refresh per job; the next
reconcile (the timer's, within seconds) writes what it found into the status.

Reading must not cost what the jobs' count multiplies either: the reads share a budget
(`constants.MILESTONE_READS_PER_SECOND`) and at most `constants.MILESTONE_CHANNELS` clients
stay open (a gRPC channel per run was the largest thing a 1,000-job operator held).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torchspot_operator import constants
from torchspot_trainer.rendezvous import milestones
from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError, EtcdTls
from torchspot_trainer.rendezvous.settings import parse_endpoint

log = logging.getLogger(__name__)


class MilestoneReader:
    """Caches each run's status records; refreshes them in the background, within a read budget, through
    a bounded set of open etcd clients.

    :param resolve: turns a job's rendezvous address into one this process can reach.
        In a cluster the Service name resolves by DNS and this is the identity; the lab's
        sandbox, which runs each etcd on a loopback port, passes its own mapping.
    :param reads_per_second: the budget across all runs (`constants.MILESTONE_READS_PER_SECOND`).
    :param channels: how many clients stay open (`constants.MILESTONE_CHANNELS`).
    """

    def __init__(
        self,
        resolve: Callable[[str], str] = lambda endpoint: endpoint,
        *,
        reads_per_second: float = constants.MILESTONE_READS_PER_SECOND,
        channels: int = constants.MILESTONE_CHANNELS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolve = resolve
        self._reads_per_second = reads_per_second
        self._channels = channels
        self._clock = clock
        self._clients: OrderedDict[tuple[str, str], EtcdClient] = OrderedDict()
        """By (job uid, address), least recently used first: a job re-created under its name has a new CA
        and certificate."""
        self._in_use: dict[tuple[str, str], int] = {}
        """Clients a read holds now (never closed under it)."""
        self._lock = threading.Lock()
        """The reader threads share `_clients`."""
        self._cache: dict[str, dict[str, Any]] = {}
        self._read_at: dict[str, float] = {}
        """When each run's last read started (the clock's time)."""
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._readers = ThreadPoolExecutor(constants.MILESTONE_READERS, thread_name_prefix="etcd-read")
        """Its own threads: a read of a blackholed etcd blocks one for seconds, and asyncio's default
        executor is also where logins and certificates are made."""

    def latest(
        self, endpoint: str, run_id: str, tls: EtcdTls | None = None, *, job: str = "", max_age: float | None = None
    ) -> dict[str, Any]:
        """The records seen so far for a run (maybe none yet), and a refresh started if one is due.

        `tls`: the job's client certificate, for its managed etcd (mutual TLS); `job`: the job's uid,
        which the etcd client is kept under; `max_age`: how old the run's last read may grow whatever the
        budget (a quarter of its stall timeout: the stall rule must see progress it made). The records
        carry `reachable`: whether the last read reached the etcd (None before the first read ended)."""
        task = self._refreshing.get(run_id)
        if (task is None or task.done()) and self._due(run_id, max_age):
            self._read_at[run_id] = self._clock()
            refresh = self._refresh(endpoint, run_id, tls, job)
            self._refreshing[run_id] = asyncio.get_running_loop().create_task(refresh)
        return dict(self._cache.get(run_id, {}))

    async def fresh(self, endpoint: str, run_id: str, tls: EtcdTls | None = None, *, job: str = "") -> dict[str, Any]:
        """The records as they stand now: a read awaited (within twice MILESTONE_TIMEOUT) whatever the budget,
        after any read under way. For a run whose worker has just exited 0: its last records (the final
        checkpoint, written as its loop ended) would otherwise wait for a read that never comes, since a
        finished job's are not read."""
        task = self._refreshing.get(run_id)
        if task is not None and not task.done():
            await asyncio.wait([task])
        self._read_at[run_id] = self._clock()
        await self._refresh(endpoint, run_id, tls, job)
        return dict(self._cache.get(run_id, {}))

    def _due(self, run_id: str, max_age: float | None) -> bool:
        """Never read: now. Else once the budget's spacing has passed (runs / reads a second, so every
        run is read in turn), or `max_age`, whichever comes first."""
        last = self._read_at.get(run_id)
        if last is None:
            return True
        spacing = len(self._read_at) / self._reads_per_second
        if max_age is not None:
            spacing = min(spacing, max_age)
        return self._clock() - last >= spacing

    async def _refresh(self, endpoint: str, run_id: str, tls: EtcdTls | None, job: str) -> None:
        try:
            read = asyncio.get_running_loop().run_in_executor(self._readers, self._read, endpoint, run_id, tls, job)
            found = await asyncio.wait_for(read, milestones.MILESTONE_TIMEOUT * 2)
        except (EtcdError, TimeoutError, ValueError) as exc:
            log.debug("run %s: no milestones from etcd at %s yet (%s)", run_id, endpoint, exc)
            self._cache[run_id] = {**self._cache.get(run_id, {}), "reachable": False}
            return
        self._cache[run_id] = {**found, "reachable": True}

    def _read(self, endpoint: str, run_id: str, tls: EtcdTls | None, job: str) -> dict[str, Any]:
        """One read through the job's client (opened if closed); a client whose read failed is closed (a
        channel to an etcd not up yet, or gone, only retries in the background)."""
        address = self._resolve(endpoint)  # may change (a sandbox maps it once the etcd is up): key by it
        key = (job, address)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                host, port = parse_endpoint(address)
                client = self._clients[key] = EtcdClient(
                    host, port, request_timeout=milestones.MILESTONE_TIMEOUT, tls=tls
                )
            self._clients.move_to_end(key)
            self._in_use[key] = self._in_use.get(key, 0) + 1
            idle = [k for k in self._clients if not self._in_use.get(k)]
            closing = [self._clients.pop(k) for k in idle[: max(0, len(self._clients) - self._channels)]]
        for old in closing:
            old.close()
        try:
            return milestones.read(client, run_id)
        except EtcdError:
            with self._lock:
                failed = self._clients.get(key) is client and self._in_use[key] == 1  # no other read holds it
                if failed:
                    del self._clients[key]
            if failed:
                client.close()
            raise
        finally:
            with self._lock:
                self._in_use[key] -= 1
                if not self._in_use[key]:
                    del self._in_use[key]

    def close_job(self, job: str) -> None:
        """Close the etcd clients of a job (by uid) that is gone or was re-created."""
        with self._lock:
            closing = [self._clients.pop(k) for k in [k for k in self._clients if k[0] == job]]
        for client in closing:
            client.close()

    def forget(self, run_id: str) -> None:
        """Drop a finished run's cache."""
        self._cache.pop(run_id, None)
        self._read_at.pop(run_id, None)
        task = self._refreshing.pop(run_id, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        """Close every etcd connection."""
        for task in self._refreshing.values():
            task.cancel()
        with self._lock:
            closing = list(self._clients.values())
            self._clients.clear()
        for client in closing:
            client.close()
        self._readers.shutdown(wait=False, cancel_futures=True)
