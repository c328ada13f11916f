"""The operator's own caches of the objects it watches: worker pods and managed etcd objects, by job.

Why not kopf's `@kopf.index`: kopf holds every handler back until every index has seen
its first full listing, and during that listing each object's indexing toggle wakes every
waiter of the whole set, so a start with 8,000 pods costs O(N^2) wake-ups (at a thousand jobs the
operator never converged). Here the
watch events (handlers.py) feed plain dictionaries, and the namespace lists the controller
takes anyway to check its caches (`Controller._snapshot`) fill them too: a job reconciled
before its pods' watch has listed them reads them from that list, never from an empty cache.

What is kept is what the decisions read: a pod's projection (`verdicts.project`, a few
hundred bytes instead of about 23 KiB), an etcd object without its `managedFields`.

Ordering: a watch event always wins over a list that started before it (the list may be
older), a list never brings back an object whose deletion the watch reported after the list
started (`_deleted`, kept `TOMBSTONE_SECONDS`), and only an object last seen before a list
started can be found gone by it (`missing`).
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torchspot_operator import constants, verdicts

TOMBSTONE_SECONDS = 300.0
"""How long a deletion the watch reported keeps a list that started before it from restoring the
object: far longer than any list takes."""


def owner(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the ElasticJob that controls an object, from its ownerReferences; None if none does."""
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if (
            ref.get("controller")
            and ref.get("kind") == constants.KIND
            and ref.get("apiVersion") == constants.API_VERSION
        ):
            return str(ref.get("name", "")), str(ref.get("uid", ""))
    return None


SHARED_STRING_CHARS = 64
"""Strings up to this long are kept once however many objects hold them (`compact`)."""


def compact(value: Any) -> Any:
    """`value` with its keys and short strings interned (a copy; pure in effect).

    A parsed watch event owns every string it holds, so 8,000 cached pods held 8,000 copies of
    "lastTransitionTime", "PodScheduled", "True", each label and image, and 4,000 etcd objects as
    many of their Deployments' template keys: keys alone were a sixth of a projected pod (4.9 KB) and
    a quarter of an etcd object (7.1 KB; tracemalloc over the benchmark's AKS-sized objects)."""
    if isinstance(value, dict):
        return {sys.intern(key): compact(item) for key, item in value.items()}
    if isinstance(value, list):
        return [compact(item) for item in value]
    if isinstance(value, str) and len(value) <= SHARED_STRING_CHARS:
        return sys.intern(value)
    return value


def kept(kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """What the cache keeps of an object, compacted: a pod's projection, any other object without
    `managedFields`."""
    if kind == "Pod":
        projected: dict[str, Any] = compact(verdicts.project(body))
        return projected
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    whole: dict[str, Any] = compact({**body, "metadata": meta})
    return whole


@dataclass
class Entry:
    """One cached object and where it is filed."""

    kind: str
    namespace: str
    name: str
    owner: tuple[str, str] | None
    """(name, uid) of the job that controls it."""
    job: str | None
    """The job label of a worker pod (whoever owns it): the names a job must not reuse."""
    value: dict[str, Any]
    at: float
    """When the watch (or a list) last gave it (the cache's clock)."""

    @property
    def version(self) -> str:
        return str(self.value.get("metadata", {}).get("resourceVersion", ""))


class Caches:
    """Worker pods and managed etcd objects by (kind, namespace, owning job's uid), and worker pod names by
    (namespace, job label); `clock` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._entries: dict[str, Entry] = {}
        self._owned: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
        self._names: dict[tuple[str, str], dict[str, str]] = {}
        self._namespaces: dict[str, set[str]] = {}
        self._deleted: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, kind: str, body: Mapping[str, Any], *, deleted: bool = False) -> None:
        """A watch event: the object as it is now, or gone."""
        uid = str(body.get("metadata", {}).get("uid", ""))
        if not uid:
            return
        now = self.clock()
        if deleted:
            self._drop(uid)
            self._deleted[uid] = now
            self._deleted.move_to_end(uid)
            while self._deleted and now - next(iter(self._deleted.values())) > TOMBSTONE_SECONDS:
                self._deleted.popitem(last=False)
            return
        self._put(uid, kind, body, now)

    def listed(self, kind: str, items: Iterable[Mapping[str, Any]], started: float) -> list[str]:
        """Objects of a kind as a list that started at `started` gave them: cached unless the watch has
        shown them since (or their deletion). The listed uids."""
        uids = []
        for body in items:
            uid = str(body.get("metadata", {}).get("uid", ""))
            if not uid:
                continue
            uids.append(uid)
            held = self._entries.get(uid)
            if self._deleted.get(uid, -1.0) >= started or (held is not None and held.at >= started):
                continue
            self._put(uid, kind, body, started)
        return uids

    def missing(self, namespace: str, listed: set[str], started: float) -> list[Entry]:
        """Forget the namespace's objects last seen before a list that started at `started` and does not
        have them (deleted while a watch was down, or before this cache was filled); the forgotten."""
        return self._forget_unlisted(self._namespaces.get(namespace, set()), listed, started)

    def missing_of(self, kind: str, namespace: str | None, listed: set[str], started: float) -> list[Entry]:
        """`missing` for one kind, in one namespace or (None) all: what a watch's own listing that
        started at `started` no longer has (the deletions client-go's informers synthesise on a relist)."""
        held = self._entries if namespace is None else self._namespaces.get(namespace, set())
        return self._forget_unlisted((uid for uid in held if self._entries[uid].kind == kind), listed, started)

    def _forget_unlisted(self, held: Iterable[str], listed: set[str], started: float) -> list[Entry]:
        """Drop the entries of `held` (uids) a list that started at `started` lacks and that were last seen
        before it; the dropped."""
        gone = [self._entries[uid] for uid in held if uid not in listed and self._entries[uid].at < started]
        for entry in gone:
            self._drop(str(entry.value.get("metadata", {}).get("uid", "")))
        return gone

    def owned(self, kind: str, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        """The objects of a kind the job (this incarnation) controls."""
        return list(self._owned.get((kind, namespace, job_uid), {}).values())

    def names(self, namespace: str, job: str) -> frozenset[str]:
        """Names of the worker pods labelled with this job's name, whoever owns them."""
        return frozenset(self._names.get((namespace, job), {}).values())

    def _put(self, uid: str, kind: str, body: Mapping[str, Any], at: float) -> None:
        meta = body.get("metadata") or {}
        namespace = str(meta.get("namespace") or "")
        held = self._entries.get(uid)
        if held is not None and older(str(meta.get("resourceVersion", "")), held.version):
            return  # a list that read the object before the watch's last event did
        self._drop(uid)
        job = (meta.get("labels") or {}).get(constants.LABEL_JOB) if kind == "Pod" else None
        entry = Entry(kind, namespace, str(meta.get("name", "")), owner(body), job, kept(kind, body), at)
        self._entries[uid] = entry
        self._namespaces.setdefault(namespace, set()).add(uid)
        if entry.owner is not None:
            self._owned.setdefault((kind, namespace, entry.owner[1]), {})[uid] = entry.value
        if job:
            self._names.setdefault((namespace, job), {})[uid] = entry.name

    def _drop(self, uid: str) -> None:
        entry = self._entries.pop(uid, None)
        if entry is None:
            return
        _discard(self._namespaces, entry.namespace, uid)
        if entry.owner is not None:
            _discard(self._owned, (entry.kind, entry.namespace, entry.owner[1]), uid)
        if entry.job:
            _discard(self._names, (entry.namespace, entry.job), uid)


def _discard(table: dict[Any, Any], key: Any, uid: str) -> None:
    """Remove a uid from a table's set or dict under `key`, and the key once empty (no empty leftovers
    from a thousand deleted jobs)."""
    held = table.get(key)
    if held is None:
        return
    if isinstance(held, set):
        held.discard(uid)
    else:
        held.pop(uid, None)
    if not held:
        del table[key]


def older(version: str, than: str) -> bool:
    """Whether a resourceVersion is older than another. They are opaque strings to clients; the API
    server's (etcd's) and the emulator's are integers, compared as such; anything else is not older."""
    return version.isdigit() and than.isdigit() and int(version) < int(than)
