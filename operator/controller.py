"""One reconcile of one ElasticJob: read, plan (pure), act, then write the status once.

Order matters: objects are created and deleted first, the status is written in one
patch at the end, and the Kubernetes Events go out only after that patch succeeded
(the JobSet controller's rule), so an event never reports something the status does
not show. One lock per job keeps the many triggers (create, update, timer, pod and
node events) from reconciling the same job at the same time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

import kopf

from torchspot.operator import builders, constants, status
from torchspot.operator.builders import JobRef
from torchspot.operator.kube import ApiError, Kube
from torchspot.operator.progress import ProgressReader
from torchspot.operator.reconcile import Observed, Plan, plan
from torchspot.operator.spec import InvalidSpecError, JobSpec, Placement, parse_spec

log = logging.getLogger(__name__)

ETCD_KINDS = (("apps/v1", "Deployment"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"))
ETCD_RECHECK = 60.0
"""Seconds a job's complete set of managed etcd objects is trusted before it is read again
(a deleted one is re-created within this; every reconcile reading three objects made the
API the bottleneck at a few hundred jobs)."""


class Controller:
    """Reconciles jobs through one API session; `now` is injectable for tests of time.

    :param etcd_default: where managed etcds go when a job says nothing (the chart's
        `etcd.defaultPlacement`); None: wherever the scheduler puts them.
    :param resolve: maps a rendezvous address to a reachable one (see `ProgressReader`).
    :param node_handling: move workers off bad nodes at once (`constants.NODE_HANDLING_ENV`).
    """

    def __init__(
        self,
        api: Kube,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        *,
        etcd_default: Placement | None = None,
        resolve: Callable[[str], str] | None = None,
        node_handling: bool = True,
    ) -> None:
        self.api = api
        self.node_handling = node_handling
        self.now = now
        self.etcd_default = etcd_default
        self.progress = ProgressReader(resolve) if resolve is not None else ProgressReader()
        self._nodes_of_job: dict[tuple[str, str], set[str]] = {}
        self._etcd_seen: dict[tuple[str, str], tuple[frozenset[str], float]] = {}
        self.nodes: dict[str, Mapping[str, Any]] = {}
        """Nodes as the node watch last saw them (reconciles read these instead of asking each time)."""
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def reconcile(self, namespace: str, name: str) -> Plan | None:
        """Bring one job's objects and status in line with its spec; None if the job is gone."""
        async with self._lock(namespace, name):
            body = await self.api.get(constants.API_VERSION, constants.PLURAL, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                self._locks.pop((namespace, name), None)
                self._nodes_of_job.pop((namespace, name), None)
                return None
            return await self._reconcile(body)

    async def _reconcile(self, body: Mapping[str, Any]) -> Plan | None:
        meta = body["metadata"]
        job = JobRef(meta["name"], meta["namespace"], meta.get("uid", ""))
        old_status: Mapping[str, Any] = body.get("status") or {}
        now = self.now()
        try:
            spec = parse_spec(job.name, body.get("spec") or {}, etcd_default=self.etcd_default)
        except InvalidSpecError as exc:
            new = status.invalid(old_status.get("conditions") or [], exc.problems, now)
            await self._write_status(job, new)
            if old_status.get("phase") != "Invalid":
                kopf.event(kopf.Body(cast(kopf.RawBody, body)), type="Warning", reason="InvalidSpec", message=str(exc))
            return None
        pods = await self.api.list("v1", "Pod", job.namespace, job.labels(constants.ROLE_WORKER))
        nodes: dict[str, Mapping[str, Any]] = {}
        bound = {str(p["spec"]["nodeName"]) for p in pods if p.get("spec", {}).get("nodeName")}
        self._nodes_of_job[(job.namespace, job.name)] = bound
        for node_name in bound:
            node = self.nodes.get(node_name)
            if node is None:  # not seen by the node watch (yet): ask
                node = await self.api.get("v1", "Node", None, node_name)
            if node is not None:
                nodes[node_name] = node
        # A job never reconciled has no etcd objects yet (creating one that exists is a no-op).
        etcd = await self._etcd_objects(job, spec) if old_status.get("phase") else frozenset()
        finished = old_status.get("phase") in status.FINISHED_PHASES
        progress = {} if finished else self.progress.latest(builders.rdzv_endpoint(job, spec), job.run_id)
        seen = Observed(job, spec, old_status, pods, nodes, frozenset(etcd), now, progress, self.node_handling)
        decided = plan(seen)
        if decided.status.get("phase") in status.FINISHED_PHASES:
            self.progress.forget(job.run_id)
        await self._act(job, decided)
        if any(old_status.get(key) != value for key, value in decided.status.items()):
            await self._write_status(job, decided.status)  # unchanged: no write, no watch event for anyone
        for kind, reason, message in decided.events:
            kopf.event(kopf.Body(cast(kopf.RawBody, body)), type=kind, reason=reason, message=message)
        if decided.status.get("phase") != old_status.get("phase"):
            log.info("job %s/%s: phase %s", job.namespace, job.name, decided.status.get("phase"))
        return decided

    async def _etcd_objects(self, job: JobRef, spec: JobSpec) -> frozenset[str]:
        """Kinds of the managed etcd's objects that exist; a complete set is trusted for `ETCD_RECHECK` s."""
        if spec.rdzv_endpoint:
            return frozenset()
        key = (job.namespace, job.name)
        seen = self._etcd_seen.get(key)
        if seen is not None and len(seen[0]) == len(ETCD_KINDS) and time.monotonic() - seen[1] < ETCD_RECHECK:
            return seen[0]
        kinds = set()
        for api_version, kind in ETCD_KINDS:
            if await self.api.get(api_version, kind, job.namespace, job.etcd_name) is not None:
                kinds.add(kind)
        self._etcd_seen[key] = (frozenset(kinds), time.monotonic())
        return frozenset(kinds)

    def observe_node(self, node: Mapping[str, Any], *, deleted: bool) -> None:
        """Keep the node cache that reconciles read (fed by the node watch)."""
        name = node.get("metadata", {}).get("name", "")
        if deleted:
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = node

    async def _act(self, job: JobRef, decided: Plan) -> None:
        for obj in decided.create:
            await self.api.create(obj)
        for delete in decided.delete:
            log.info("deleting worker pod %s/%s: %s", job.namespace, delete.name, delete.why)
            await self.api.delete("v1", "Pod", job.namespace, delete.name, delete.grace)
        if decided.create or decided.delete_etcd:
            self._etcd_seen.pop((job.namespace, job.name), None)
        if decided.delete_etcd:
            for api_version, kind in ETCD_KINDS:
                await self.api.delete(api_version, kind, job.namespace, job.etcd_name)

    async def _write_status(self, job: JobRef, new: Mapping[str, Any]) -> None:
        try:
            await self.api.patch_status(constants.API_VERSION, constants.PLURAL, job.namespace, job.name, dict(new))
        except ApiError as exc:
            if exc.status != 404:  # the job was deleted meanwhile
                raise

    def jobs_on_node(self, node_name: str) -> set[tuple[str, str]]:
        """(namespace, job) of the jobs whose workers were on a node when last reconciled.

        An index kept by reconcile rather than a cluster-wide pod list: it needs no
        API call and no permission beyond the watched namespaces.
        """
        return {key for key, nodes in self._nodes_of_job.items() if node_name in nodes}
