"""Desired against actual: what to create, delete, update, say and record for one ElasticJob. Pure.

`plan` takes what the controller observed (the job, the worker pods and managed etcd
objects it owns, their nodes, the time, what the run reported) and returns a `Plan`.
It is level-based: the same observation gives the same plan whether a create, an
update, a pod or node event, a resume or the timer asked for it, so repeating it
converges instead of piling up actions. The lifecycle it implements (phases,
conditions, clocks) is written down in docs/operator.md ("Lifecycle").

It combines two policies kept in their own modules: how each worker pod is judged
(verdicts.py) and the job's clocks, failure backoff, outcome and conditions (lifecycle.py);
what is its own is scaling, the managed etcd, and clean-up at the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from torchspot_operator import builders, conditions, constants, events, lifecycle, replica_groups, verdicts
from torchspot_operator.builders import JobRef
from torchspot_operator.conditions import CreateFailure
from torchspot_operator.nodes import NodePolicy
from torchspot_operator.spec import JobSpec

ETCD_KINDS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


@dataclass(frozen=True)
class Delete:
    """Delete an object the job owns; `uid` goes into the request's precondition (a same-named
    replacement is never deleted by mistake); `grace` None keeps a pod's own grace period."""

    api_version: str
    kind: str
    name: str
    uid: str
    grace: int | None
    why: str


@dataclass(frozen=True)
class Update:
    """Bring a managed etcd object the job owns in line with what the operator builds now: its build
    changed (a job edit: a merge patch against the object as stored, so a field the edit removed goes),
    or someone changed a field the operator sets (drift: a server-side apply of the whole build, which
    takes those fields back)."""

    api_version: str
    kind: str
    name: str
    patch: dict[str, Any]
    """The merge patch, or the whole object as built (an apply configuration) when `apply`."""
    apply: bool = False


@dataclass(frozen=True)
class Keep:
    """Mark a failed worker pod as counted and keep it for its logs (`constants.ANNOTATION_ACCOUNTED`)."""

    name: str
    uid: str
    verdict: str


@dataclass
class Plan:
    """What one reconcile decided."""

    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[Delete] = field(default_factory=list)
    update: list[Update] = field(default_factory=list)
    keep: list[Keep] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type, reason, message): Normal or Warning Kubernetes Events."""
    announced: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    """The Event of each planned create, by `Kind/name`: posted only if the create is made (a refused
    or skipped one says nothing, else a full quota posts a "created" Event per missing pod per try)."""
    accounted: list[str] = field(default_factory=list)
    """Uids of the pods this plan counted or deletes: never judged again."""
    refused: list[CreateFailure] = field(default_factory=list)
    """Pods the cluster refuses to the job's managed etcd Deployment (see `etcd_refusal`)."""
    settled: dict[str, str] = field(default_factory=dict)
    """Managed etcd objects (uid -> resourceVersion) found holding this plan's build: the caller adds
    them to `Observed.applied`, so they are not compared field by field again at that version."""

    def acts(self) -> bool:
        """Whether the plan changes anything in the cluster (creates, deletes, updates or counts)."""
        return bool(self.create or self.delete or self.update or self.keep or self.accounted)

    def all_events(self) -> list[tuple[str, str, str]]:
        """Every Event the plan would post if each of its creates were made."""
        return [*self.events, *self.announced.values()]


@dataclass(frozen=True)
class Observed:
    """What the controller read for one job."""

    job: JobRef
    spec: JobSpec
    status: Mapping[str, Any]
    pods: Sequence[Mapping[str, Any]]
    """The worker pods this job (this uid) owns, as the watch last reported them."""
    nodes: Mapping[str, Mapping[str, Any]]
    """The nodes the worker pods are bound to, by name (a missing name: the node is gone)."""
    etcd: Mapping[str, Mapping[str, Any]]
    """The managed etcd's objects this job owns, by kind."""
    now: datetime
    milestones: Mapping[str, Any] = field(default_factory=dict)
    """The run's milestones from its etcd: the last `round` formed and `checkpoint` committed (milestones.py)."""
    node_handling: bool = True
    """False: a bad node is not a reason to move its workers (`constants.NODE_HANDLING_ENV`)."""
    node_policy: NodePolicy = field(default_factory=NodePolicy)
    admitted_nodes: frozenset[str] = frozenset()
    """NotReady (or cordoned) nodes the controller let the plan act on: not a full disruption, and the
    cluster-wide rate limit had room (nodes.py). A worker there whose grace is over is moved off."""
    creates_held_until: datetime | None = None
    """The API refused this job's creates lately: nothing is created before this time (the refusal
    backoff, `constants.REFUSAL_BACKOFF_BASE`)."""
    etcd_pods: Sequence[Mapping[str, Any]] = ()
    """The managed etcd's pods, read only while its Deployment has none available (the Stalled cause)."""
    accounted: frozenset[str] = frozenset()
    """Pod uids already counted or deleted by the operator (terminating ones are skipped)."""
    vanished: Sequence[Mapping[str, Any]] = ()
    """Pods that disappeared without the operator deleting them (last seen bodies)."""
    create_failures: Sequence[CreateFailure] = ()
    """Objects the operator could not create lately (names taken, API refusals)."""
    names_in_use: frozenset[str] = frozenset()
    """Names of worker pods labelled with this job's name, whoever owns them (a predecessor's too)."""
    applied: Mapping[str, str] = field(default_factory=dict)
    """The resourceVersion at which each etcd object (by uid) is known to hold the current build: the
    version after the operator's last write of it (a field that differs then is the API server's own
    way of storing it, a quantity normalised, not drift, and is not applied again and again), or one
    a plan found holding it (`Plan.settled`). The caller forgets them all when the build's inputs
    change (the job's generation or resumes): while every object is known at its version, the plan
    builds nothing (a timer tick of 1,000 jobs spent most of its time building and comparing them)."""
    generation: int = 0
    """The job's metadata.generation: the spec this observation judged (`status.observedGeneration`)."""


class _Counts:
    """The status counters, starting from the old status."""

    def __init__(self, old: Mapping[str, Any]) -> None:
        self.evictions = int(old.get("evictions", 0))
        self.restarts = int(old.get("restarts", 0))
        self.failures = int(old.get("failures", 0))


@dataclass
class _Judge:
    """Sorts the pods of one observation (see the module docstring), queueing deletions and events
    for the lost and failed. A finished job counts nothing: a straggler's exit after the end
    changes nothing."""

    seen: Observed
    counts: _Counts
    result: Plan
    finished: bool
    census: verdicts.Census = field(default_factory=verdicts.Census)

    def all(self) -> verdicts.Census:
        done = self.seen.accounted | set(self.seen.status.get("counted") or [])  # by this replica, or any writer
        for pod in self.seen.pods:
            if verdicts.kept(pod):
                self.census.kept.append(pod)
            elif verdicts.pod_uid(pod) not in done:  # else counted or deleted by the operator already
                self.pod(pod)
        if not self.finished:
            for pod in self.seen.vanished:
                if verdicts.pod_uid(pod) not in done and pod.get("status", {}).get("phase") not in (
                    "Succeeded",
                    "Failed",
                ):
                    self.gone(pod, "was deleted by someone other than the operator")
        return self.census

    def pod(self, pod: Mapping[str, Any]) -> None:
        phase = pod.get("status", {}).get("phase", "Pending")
        deleting = bool(pod.get("metadata", {}).get("deletionTimestamp"))
        if phase == "Succeeded" and not self.finished and not verdicts.run_completed(pod):
            # A wrapper that exits 0 on SIGTERM in a drain: the cluster stopped it, the run is not over.
            self.gone(pod, "exited 0 while being stopped by the cluster")
        elif phase == "Succeeded":
            self.census.succeeded.append(pod)
        elif self.finished:
            self.census.active.append(pod)  # only the clean-up looks at it
        elif deleting:  # deleted, not by us: a user, the eviction API...
            disruption = verdicts.disruption_target(pod)
            reason = str(disruption.get("reason")) if disruption else "deleted by someone other than the operator"
            self.gone(pod, f"is being deleted ({reason})")
        else:
            self.judge(pod, phase)

    def judge(self, pod: Mapping[str, Any], phase: str) -> None:
        """A live worker pod (not finished, not being deleted): lost, counted and acted on, where its state
        and its node's say so (`verdicts.judge`); else active, ready or pending."""
        seen = self.seen
        node_name = str(pod.get("spec", {}).get("nodeName") or "")
        loss = verdicts.judge(
            pod, phase, seen.nodes.get(node_name), node_handling=seen.node_handling, policy=seen.node_policy,
            admitted=node_name in seen.admitted_nodes, now=seen.now,
        )  # fmt: skip
        if loss is not None:
            if loss.verdict.reason == constants.NODE_FAULT_REASON and node_name:
                self.census.faulty_nodes.append(node_name)
            self.lose(pod, loss.verdict, loss.grace, loss.text, keep=loss.keep)
            return
        self.census.active.append(pod)
        if verdicts.is_ready(pod):
            self.census.ready += 1
        else:
            self.census.pending.append(pod)

    def lose(
        self, pod: Mapping[str, Any], verdict: verdicts.Verdict, grace: int | None, text: str, *, keep: bool = False
    ) -> None:
        """A pod evicted or failed: counted, owed a replacement; deleted, or (a Failed one) kept for its logs."""
        name, uid = verdicts.pod_name(pod), verdicts.pod_uid(pod)
        if verdict.kind == verdicts.EVICTION:
            self.counts.evictions += 1
            self.census.evictions.append(verdict)
            said = events.NODE_FAULT if verdict.reason == events.NODE_FAULT.name else events.EVICTED
            self.result.events.append(said.event(f"worker pod {name} {text}"))
        else:
            self.counts.failures += 1
            self.census.failures.append((name, verdict))
            kept = f"; kept for its logs: kubectl logs {name}" if keep else ""
            self.result.events.append(
                events.WORKER_FAILED.event(f"worker pod {name} failed: {verdict.reason}, {text}{kept}")
            )
        if keep:
            self.result.keep.append(Keep(name, uid, f"{verdict.kind}: {verdict.reason}"))
            self.census.kept.append(pod)
        else:
            self.result.delete.append(Delete("v1", "Pod", name, uid, grace, f"{verdict.kind}: {verdict.reason}"))
        self.result.accounted.append(uid)
        self.census.lost += 1

    def gone(self, pod: Mapping[str, Any], text: str) -> None:
        """A pod someone else deleted: an eviction, owed a replacement (it goes by itself)."""
        self.counts.evictions += 1
        self.census.evictions.append(verdicts.Verdict(verdicts.EVICTION, "Deleted", text))
        self.result.events.append(events.EVICTED.event(f"worker pod {verdicts.pod_name(pod)} {text}"))
        self.result.accounted.append(verdicts.pod_uid(pod))
        self.census.lost += 1


def _counted(old: Mapping[str, Any], accounted: list[str]) -> list[str] | None:
    """`status.counted`: the old list with this plan's counted uids added, the newest `COUNTED_KEPT`."""
    earlier = [str(uid) for uid in old.get("counted") or []]
    fresh = [uid for uid in dict.fromkeys(accounted) if uid and uid not in earlier]
    kept = [*earlier, *fresh][-constants.COUNTED_KEPT :]
    return kept or None


def plan(seen: Observed) -> Plan:
    """Decide one reconcile's actions and the job's new status."""
    old = seen.status
    result = Plan()
    counts = _Counts(old)
    finished = old.get("phase") in conditions.FINISHED_PHASES
    census = _Judge(seen, counts, result, finished).all()
    _delete(result, _surplus_kept(census))
    if finished:
        _delete(result, _cleanup(seen, census, result))
        _delete(result, _etcd_deletes(seen, result, "job finished"))
        result.status = dict(old)  # frozen at the end: nothing after it changes the record
        return result

    spec, now = seen.spec, seen.now
    was_suspended = old.get("phase") == conditions.PHASE_SUSPENDED
    resumes = int(old.get("resumes", 0)) + (1 if was_suspended and not spec.suspend else 0)
    job = replace(seen.job, resumes=resumes, etcd_tls=_etcd_tls(seen.etcd))
    clocks = lifecycle.Clocks.read(old, now, spec, suspended=spec.suspend, resumed=was_suspended and not spec.suspend)
    clocks.observe(census.ready, spec.min_replicas)
    backoff = lifecycle.Backoff.read(old, now)
    last_failure = lifecycle.last_failure(census, old, now)
    budget = lifecycle.EvictionBudget.read(old, now, spec)
    budget.add(census.evictions)
    if census.failures:
        backoff.failed(len(census.failures), previous=old.get("lastFailure"), now=now)
    if census.evictions and budget.exceeded():  # evictions the job seems to cause: wait as after failures
        backoff.failed(len(census.evictions), previous=old.get("lastFailure") or budget.previous(), now=now)
    avoided = avoided_nodes(old, census)
    progress = lifecycle.Progress.read(old, seen.milestones, now, resumed=was_suspended and not spec.suspend)
    stall = lifecycle.stall(spec, census, clocks, progress, seen.milestones, _etcd_state(seen))

    outcome = lifecycle.outcome(spec, census, counts.failures, clocks, last_failure, stalled=stall)
    conds = list(old.get("conditions") or [])
    conds = conditions.set_condition(conds, conditions.INVALID_SPEC, False, "SpecValid", "the spec is valid", now)
    if outcome is not None:  # Succeeded or Failed, now
        phase, reason, message = outcome
        clocks.completion = conditions.timestamp(now)
        conds = lifecycle.finished_conditions(conds, phase, reason, message, now, stall=stall)
        result.events.append(events.of(phase, message))
        _delete(result, _cleanup(seen, census, result))
        _delete(result, _etcd_deletes(seen, result, "job finished"))
    elif spec.suspend:
        phase = conditions.PHASE_SUSPENDED
        conds = lifecycle.suspended_conditions(conds, census, now)
        stopping = [
            Delete("v1", "Pod", verdicts.pod_name(pod), verdicts.pod_uid(pod), None, "job suspended")
            for pod in census.active
        ]
        _delete(result, stopping)
        _delete(result, _etcd_deletes(seen, result, "job suspended"))
        if not was_suspended:
            result.events.append(
                events.SUSPENDED.event(f"stopping {len(census.active)} worker pod(s), then the managed etcd")
            )
    else:
        phase, conds = _active(seen, job, census, counts, result, conds, clocks, backoff, budget, stall, avoided)
    conds = conditions.replica_failure(conds, [*seen.create_failures, *result.refused], now)
    result.status = {
        "phase": phase,
        "selector": job.selector(),
        "runId": job.run_id,
        "resumes": resumes,
        "replicas": {"desired": spec.desired, "ready": census.ready, "pending": len(census.pending)},
        "replicaGroups": {
            "size": spec.replica_group_size,
            "desired": spec.desired_groups,
            "ready": replica_groups.ready_groups(census.active, spec.replica_group_size),
        },
        "evictions": counts.evictions,
        "restarts": counts.restarts,
        "failures": counts.failures,
        "counted": _counted(old, result.accounted),
        "lastFailure": last_failure,
        "backoff": backoff.record(),
        "evictionWindow": budget.record(),
        "progress": progress.record(),
        "avoidedNodes": avoided or None,
        **_milestones(seen.milestones, old, nproc_per_node=spec.nproc_per_node),
        **clocks.record(),
        "observedGeneration": seen.generation,
        "conditions": conditions.observed(conds, seen.generation),
    }
    return result


def _active(  # noqa: PLR0917 - the plan's state, passed along
    seen: Observed,
    job: JobRef,
    census: verdicts.Census,
    counts: _Counts,
    result: Plan,
    conds: list[dict[str, Any]],
    clocks: lifecycle.Clocks,
    backoff: lifecycle.Backoff,
    budget: lifecycle.EvictionBudget,
    stall: lifecycle.Stall | None,
    avoided: list[str],
) -> tuple[str, list[dict[str, Any]]]:
    """A job neither finished nor suspended: the etcd, scaling (new workers avoid the nodes in
    `avoided`), and its phase and conditions."""
    spec, now = seen.spec, seen.now
    if seen.status.get("phase") == conditions.PHASE_SUSPENDED:
        result.events.append(events.RESUMED.event(f"starting again as run {job.run_id}"))
    held_creates = seen.creates_held_until is not None and now < seen.creates_held_until
    blocked = _ensure_etcd(seen, job, result, held=held_creates)
    held = backoff.hold(now)
    if not blocked:
        _scale(
            seen, job, census, counts, result, held=held, released=backoff.released, refused=held_creates,
            avoid=avoided,
        )  # fmt: skip
    backoff.keep(min(held, max(0, spec.desired - len(census.active))))
    if (census.failures or (census.evictions and budget.exceeded())) and held:
        result.events.append(events.BACK_OFF.event(backoff.describe(now)))
    why = _refusals(seen, result, blocked=blocked)  # also queues the etcd's refusal, if any
    phase, conds = lifecycle.active_conditions(conds, spec, census, clocks, why=why, now=now)
    conds = lifecycle.stalled_condition(conds, stall, now)
    return phase, budget.condition(conds, now)


def _etcd_state(seen: Observed) -> str | None:
    """Why the managed etcd is not serving, in the cluster's words, or None if it is (or is external)."""
    if seen.spec.rdzv_endpoint:
        return None
    deployment = seen.etcd.get("Deployment")
    if deployment is None:
        return "its Deployment does not exist"
    if int((deployment.get("status") or {}).get("availableReplicas") or 0) >= 1:
        return None
    for pod in seen.etcd_pods:
        reason = verdicts.waiting_reason(pod)
        if reason not in ("starting", "not scheduled yet"):
            return f"its pod {verdicts.pod_name(pod)} is not running: {reason}"
    return "its Deployment has no available pod"


def _surplus_kept(census: verdicts.Census) -> list[Delete]:
    """The failed pods kept beyond `FAILED_PODS_KEPT` (the oldest go first)."""

    def age(pod: Mapping[str, Any]) -> tuple[str, int]:
        return str(pod.get("metadata", {}).get("creationTimestamp") or ""), verdicts.pod_index(pod)

    live = [p for p in census.kept if not p.get("metadata", {}).get("deletionTimestamp")]
    surplus = sorted(live, key=age)[: max(0, len(live) - constants.FAILED_PODS_KEPT)]
    return [
        Delete(
            "v1",
            "Pod",
            verdicts.pod_name(p),
            verdicts.pod_uid(p),
            None,
            f"only the newest {constants.FAILED_PODS_KEPT} failed pods are kept",
        )
        for p in surplus
    ]


def _etcd_tls(etcd: Mapping[str, Mapping[str, Any]]) -> bool:
    """Mutual TLS for the managed etcd, except where an etcd made without it runs (an operator upgrade
    under a running job): its workers hold no certificate, so it stays as it is until it is made anew."""
    deployment = etcd.get("Deployment")
    if deployment is None:
        return True
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
    return "--client-cert-auth" in (containers[0].get("command") or [])


def _refusals(seen: Observed, result: Plan, *, blocked: bool) -> str | None:
    """Why the job cannot start, if the cluster refuses its objects (the etcd's pods: an Event once)."""
    refusal = etcd_refusal(seen.etcd, seen.now)
    if refusal is not None:
        result.refused.append(refusal)
        said = conditions.find(seen.status.get("conditions") or [], conditions.REPLICA_FAILURE) or {}
        if refusal.message not in str(said.get("message", "")):  # said once, not at every reconcile
            result.events.append(events.of(refusal.reason, refusal.message))
    if blocked:
        return "the managed etcd's name is taken (see ReplicaFailure)"
    if refusal is not None or any(f.reason == conditions.FAILED_CREATE for f in seen.create_failures):
        return "the cluster refuses the job's pods (see ReplicaFailure)"
    return None


def etcd_refusal(etcd: Mapping[str, Mapping[str, Any]], now: datetime) -> CreateFailure | None:
    """The refusal of the managed etcd's pod, as its Deployment reports it, or None.

    The API server admits a Deployment whose pods a namespace's policy forbids (Pod
    Security, a quota, an admission webhook); its ReplicaSet's pod creates are what is
    refused, and the Deployment says so in a `ReplicaFailure` condition. Without this
    the job would wait for a rendezvous that never starts and say nothing.
    """
    deployment = etcd.get("Deployment") or {}
    said = conditions.find((deployment.get("status") or {}).get("conditions") or [], conditions.REPLICA_FAILURE)
    if said is None or said.get("status") != "True":
        return None
    name = deployment.get("metadata", {}).get("name", "")
    message = f"the managed etcd's pods are refused: {said.get('message') or said.get('reason') or 'no reason given'}"
    return CreateFailure(f"Deployment/{name}/pods", conditions.FAILED_CREATE, message, now)


def _milestones(milestones: Mapping[str, Any], old: Mapping[str, Any], *, nproc_per_node: int) -> dict[str, Any]:
    """Rendezvous round, its world size (its nodes' training processes) and last checkpoint as the run
    reported them; the last known values otherwise."""
    result: dict[str, Any] = {}
    round_record = milestones.get("round") or {}
    if isinstance(round_record.get("round"), int):
        result["rendezvousRound"] = round_record["round"]
    elif "rendezvousRound" in old:
        result["rendezvousRound"] = old["rendezvousRound"]
    if isinstance(round_record.get("nodes"), int):
        result["worldSize"] = round_record["nodes"] * nproc_per_node
    elif "worldSize" in old:
        result["worldSize"] = old["worldSize"]
    checkpoint = milestones.get("checkpoint") or {}
    if isinstance(checkpoint.get("step"), int):
        result["lastCheckpoint"] = {key: checkpoint[key] for key in ("step", "time", "uri") if key in checkpoint}
    elif "lastCheckpoint" in old:
        result["lastCheckpoint"] = old["lastCheckpoint"]
    return result


def _delete(result: Plan, deletes: Sequence[Delete]) -> None:
    """Queue deletions; their objects are not judged or deleted again (`Plan.accounted`)."""
    result.delete.extend(deletes)
    result.accounted.extend(d.uid for d in deletes if d.uid)


def _taken(seen: Observed, key: str) -> CreateFailure | None:
    return next((f for f in seen.create_failures if f.key == key), None)


def _ensure_etcd(seen: Observed, job: JobRef, result: Plan, *, held: bool = False) -> bool:
    """Create the managed etcd's missing objects and update changed ones; True while one's name is taken.

    A name taken by an object the job does not own is left alone and tried again every
    `NAME_RETRY_SECONDS`; meanwhile no worker is made, as workers would reach that
    object (a Service of the same name) instead of their own rendezvous. While the
    job's creates are `held` (the API refused one lately), nothing is created.
    """
    if seen.spec.rdzv_endpoint:
        return False
    if len(seen.etcd) == len(ETCD_KINDS) and all(_known(seen, obj) for obj in seen.etcd.values()):
        return False  # each holds this build at its version (see `Observed.applied`)
    blocked = False
    for desired in builders.etcd_objects(job, seen.spec):
        kind, name = desired["kind"], desired["metadata"]["name"]
        actual = seen.etcd.get(kind)
        if actual is None:
            taken = _taken(seen, f"{kind}/{name}")
            if taken is not None and taken.reason == conditions.NAME_TAKEN:
                blocked = True
                if (seen.now - taken.at).total_seconds() < constants.NAME_RETRY_SECONDS:
                    continue
            if not held:
                result.create.append(desired)
            continue
        meta = actual.get("metadata", {})
        wanted = desired["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH]
        if (meta.get("annotations") or {}).get(constants.ANNOTATION_SPEC_HASH) != wanted:
            result.update.append(Update(desired["apiVersion"], kind, name, builders.update_patch(actual, desired)))
            result.events.append(events.UPDATED.event(f"{kind} {name} updated in place to the job's current spec"))
        elif _known(seen, actual):
            continue
        elif builders.covers(actual, desired):
            result.settled[str(meta.get("uid", ""))] = str(meta.get("resourceVersion", ""))
        else:
            result.update.append(Update(desired["apiVersion"], kind, name, desired, apply=True))
            result.events.append(events.DRIFTED.event(f"{kind} {name} was changed by someone else; set back"))
    return blocked


def _known(seen: Observed, obj: Mapping[str, Any]) -> bool:
    """Whether an etcd object is known to hold the current build at the version it has now."""
    meta = obj.get("metadata") or {}
    return seen.applied.get(str(meta.get("uid", ""))) == str(meta.get("resourceVersion", ""))


def _etcd_deletes(seen: Observed, result: Plan, why: str) -> list[Delete]:
    """Delete the managed etcd's objects the job owns (by uid: a same-named object of someone else stays),
    once no worker the operator stopped is still leaving: their agents leave the rendezvous on the way out
    (an emergency checkpoint's report included), which needs the etcd."""
    stopping = {d.uid for d in result.delete if d.kind == "Pod"}
    for pod in seen.pods:
        leaving = pod.get("metadata", {}).get("deletionTimestamp") or verdicts.pod_uid(pod) in stopping
        if leaving and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            return []
    deletes = []
    for api_version, kind in ETCD_KINDS:
        actual = seen.etcd.get(kind)
        if actual is not None and str(actual.get("metadata", {}).get("uid", "")) not in seen.accounted:
            meta = actual.get("metadata", {})
            deletes.append(Delete(api_version, kind, str(meta.get("name", "")), str(meta.get("uid", "")), None, why))
    return deletes


def _scale(
    seen: Observed,
    job: JobRef,
    census: verdicts.Census,
    counts: _Counts,
    result: Plan,
    *,
    held: int,
    released: int,
    refused: bool = False,
    avoid: Sequence[str] = (),
) -> None:
    """Create pods up to `desired` (lowest free indices, by whole replica groups: replica_groups.py), off
    the nodes in `avoid`, less those held back by the failure backoff (none while the refusal backoff
    holds: `refused`); or delete the surplus (pending first, then the highest indices; broken groups
    first)."""
    desired = seen.spec.desired
    taken = {verdicts.pod_index(pod) for pod in seen.pods}
    names = [  # a name someone else holds is skipped; a refused one is tried again (the same index)
        *seen.names_in_use,
        *(
            f.key.removeprefix("Pod/")
            for f in seen.create_failures
            if f.key.startswith("Pod/") and f.reason == conditions.NAME_TAKEN
        ),
    ]
    prefix = f"{job.name}-worker-"
    taken |= {int(n.removeprefix(prefix)) for n in names if n.startswith(prefix) and n.removeprefix(prefix).isdigit()}
    size = seen.spec.replica_group_size
    grouped = replica_groups.plan_groups(census.active, size=size, groups=seen.spec.desired_groups, taken=taken)
    for pod in grouped.delete:
        name = verdicts.pod_name(pod)
        result.delete.append(Delete("v1", "Pod", name, verdicts.pod_uid(pod), None, "scale down"))
        result.accounted.append(verdicts.pod_uid(pod))
        result.events.append(events.SCALED_DOWN.event(f"deleted worker pod {name} (desired {desired})"))
    making = grouped.create
    creating = 0 if refused else len(making) - min(held, len(making))
    owed = max(0, census.lost + released - held)
    for index, group in making[:creating]:
        result.create.append(builders.worker_pod(job, seen.spec, index, avoid=avoid, group=group))
        name = job.worker_name(index)
        if owed > 0:
            owed -= 1
            counts.restarts += 1
            result.announced[f"Pod/{name}"] = events.REPLACED.event(f"created worker pod {name} to replace a lost one")
        else:
            result.announced[f"Pod/{name}"] = events.SCALED_UP.event(f"created worker pod {name} (desired {desired})")


def avoided_nodes(old: Mapping[str, Any], census: verdicts.Census) -> list[str]:
    """`status.avoidedNodes`: the nodes the job's new workers avoid, newest last, at most
    `AVOIDED_NODES_KEPT`: the old list, and the node of each node fault counted now (a worker that
    exited with the node-fault code: its GPU refused). Pure. Why: the replacement of a worker whose GPU
    failed lands on that node again (its GPUs are the free ones), and failed there again, and again:
    each a departure and a join for every other node. Nodes are avoided, not cordoned: a cordon would
    need cluster-wide rights on nodes and would keep every job off a node only one job found bad."""
    earlier = [str(node) for node in old.get("avoidedNodes") or []]
    fresh = [node for node in census.faulty_nodes if node]
    kept = [node for node in earlier if node not in fresh] + list(dict.fromkeys(fresh))
    return kept[-constants.AVOIDED_NODES_KEPT :]


def _cleanup(seen: Observed, census: verdicts.Census, result: Plan) -> list[Delete]:
    """Worker pods to delete when the job finished.

    Pending ones always (they never ran; kept, they would make the cluster autoscaler buy a
    spot VM for a job that is over), running ones unless `cleanPodPolicy: None` (with their
    grace period), finished ones only with `All`. Already-deleted ones are not asked again.
    """
    policy = seen.spec.clean_pod_policy
    deleting = {d.uid for d in result.delete}
    chosen = []
    for pod in [*census.active, *census.succeeded, *census.kept]:
        if pod.get("metadata", {}).get("deletionTimestamp") or verdicts.pod_uid(pod) in deleting:
            continue
        phase = pod.get("status", {}).get("phase", "Pending")
        running = phase == "Running"
        done = phase in ("Succeeded", "Failed")
        if phase in {"Pending", "Unknown"} or (running and policy != "None") or (done and policy == "All"):
            chosen.append(Delete("v1", "Pod", verdicts.pod_name(pod), verdicts.pod_uid(pod), None, "job finished"))
    return chosen
