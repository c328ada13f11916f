"""What the run itself reports (rendezvous round, last committed checkpoint), read from the job's etcd.

The agents and trainer rank 0 write two small keys (trainer/torchspot_trainer/rendezvous/milestones.py).
Reading them must never slow a reconcile: the etcd client is synchronous, the
managed etcd may not be up yet, and a name may not resolve. So `latest()` answers at
once from a cache and starts at most one background refresh per job; the next
reconcile (the timer's, within seconds) writes what it found into the status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torchspot_operator import constants
from torchspot_trainer.rendezvous import milestones
from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError, EtcdTls
from torchspot_trainer.rendezvous.settings import parse_endpoint

log = logging.getLogger(__name__)


class MilestoneReader:
    """Caches each run's status records; refreshes them in the background.

    :param resolve: turns a job's rendezvous address into one this process can reach.
        In a cluster the Service name resolves by DNS and this is the identity; the lab's
        sandbox, which runs each etcd on a loopback port, passes its own mapping.
    """

    def __init__(self, resolve: Callable[[str], str] = lambda endpoint: endpoint) -> None:
        self._resolve = resolve
        self._clients: dict[tuple[str, str], EtcdClient] = {}
        """By (job uid, address): a job re-created under its name has a new CA and certificate."""
        self._cache: dict[str, dict[str, Any]] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._readers = ThreadPoolExecutor(constants.MILESTONE_READERS, thread_name_prefix="etcd-read")
        """Its own threads: a read of a blackholed etcd blocks one for seconds, and asyncio's default
        executor is also where logins and certificates are made."""

    def latest(self, endpoint: str, run_id: str, tls: EtcdTls | None = None, *, job: str = "") -> dict[str, Any]:
        """The records seen so far for a run (maybe none yet), and a refresh started if none runs.

        `tls`: the job's client certificate, for its managed etcd (mutual TLS); `job`: the job's uid,
        which the etcd client is kept under. The records carry `reachable`: whether the last read
        reached the etcd (None before the first read ended)."""
        task = self._refreshing.get(run_id)
        if task is None or task.done():
            refresh = self._refresh(endpoint, run_id, tls, job)
            self._refreshing[run_id] = asyncio.get_running_loop().create_task(refresh)
        return dict(self._cache.get(run_id, {}))

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
        address = self._resolve(endpoint)  # may change (a sandbox maps it once the etcd is up): key by it
        client = self._clients.get((job, address))
        if client is None:
            host, port = parse_endpoint(address)
            timeout = milestones.MILESTONE_TIMEOUT
            client = self._clients[job, address] = EtcdClient(host, port, request_timeout=timeout, tls=tls)
        return milestones.read(client, run_id)

    def close_job(self, job: str) -> None:
        """Close the etcd clients of a job (by uid) that is gone or was re-created."""
        for key in [k for k in self._clients if k[0] == job]:
            self._clients.pop(key).close()

    def forget(self, run_id: str) -> None:
        """Drop a finished run's cache."""
        self._cache.pop(run_id, None)
        task = self._refreshing.pop(run_id, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        """Close every etcd connection."""
        for task in self._refreshing.values():
            task.cancel()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._readers.shutdown(wait=False, cancel_futures=True)
