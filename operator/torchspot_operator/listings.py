"""What the operator read of the objects its jobs own, and when: its own watches' listings (at a start,
and again after a watch failed) and each namespace's snapshot (a labelled list per kind). A job's check
against the API (the controller's `_verify`) is served by whichever is newer than the job's last create,
and whatever a listing or a snapshot shows gone that no watch reported is handed to `missed` (a worker pod
deleted by someone else, counted as such).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torchspot_operator import constants
from torchspot_operator.caches import Caches, Entry
from torchspot_operator.kube import Kube
from torchspot_operator.reconcile import ETCD_KINDS

__all__ = ["OWNED_KINDS", "Listings", "Snapshot"]

OWNED_KINDS: tuple[tuple[tuple[str, str], str], ...] = (
    (("v1", "Pod"), constants.ROLE_WORKER),
    *((kind, constants.ROLE_ETCD) for kind in ETCD_KINDS),
)
"""((apiVersion, kind), the role label the API server filters by) of what the jobs own: what the
operator's own watches follow (handlers, informer.py) and what a namespace snapshot lists."""


@dataclass(frozen=True)
class Snapshot:
    """When a namespace's worker pods and managed etcd objects were last read from the API."""

    started: float
    """When its first list was sent (monotonic): it shows every create that returned before."""
    finished: float
    """When its last page came: its age counts from here. Counted from the start, a namespace whose
    lists take longer than `SNAPSHOT_SECONDS` (12,000 AKS-sized objects on a busy API) would be
    listed again for every job that waited on it, one job per listing."""


class Listings:
    """The operator's reads of what its jobs own (module docstring).

    :param api: where a snapshot lists.
    :param caches: what the watches showed, which a listing or a snapshot completes and corrects.
    :param missed: told of the objects a listing or a snapshot showed gone that no watch reported.
    """

    def __init__(self, api: Kube, caches: Caches, missed: Callable[[list[Entry]], None]) -> None:
        self.api, self.caches, self._missed = api, caches, missed
        self.listed_at: dict[tuple[str, str | None], float] = {}
        """When the operator's own watch of a kind last listed it in a namespace (None: all), as it
        started (monotonic): a listing after a job's last create serves as the job's check."""
        self._first: dict[tuple[str, str | None], asyncio.Event] = {}
        """The watches whose first listing is under way (`started`), set when it ends."""
        self._snapshots: dict[str, Snapshot] = {}
        """Per namespace, the last list of what the jobs there own (`snapshot`)."""
        self._locks: dict[str, asyncio.Lock] = {}

    def started(self, kind: str, namespace: str | None) -> None:
        """The operator's own watch of a kind is starting (handlers.py): the jobs' checks wait for its first
        listing (`snapshot`) rather than list the same objects beside it."""
        self._first.setdefault((kind, namespace), asyncio.Event())

    def listed(self, kind: str, namespace: str | None, uids: set[str], started: float) -> None:
        """The operator's own watch of a kind listed it (informer.py): what the cache holds and the list
        lacks was deleted while no watch was open (a worker pod counts as deleted by someone else), and
        the listing serves as a fresh read for the jobs' checks (`snapshot`)."""
        self._missed(self.caches.missing_of(kind, namespace, uids, started))
        self.listed_at[kind, namespace] = started
        self.ended(kind, namespace)

    def watching(self, kind: str, namespace: str | None) -> bool:
        """Whether the operator's own watch of a kind in a namespace (None: all) was started."""
        return (kind, namespace) in self._first

    async def first_of(self, watches: Iterable[tuple[str, str | None]], timeout: float) -> None:
        """Wait, at most `timeout` seconds, for the first listing of those of `watches` started and not
        listed yet (a watch never started is not waited for)."""
        events = [self._first[key] for key in watches if key in self._first]
        pending = [event.wait() for event in events if not event.is_set()]
        if pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*pending), timeout)

    def ended(self, kind: str, namespace: str | None) -> None:
        """A watch's listing ended: no check waits for it any longer."""
        self._first.setdefault((kind, namespace), asyncio.Event()).set()

    async def snapshot(self, namespace: str, after: float) -> Snapshot:
        """Read what the namespace's jobs own from the API, unless the last read started after `after` and
        finished at most `SNAPSHOT_SECONDS` ago: a labelled list per kind, a page at a time (`Kube.pages`).
        The cache takes what it lacked and forgets what the API no longer has; a forgotten worker pod
        is counted as deleted by someone else, as its DELETED event would have been. Shared by every
        job of the namespace, so checking 200 jobs costs five lists, not a thousand requests."""
        async with self._locks.setdefault(namespace, asyncio.Lock()):
            # The watches' first listings serve (at a start: 12,000 objects not listed twice).
            owned = [(kind, where) for (_, kind), _ in OWNED_KINDS for where in (namespace, None)]
            await self.first_of(owned, constants.FIRST_LISTING_WAIT_SECONDS)
            found = self._snapshots.get(namespace)
            clock = time.monotonic()
            if found is not None and found.started > after and clock - found.finished <= constants.SNAPSHOT_SECONDS:
                return found
            watched = min(
                max(self.listed_at.get((kind, namespace), -1.0), self.listed_at.get((kind, None), -1.0))
                for (_, kind), _ in OWNED_KINDS
            )
            if watched > after:  # the watches' own listings are newer: nothing to read
                return Snapshot(watched, clock)
            started = self.caches.clock()
            uids: set[str] = set()
            for (api_version, kind), role in OWNED_KINDS:
                async for page in self.api.pages(api_version, kind, namespace, {constants.LABEL_ROLE: role}):
                    uids.update(self.caches.listed(kind, page, started))
            self._missed(self.caches.missing(namespace, uids, started))
            snapshot = self._snapshots[namespace] = Snapshot(clock, time.monotonic())
            return snapshot
