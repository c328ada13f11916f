"""The operator's own watches of worker pods, managed etcd objects and nodes: list, then watch from the list's
version, each object handed on as it is parsed (an informer, as client-go calls it).

Why not kopf's watches for these: kopf keeps a record for each object it has seen (14,000 at 1,000
jobs), parses and keeps whole bodies in a worker per object, and starts that worker for an object's
first event after it has gone idle with a pause that hands the event loop to every other task
(`aiotasks.Scheduler.spawn`'s `sleep(0)`). In a wave of evictions at a thousand jobs the last
eviction's event waits behind a loop turn per earlier event, each turn running the reconciles
already started: most of its time to a replacement is spent before the operator sees it. Here a
watch's lines are read and handed on in one go, and
what is kept is the projection the caches make (caches.py).

The nodes are watched the same way (handlers.py, with node handling on), keeping a few fields of each
(`nodes.project`); kopf still watches the ElasticJobs (its daemons and peering need them).

A watch that ends (the server's `WATCH_SECONDS`) is opened again from the last version seen, which
replays nothing; one that fails (410: the version is older than the server keeps; a dropped
connection; a 5xx) lists again after a backoff: the listing's objects come as `None` events, and
then the listing itself (`on_listed`), from which the controller drops what the list no longer has
(deleted while the watch was down: `Listings.listed`) and which serves as a fresh read
of the API for the jobs' checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from torchspot_operator.kube import ApiError, Kube, backoff_seconds, label_selector

log = logging.getLogger(__name__)

OnEvent = Callable[[str | None, dict[str, Any]], None]
"""What receives each object: its event type (ADDED, MODIFIED, DELETED; None: listed) and the object."""


@dataclass
class Informer:
    """One kind's labelled objects in one namespace (None: the whole cluster), handed to `on_event`."""

    api: Callable[[], Kube]
    """The controller's current API session (renewed at logins)."""
    api_version: str
    kind: str
    labels: Mapping[str, str] | str
    """The label selector: `key=value` terms, or a selector string (the node watch's setting)."""
    namespace: str | None
    on_event: OnEvent
    on_listed: Callable[[set[str], float], None] = lambda _uids, _started: None
    """Called after each complete listing with the listed uids and when the listing started
    (`time.monotonic`): what the cache holds of the kind and the list lacks was deleted meanwhile."""
    page: int | None = None
    """Objects per page of a listing (`Kube.pages`; None: `LIST_PAGE`)."""

    async def run(self) -> None:
        """List and watch until cancelled; a failure lists again after a backoff."""
        attempt = 0
        while True:
            try:
                since = await self._list()
                attempt = 0
                while True:
                    since = await self._watch(since)
            except asyncio.CancelledError:
                raise
            except (ApiError, OSError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                delay = backoff_seconds(attempt, None)
                where = f"in {self.namespace}" if self.namespace else "cluster-wide"
                gone = isinstance(exc, ApiError) and exc.status == 410
                log.log(
                    logging.INFO if gone else logging.WARNING, "watch of %s %s %s ended (%s); listing again in %.1f s",
                    self.kind, where, label_selector(self.labels) or "(every one)", exc, delay,
                )  # fmt: skip
                attempt += 1
                await asyncio.sleep(delay)

    async def _list(self) -> str:
        """Hand on every listed object, then the listing; the list's version."""
        version: list[str] = []
        started = time.monotonic()
        uids: set[str] = set()
        pages = self.api().pages(
            self.api_version, self.kind, self.namespace, self.labels, version=version, size=self.page
        )
        async for page in pages:
            for obj in page:
                obj.setdefault("kind", self.kind)  # a list's items carry no kind
                uids.add(str((obj.get("metadata") or {}).get("uid", "")))
                self.on_event(None, obj)
        self.on_listed(uids, started)
        return version[0] if version else ""

    async def _watch(self, since: str) -> str:
        """Hand on each change after `since` until the server ends the watch; the last version seen."""
        async for kind_of, obj in self.api().watch(self.api_version, self.kind, self.namespace, self.labels, since):
            since = str((obj.get("metadata") or {}).get("resourceVersion") or since)
            if kind_of != "BOOKMARK":
                self.on_event(kind_of, obj)
        return since
