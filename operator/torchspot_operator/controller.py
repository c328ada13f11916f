"""One reconcile of one ElasticJob: read, plan (pure), act, then write the status once.

Order matters: objects are created, deleted and updated first, the status is written in
one patch at the end, and the Kubernetes Events go out only after that patch succeeded
(the JobSet controller's rule), so an event never reports something the status does
not show. One lock per job keeps the many triggers (create, update, timer, pod, etcd
object and node events) from reconciling the same job at the same time.

What a reconcile reads, and what it costs:
- the job: one GET (urgent in the client's rate limit, with creates and deletes), so
  the spec and status it starts from are the newest (a watch's copy may lag an edit and
  the operator's own last write); the status is written with the resourceVersion it was
  planned from as a precondition;
- the job's worker pods and managed etcd objects: from the operator's caches (caches.py),
  fed by watches that the API server filters by label, keyed by the owning job's uid. No
  list per reconcile; a re-created job (a new uid) never sees its predecessor's pods, and
  a same-named object someone else owns is never taken for the job's;
- nodes: from the node watch's cache (only with node handling on).
A cache lags the operator's own actions by a watch event, so the controller keeps
*expectations*, as Kubernetes' own controllers do: the objects it created and not yet seen
are counted as there, and the objects it deleted or counted are not judged again. A
cache can also hold objects deleted while its watch was closed (kopf closes the watches
of a paused standby replica and lists afresh when it resumes, which shows no deletion),
and lacks what its watch has not listed yet (a job is reconciled as soon as the job's own
watch shows it), so the first reconcile of a job by this process, one after a silence
longer than `STALE_AFTER_SECONDS` and one after this replica resumed leading reads the
namespace's objects as the API lists them (listings.py's `snapshot`, shared by the jobs of the namespace,
and served by the operator's own watches' listings when those are recent enough): the cache
takes what it lacked, and forgets what the list no longer has (a worker pod's deletion is
then counted as a watched one is). A watch that lists again (after a 410) does the same for
its kind (`Listings.listed`), as client-go's informers synthesise deletions on a relist: no
periodic re-read of every namespace is needed (it was every 5 minutes: 12,000 objects listed
and parsed at once at 1,000 jobs).

The timer (`tick`) re-plans from what the operator already knows and asks the API
nothing unless that plan has something to do: a running job that nothing happens to
costs no request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, cast

import kopf

from torchspot_operator import builders, certs, conditions, constants, lifecycle, metrics, verdicts
from torchspot_operator.builders import JobRef
from torchspot_operator.caches import Caches, Entry, compact
from torchspot_operator.conditions import CreateFailure
from torchspot_operator.events import INVALID_SPEC, REPLACED
from torchspot_operator.kube import Kube
from torchspot_operator.listings import Listings
from torchspot_operator.memory import JobMemory
from torchspot_operator.milestones import MilestoneReader
from torchspot_operator.nodes import NodePolicy
from torchspot_operator.nodeview import NodeView
from torchspot_operator.reconcile import ETCD_KINDS, Observed, Plan, plan
from torchspot_operator.spec import InvalidSpecError, JobSpec, Placement, parse_spec
from torchspot_operator.writes import Writes
from torchspot_trainer.rendezvous.etcd_client import EtcdTls

log = logging.getLogger(__name__)

ACTIVE_PHASES = frozenset(
    {conditions.PENDING, conditions.PHASE_RUNNING, conditions.PHASE_SCALING, conditions.PHASE_BELOW_MIN}
)
"""Phases whose jobs the timer ticks: while any exists, reconciles must keep finishing (`Controller.alive`)."""

ETCD_POD_READ_SECONDS = 60.0
"""How often a job's etcd pods are read while its Deployment has none available (the Stalled cause)."""


@dataclass
class _JobLock:
    """A job's lock and how many reconciles hold it or wait for it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class Controller:
    """Reconciles jobs through one API session; `now` is injectable for tests of time.

    :param etcd_default: where managed etcds go when a job says nothing (the chart's
        `etcd.defaultPlacement`); None: wherever the scheduler puts them.
    :param resolve: maps a rendezvous address to a reachable one (see `MilestoneReader`).
    :param node_handling: move workers off bad nodes at once (`constants.NODE_HANDLING_ENV`).
    :param caches: the pods and etcd objects the watches showed (handlers.py feeds them); empty if None.
    """

    def __init__(
        self,
        api: Kube,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        *,
        etcd_default: Placement | None = None,
        resolve: Callable[[str], str] | None = None,
        node_handling: bool = True,
        node_policy: NodePolicy | None = None,
        etcd_image: str = constants.ETCD_IMAGE,
        etcd_pull_secrets: tuple[str, ...] = (),
        caches: Caches | None = None,
        operator: tuple[str, tuple[tuple[str, str], ...]] | None = None,
        operator_certificates: certs.OperatorCertificates | None = None,
    ) -> None:
        self.api = api
        self.operator_certificates = operator_certificates or certs.operator_certificates()
        """The operator's CA and client pair (certs.py): from its Secret in a cluster (handlers.py), else
        made for this process."""
        self.node_policy = node_policy or NodePolicy()
        self.etcd_image = etcd_image
        self.etcd_pull_secrets = etcd_pull_secrets
        self.relisted_at = 0.0
        """When this replica last resumed leading (monotonic): every job is verified after (its watches'
        events were not acted on while it stood by)."""
        self.operator = operator
        """This operator's pod namespace and labels, which each job's etcd NetworkPolicy admits."""
        self.node_handling = node_handling
        self.now = now
        self.etcd_default = etcd_default
        self.milestones = MilestoneReader(resolve) if resolve is not None else MilestoneReader()
        self.caches = caches or Caches()
        self.listings = Listings(api, self.caches, self._missed)
        """The watches' listings and the namespaces' snapshots (listings.py): what a job's check reads."""
        self.writes = Writes(api, self.caches, self.operator_certificates)
        """A reconcile's creates, deletes, updates and status (writes.py)."""
        self.node_view = NodeView(api, self.node_policy, now)
        """The nodes (nodeview.py): the node watch feeds it (handlers.py), each reconcile reads it."""
        self._memory: dict[tuple[str, str], JobMemory] = {}
        self._locks: dict[tuple[str, str], _JobLock] = {}
        self._queued: set[tuple[str, str]] = set()
        """Jobs with a reconcile waiting for the job's lock (`reconcile`)."""
        self._versions: dict[str, str] = {}
        """The resourceVersion of each watched object (by uid) whose event last led to a reconcile."""
        self.phases: dict[tuple[str, str], str] = {}
        """Each job's phase as last written (`torchspot_jobs{phase}`)."""
        self.paused = False
        """Whether kopf's peering pauses this replica in favour of another (`pause`)."""
        self.recoveries = metrics.Recoveries()
        self.last_reconcile = time.monotonic()
        """When a reconcile or a tick last finished (monotonic): the liveness rule's clock."""

    def _spec(self, body: Mapping[str, Any]) -> JobSpec:
        """The job's spec with the operator's defaults (etcd placement, image, pull secrets)."""
        return parse_spec(
            body.get("spec") or {},
            etcd_default=self.etcd_default,
            etcd_image=self.etcd_image,
            etcd_pull_secrets=self.etcd_pull_secrets,
        )

    @contextlib.asynccontextmanager
    async def _lock(self, namespace: str, name: str) -> AsyncIterator[None]:
        """Hold the job's lock. It is dropped with its last user once the job is forgotten, never while
        another waits on it: a job re-created under its name at once could otherwise be reconciled
        twice at the same time (one waiter on the dropped lock, one on a new one)."""
        key = (namespace, name)
        held = self._locks.setdefault(key, _JobLock())
        held.users += 1
        try:
            async with held.lock:
                yield
        finally:
            held.users -= 1
            if held.users == 0 and key not in self._memory:
                self._locks.pop(key, None)

    async def reconcile(self, namespace: str, name: str) -> Plan | None:
        """Bring one job's objects and status in line with its spec; None if the job is gone or invalid,
        or if a reconcile of the job is already waiting its turn: that one reads the job and the indices
        when it starts, so it covers this trigger too (a work queue's dedupe: a burst of pod events for a
        job queues one reconcile, not one each)."""
        key = (namespace, name)
        if key in self._queued:
            return None
        self._queued.add(key)
        async with self._lock(namespace, name):
            self._queued.discard(key)  # from here on, a new trigger queues another reconcile
            return await self._reconcile(namespace, name, await self._read(namespace, name))

    async def _read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The job as a reconcile starts from: read afresh, so a spec edited a moment before an eviction
        makes the replacement from the new template (a watch's copy may lag both the edit and the
        operator's own last status write). The read is urgent in the client's rate limit, as creates
        and deletes are (`kube.TokenBucket`): a reconcile's way to its creates never queues behind
        other jobs' status writes."""
        return await self.api.get(constants.API_VERSION, constants.PLURAL, namespace, name, urgent=True)

    def job_news(self, body: Mapping[str, Any], *, deleted: bool) -> bool:
        """Whether a job's watch event is a reason to reconcile it: the job is new to this process (or a new
        incarnation of its name), its spec changed (`metadata.generation`), it is being deleted or gone.
        A status write (the operator's own, or another replica's) is not."""
        meta = body.get("metadata") or {}
        memory = self._memory.get((str(meta.get("namespace", "")), str(meta.get("name", ""))))
        if deleted or meta.get("deletionTimestamp") or memory is None or memory.uid != meta.get("uid"):
            return True
        return int(meta.get("generation") or 0) != memory.generation

    def pause(self, ahead: list[str]) -> None:
        """Note whether kopf's peering pauses this replica (`ahead`: the live peers of higher priority).
        Paused, it reports no job phases (the leader does) and forgets them, so a job deleted meanwhile
        does not stay counted; the reconciles after it resumes write them again."""
        paused = bool(ahead)
        if paused and not self.paused:
            log.info("this replica is a standby: %s leads", ", ".join(ahead))
            self.phases.clear()
        elif self.paused and not paused:
            log.info("this replica leads now")
            self.last_reconcile = time.monotonic()  # the liveness clock starts again
            self.relisted_at = time.monotonic()  # what changed while paused was not seen: every job is checked
        self.paused = paused

    def alive(self) -> bool:
        """False when reconciles have stalled (see metrics.py): the liveness probe fails then."""
        active = sum(1 for phase in self.phases.values() if phase in ACTIVE_PHASES)
        return not metrics.stalled(active, self.last_reconcile)

    def _measure(
        self, key: tuple[str, str], old: Mapping[str, Any], decided: Plan, posted: list[tuple[str, str, str]]
    ) -> None:
        """Metrics of one reconcile's outcome (metrics.py)."""
        new = decided.status
        self.phases[key] = str(new.get("phase", ""))
        metrics.EVICTIONS.labels(*key).inc(max(0, int(new.get("evictions", 0)) - int(old.get("evictions", 0))))
        metrics.FAILURES.labels(*key).inc(max(0, int(new.get("failures", 0)) - int(old.get("failures", 0))))
        metrics.REPLACEMENTS.labels(*key).inc(sum(1 for _, reason, _ in posted if reason == REPLACED.name))
        reached, started = new.get("reachedMinAt"), new.get("startTime")
        if reached and started and not old.get("reachedMinAt"):
            waited = conditions.parse_timestamp(str(reached)) - conditions.parse_timestamp(str(started))
            metrics.PENDING.labels(*key).observe(max(0.0, waited.total_seconds()))
        self.recoveries.update(key, old, new)

    async def tick(self, namespace: str, name: str) -> Plan | None:
        """The timer: re-plan from what is known, without asking the API; reconcile only if it is due.

        Clocks (the start-up timeout, the below-minimum grace, a deadline, a backoff) and
        the run's milestones change the plan without any event; a job they leave
        as it was costs nothing here.
        """
        async with self._lock(namespace, name):
            memory = self._memory.get((namespace, name))
            if memory is not None and memory.body is not None and not self._silent(memory):
                if self._unverified(memory):
                    await self._verify(namespace, memory)  # a shared list: a few requests per namespace
                memory.seen_at = time.monotonic()
                try:
                    spec = self._spec(memory.body)
                except InvalidSpecError:
                    return None
                dry = plan(await self._observe(memory.body, spec, memory))
                memory.applied.update(dry.settled)
                old = memory.body.get("status") or {}
                if not dry.acts() and not _changed(old, dry.status):
                    self.last_reconcile = time.monotonic()
                    return dry
                log.debug(
                    "job %s/%s: the timer found work: acts %s, status keys %s", namespace, name, dry.acts(),
                    sorted(k for k, v in dry.status.items() if old.get(k) != v),
                )  # fmt: skip
            return await self._reconcile(namespace, name, await self._read(namespace, name))

    async def _reconcile(self, namespace: str, name: str, body: dict[str, Any] | None) -> Plan | None:
        started = time.monotonic()
        try:
            return await self._reconcile_timed(namespace, name, body)
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            raise
        finally:
            metrics.RECONCILE.observe(time.monotonic() - started)
            self.last_reconcile = time.monotonic()

    def _remember(self, namespace: str, name: str, uid: str) -> JobMemory:
        """The memory of this incarnation of the job: new for a new job, or one re-created under the name
        (its predecessor's etcd client, which holds the predecessor's certificate, is closed)."""
        memory = self._memory.get((namespace, name))
        if memory is None or memory.uid != uid:
            if memory is not None:
                self.milestones.close_job(memory.uid)
            memory = self._memory[(namespace, name)] = JobMemory(uid)
        return memory

    async def _reconcile_timed(
        self, namespace: str, name: str, body: dict[str, Any] | None, *, again: bool = False
    ) -> Plan | None:
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._forget(namespace, name)
            return None
        meta = body["metadata"]
        memory = self._remember(namespace, name, str(meta.get("uid", "")))
        memory.body = compact(body)  # kept until the next read: a thousand jobs' templates share their strings
        memory.generation = int(meta.get("generation") or 0)
        if self._silent(memory) or self._unverified(memory):
            await self._verify(namespace, memory)
        memory.seen_at = time.monotonic()
        old: Mapping[str, Any] = body.get("status") or {}
        job = JobRef(name, namespace, memory.uid, resumes=int(old.get("resumes", 0)))
        now = self.now()
        try:
            spec = self._spec(body)
        except InvalidSpecError as exc:
            new = conditions.invalid(old.get("conditions") or [], exc.problems, now, generation=memory.generation)
            if _changed(old, new):
                await self.writes.write_status(job, memory, new, _version(body))
            if old.get("phase") != conditions.PHASE_INVALID:  # said once, not at every reconcile
                _event(body, *INVALID_SPEC.event(str(exc)))
            self.phases[(namespace, name)] = conditions.PHASE_INVALID
            return None
        seen = await self._observe(body, spec, memory, now=now)
        decided = plan(seen)
        memory.applied.update(decided.settled)
        if decided.status.get("phase") in conditions.FINISHED_PHASES:
            self.milestones.forget(str(old.get("runId", job.run_id)))
        vanished = list(memory.vanished)
        events, created = await self.writes.act(job, decided, memory, now)
        events += [said for key, said in decided.announced.items() if key in created]
        failures = self._failures(memory)
        if failures != list(seen.create_failures):
            # What the API just refused (or forgot) changes more than ReplicaFailure: WaitingForCapacity
            # says why the job waits. The status is planned again from the same view, so one write says
            # both; the first plan's creates and deletes are done, this one's are not acted on.
            decided.status = plan(replace(seen, create_failures=failures)).status
        if memory.secret_made and not spec.rdzv_endpoint and old.get("etcdSecret") != job.tls_secret:
            decided.status["etcdSecret"] = job.tls_secret  # made (or found) for this job: see _secret
        written = not _changed(old, decided.status) or await self.writes.write_status(
            job, memory, decided.status, _version(body)
        )
        if not written:
            self._unwritten(body, decided, memory, vanished, events)
            if again:  # unchanged: no write, no watch event; changed meanwhile twice: the next event retries
                return None
            fresh = await self.api.get(constants.API_VERSION, constants.PLURAL, namespace, name)
            return await self._reconcile_timed(namespace, name, fresh, again=True)
        await self.writes.keep(job, decided)  # after the count is written: a kept pod is never counted again
        for kind, reason, message in [*decided.events, *events]:
            _event(body, kind, reason, message)
        if decided.status.get("phase") != old.get("phase"):
            log.info("job %s/%s: phase %s", namespace, name, decided.status.get("phase"))
        self._measure((namespace, name), old, decided, events)
        return decided

    async def _observe(
        self, body: Mapping[str, Any], spec: JobSpec, memory: JobMemory, *, now: datetime | None = None
    ) -> Observed:
        """What the plan sees: the job, the pods and etcd objects it owns (indices plus expectations), nodes,
        progress. Reads no API but, with node handling on, a node the watch has not shown (yet)."""
        meta = body["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
        old: Mapping[str, Any] = body.get("status") or {}
        job = JobRef(name, namespace, memory.uid, resumes=int(old.get("resumes", 0)), operator=self.operator)
        if memory.built_for != (memory.generation, job.resumes):  # another build: nothing is known to hold it
            memory.applied.clear()
            memory.built_for = (memory.generation, job.resumes)
        pods = self._pods(namespace, memory)
        etcd = self._etcd(namespace, memory)
        self._prune(memory, pods, etcd.values())
        bound = {str(p["spec"]["nodeName"]) for p in pods if p.get("spec", {}).get("nodeName")}
        self.node_view.bind((namespace, name), bound)
        seen_nodes: dict[str, Mapping[str, Any]] = {}
        if bound and self.node_handling:  # the node watch's first listing, not a GET per worker's node
            await self.listings.first_of([("Node", None)], constants.NODE_LIST_WAIT_SECONDS)
        for node_name in bound if self.node_handling else ():
            node = self.node_view.get(node_name) or await self.node_view.read(node_name)
            if node is not None:
                seen_nodes[node_name] = node
        admitted = self.node_view.admit(pods, seen_nodes, now or self.now()) if self.node_handling else set()
        finished = old.get("phase") in conditions.FINISHED_PHASES
        milestones: dict[str, Any] = {}
        if not finished:
            where = (builders.rdzv_endpoint(job, spec), str(old.get("runId", job.run_id)))
            tls = None if spec.rdzv_endpoint else self._etcd_client_tls()
            if any(verdicts.run_completed(p) for p in pods):  # the run's last word
                milestones = await self.milestones.fresh(*where, tls, job=memory.uid)
            else:
                milestones = self.milestones.latest(*where, tls, job=memory.uid, max_age=spec.stall_timeout_seconds / 4)
        asked = not finished and not spec.rdzv_endpoint and not milestones.get("reachable")
        if asked and lifecycle.quiet_too_long(old, spec, now or self.now()):  # a stall's cause is wanted
            await self._read_etcd_pods(namespace, name, etcd.get("Deployment"), memory)
        refusal = memory.refusal
        return Observed(
            job, spec, old, pods, seen_nodes, etcd, now or self.now(), milestones, self.node_handling,
            node_policy=self.node_policy, admitted_nodes=frozenset(admitted),
            creates_held_until=None if refusal is None else refusal.until,
            etcd_pods=list(memory.etcd_pods),
            accounted=frozenset(memory.accounted), vanished=list(memory.vanished),
            create_failures=self._failures(memory),
            names_in_use=self.caches.names(namespace, name), applied=dict(memory.applied),
            generation=memory.generation,
        )  # fmt: skip

    @staticmethod
    def _failures(memory: JobMemory) -> list[CreateFailure]:
        """What the status's ReplicaFailure says: names taken, and the refusals (one entry, a count)."""
        found = list(memory.failures.values())
        return found if memory.refusal is None else [*found, memory.refusal.failure()]

    async def _read_etcd_pods(
        self, namespace: str, name: str, deployment: Mapping[str, Any] | None, memory: JobMemory
    ) -> None:
        """Read the managed etcd's pods while its Deployment has none available (at most once a minute),
        so a stall can name why: an image pull refused, a pod unschedulable... Only for a job quiet
        for longer than its stall timeout: a job that trains costs no request here."""
        available = int(((deployment or {}).get("status") or {}).get("availableReplicas") or 0)
        if deployment is None or available >= 1:
            memory.etcd_pods = []
            return
        if time.monotonic() - memory.etcd_pods_at < ETCD_POD_READ_SECONDS:
            return
        memory.etcd_pods_at = time.monotonic()
        labels = {constants.LABEL_JOB: name, constants.LABEL_ROLE: constants.ROLE_ETCD}
        memory.etcd_pods = await self.api.list("v1", "Pod", namespace, labels)

    def _silent(self, memory: JobMemory) -> bool:
        """Whether this process never looked at the job, or not for a while (a paused standby, a stall): the
        job as remembered may be out of date, and its indices must be checked against the API."""
        return memory.seen_at == 0.0 or time.monotonic() - memory.seen_at > constants.STALE_AFTER_SECONDS

    def _unverified(self, memory: JobMemory) -> bool:
        """Whether the job's caches are due a check against the API: never checked since this replica
        resumed leading."""
        return memory.verified_at < self.relisted_at

    def _missed(self, gone: list[Entry]) -> None:
        """Objects a list showed gone whose deletion no watch reported: a worker pod is counted as deleted
        by someone else; a taken etcd object's name may be free now."""
        for entry in gone:
            if entry.owner is None:
                continue
            log.info(
                "job %s/%s: the watch missed the deletion of %s %s", entry.namespace, entry.owner[0], entry.kind,
                entry.name,
            )  # fmt: skip
            if entry.kind == "Pod":
                self.pod_deleted(entry.namespace, entry.owner[0], entry.owner[1], entry.value)
            else:
                self.object_deleted(entry.namespace, entry.owner[0], entry.kind, entry.name)

    async def _verify(self, namespace: str, memory: JobMemory) -> None:
        """Check the cache against the API for this job (the namespace's snapshot, taken after the job's last
        create and the last relist)."""
        snapshot = await self.listings.snapshot(namespace, max(memory.created_at, self.relisted_at))
        memory.verified_at = snapshot.started  # jobs checked together fall due together: one list serves them

    def _cached(self, kind: str, namespace: str, memory: JobMemory) -> list[dict[str, Any]]:
        """What the cache holds of a kind for the job (copies: a plan may edit them)."""
        return [dict(o) for o in self.caches.owned(kind, namespace, memory.uid)]

    def _pods(self, namespace: str, memory: JobMemory) -> list[dict[str, Any]]:
        """The job's worker pods: the cache's, plus those created and not yet cached (expectations)."""
        indexed = self._cached("Pod", namespace, memory)
        return [*indexed, *self._expected(memory, "Pod", {p["metadata"]["name"] for p in indexed})]

    @staticmethod
    def _expected(memory: JobMemory, kind: str, indexed: set[str]) -> list[dict[str, Any]]:
        """Objects of a kind the operator created that the cache does not show yet (expectations);
        forgotten once it does, or after `EXPECTATION_SECONDS` (then the watch lost them)."""
        found = []
        clock = time.monotonic()
        for key, (created, at) in list(memory.created.items()):
            made, name = key.split("/", 1)
            if made != kind:
                continue
            if name in indexed or clock - at > constants.EXPECTATION_SECONDS:
                del memory.created[key]
            else:
                found.append(created)
        return found

    def _etcd(self, namespace: str, memory: JobMemory) -> dict[str, Mapping[str, Any]]:
        """The managed etcd's objects this job owns, by kind."""
        found: dict[str, Mapping[str, Any]] = {}
        for _, kind in ETCD_KINDS:
            indexed = self._cached(kind, namespace, memory)
            for obj in [*indexed, *self._expected(memory, kind, {o["metadata"]["name"] for o in indexed})]:
                found[kind] = obj
        return found

    @staticmethod
    def _prune(memory: JobMemory, pods: Iterable[Mapping[str, Any]], etcd: Iterable[Mapping[str, Any]]) -> None:
        """Forget counted or deleted objects that are gone from the caches (and the counted vanished pods)."""
        present = {str(o.get("metadata", {}).get("uid", "")) for o in [*pods, *etcd]}
        clock = time.monotonic()
        for uid, at in list(memory.accounted.items()):
            if uid not in present and clock - at > constants.EXPECTATION_SECONDS:
                del memory.accounted[uid]
        for uid, at in list(memory.deleted.items()):
            if uid not in present and clock - at > constants.EXPECTATION_SECONDS:
                del memory.deleted[uid]

    def _etcd_client_tls(self) -> EtcdTls:
        """How the operator reaches every managed etcd: its own client certificate, and the operator CA
        that signed each etcd's server certificate (certs.py)."""
        ours = self.operator_certificates
        return EtcdTls(ours.ca.cert, ours.client.cert, ours.client.key)

    @staticmethod
    def _unwritten(
        body: Mapping[str, Any],
        decided: Plan,
        memory: JobMemory,
        vanished: list[dict[str, Any]],
        events: list[tuple[str, str, str]],
    ) -> None:
        """A status the API refused (the job changed meanwhile): nothing this plan counted was written, so
        those pods are judged again from the status as it is now (its `counted` names what another
        writer counted: nothing is counted twice); what was done (created, refused) is still said."""
        for uid in decided.accounted:
            memory.accounted.pop(uid, None)
        memory.vanished = [*vanished, *memory.vanished]
        for kind, reason, message in events:
            _event(body, kind, reason, message)

    def _forget(self, namespace: str, name: str) -> None:
        self.phases.pop((namespace, name), None)
        self.recoveries.forget((namespace, name))
        metrics.forget_job(namespace, name)
        memory = self._memory.pop((namespace, name), None)
        self.node_view.forget((namespace, name))
        if memory is not None:
            self.milestones.close_job(memory.uid)
        if memory is not None and memory.body is not None:
            self.milestones.forget(str((memory.body.get("status") or {}).get("runId", "")))

    def news(self, obj: Mapping[str, Any], kind: str | None) -> bool:
        """Whether a watch event brings a version of an object not seen before (a deletion always does).

        A watch that is re-established without a resourceVersion (a relist after the API
        server compacted the watch's history; kmock, under the lab's emulator, did on every
        reconnect) replays every object as ADDED: without this, each replay reconciled every job at once.
        """
        meta = obj.get("metadata", {})
        uid, version = str(meta.get("uid", "")), str(meta.get("resourceVersion", ""))
        if kind == "DELETED":
            self._versions.pop(uid, None)
            return True
        if not version or self._versions.get(uid) != version:
            self._versions[uid] = version
            return True
        return False

    def pod_deleted(self, namespace: str, job: str, job_uid: str, pod: Mapping[str, Any]) -> None:
        """A worker pod is gone (its watch's DELETED event): if the operator neither deleted nor counted
        it, someone else did, and the next reconcile counts it as an eviction."""
        memory = self._memory.get((namespace, job))
        uid = str(pod.get("metadata", {}).get("uid", ""))
        if memory is not None and memory.uid == job_uid and uid not in memory.accounted and uid not in memory.deleted:
            memory.vanished.append(dict(pod))

    def object_deleted(self, namespace: str, job: str, kind: str, name: str) -> None:
        """A managed etcd object of a job of this name went (a predecessor's, collected): if its name was
        found taken, try again at once instead of after `NAME_RETRY_SECONDS`."""
        memory = self._memory.get((namespace, job))
        if memory is not None:
            memory.failures.pop(f"{kind}/{name}", None)

    async def expire(self, namespace: str, name: str, uid: str) -> None:
        """Delete a finished job whose ttlSecondsAfterFinished ran out (only this incarnation: by uid)."""
        log.info("job %s/%s: ttlSecondsAfterFinished reached, deleting it", namespace, name)
        await self.api.delete(constants.API_VERSION, constants.PLURAL, namespace, name, uid=uid)


def _version(body: Mapping[str, Any] | None) -> str:
    return str(((body or {}).get("metadata") or {}).get("resourceVersion", ""))


def _changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether writing `new` (a merge patch of the status) would change the stored status."""
    return any(old.get(key) != value for key, value in new.items())


def _event(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    kopf.event(kopf.Body(cast(kopf.RawBody, body)), type=kind, reason=reason, message=message)
