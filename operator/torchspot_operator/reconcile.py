"""Desired against actual: what to create, delete, update, say and record for one ElasticJob. Pure.

`plan` takes what the controller observed (the job, the worker pods and managed etcd
objects it owns, their nodes, the time, what the run reported) and returns a `Plan`.
It is level-based: the same observation gives the same plan whether a create, an
update, a pod or node event, a resume or the timer asked for it, so repeating it
converges instead of piling up actions. The lifecycle it implements (phases,
conditions, clocks) is written down in operator/README.md ("Lifecycle").

How a worker pod is judged, in the spirit of Kubernetes Job's podFailurePolicy:
- *eviction*: what the cluster says is one: a `DisruptionTarget` condition (preemption,
  the taint manager, the eviction API, pod GC, the kubelet), a disruption reason on the
  pod (Evicted, Terminated, NodeShutdown...), its node gone, NotReady, cordoned, being
  deleted or tainted for eviction (the operator deletes such workers at once, with
  their grace period, so torchrun's SIGTERM path writes the emergency checkpoint), or a
  deletion by anyone but the operator (a user's `kubectl delete pod`). Replaced at once;
  never counted against `failurePolicy.maxRestarts`.
- *failure*: a non-zero exit, OOMKilled, or a pod the kubelet refused before it ran
  (UnexpectedAdmissionError, OutOf...). Counted against `failurePolicy.maxRestarts`;
  replacements after consecutive failures back off (10 s doubling, capped at 5 min).
- *success*: a worker that exited 0. torchrun's agent exits 0 only after every agent of
  the group reached its exit barrier with its workers done, so one success means the run
  is complete: the job is Succeeded in that same reconcile, whatever else is going on.
- *active*: anything else; Ready ones train, the rest are pending (unscheduled pods are
  the cluster autoscaler's signal to add spot nodes: they are kept, and training goes on
  at the size that is Ready).
Each pod is judged once: the controller passes the uids it already counted or deleted
(`accounted`), and the plan returns those it counts now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from torchspot_operator import builders, conditions, constants
from torchspot_operator.builders import JobRef
from torchspot_operator.conditions import CreateFailure
from torchspot_operator.spec import JobSpec

DISRUPTED_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "Shutdown", "Terminated", "NodeShutdown"})
"""Pod `status.reason`s a kubelet or node controller writes when it, not the workload, ended the pod."""
EVICTION = "eviction"
FAILURE = "failure"
ETCD_KINDS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)
"""The managed etcd's objects, in the order they are made (its certificates' Secret is made before
them, by the controller: see `Controller._tls`)."""


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
    """Merge-patch a managed etcd object the job owns (its build changed: a job edit)."""

    api_version: str
    kind: str
    name: str
    patch: dict[str, Any]


@dataclass
class Plan:
    """What one reconcile decided."""

    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[Delete] = field(default_factory=list)
    update: list[Update] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type, reason, message): Normal or Warning Kubernetes Events."""
    accounted: list[str] = field(default_factory=list)
    """Uids of the pods this plan counted or deletes: never judged again."""
    refused: list[CreateFailure] = field(default_factory=list)
    """Pods the cluster refuses to the job's managed etcd Deployment (see `etcd_refusal`)."""

    def acts(self) -> bool:
        """Whether the plan changes anything in the cluster (creates, deletes, updates or counts)."""
        return bool(self.create or self.delete or self.update or self.accounted)


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
    progress: Mapping[str, Any] = field(default_factory=dict)
    """What the run reported through etcd: `round` and `checkpoint` records (see progress.py)."""
    node_handling: bool = True
    """False: a bad node is not a reason to move its workers (`constants.NODE_HANDLING_ENV`)."""
    accounted: frozenset[str] = frozenset()
    """Pod uids already counted or deleted by the operator (terminating ones are skipped)."""
    vanished: Sequence[Mapping[str, Any]] = ()
    """Pods that disappeared without the operator deleting them (last seen bodies)."""
    create_failures: Sequence[CreateFailure] = ()
    """Objects the operator could not create lately (names taken, API refusals)."""
    names_in_use: frozenset[str] = frozenset()
    """Names of worker pods labelled with this job's name, whoever owns them (a predecessor's too)."""


@dataclass(frozen=True)
class Verdict:
    """Why a worker pod ended: `EVICTION` or `FAILURE`, with a reason and a message for people."""

    kind: str
    reason: str
    message: str


def node_trouble(node: Mapping[str, Any] | None) -> str | None:
    """Why a node's pods should leave now, or None if it is healthy."""
    if node is None:
        return "node is gone"
    if node.get("metadata", {}).get("deletionTimestamp"):
        return "node is being deleted"
    spec = node.get("spec", {})
    if spec.get("unschedulable"):
        return "node is cordoned"
    for taint in spec.get("taints") or []:
        if taint.get("key") in constants.EVICTION_TAINTS:
            return f"node has taint {taint['key']}"
    for condition in node.get("status", {}).get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") != "True":
            return "node is NotReady"
    return None


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for container in pod.get("status", {}).get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated is not None:
            return dict(terminated)
    return None


def _disruption(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's DisruptionTarget condition, if it is True."""
    found = conditions.find(pod.get("status", {}).get("conditions") or [], "DisruptionTarget")
    return found if found is not None and found.get("status") == "True" else None


def classify(pod: Mapping[str, Any], trouble: str | None = None) -> Verdict:
    """Why a Failed worker pod ended: an eviction if the cluster says so (or its node is in
    `trouble`), else a failure: OOMKilled, an exit code, or refused before it ran."""
    pod_status = pod.get("status", {})
    disruption = _disruption(pod)
    if disruption is not None:
        return Verdict(
            EVICTION, str(disruption.get("reason") or "DisruptionTarget"), str(disruption.get("message", ""))
        )
    if pod_status.get("reason") in DISRUPTED_REASONS:
        return Verdict(EVICTION, str(pod_status["reason"]), str(pod_status.get("message", "")))
    if trouble is not None:
        return Verdict(EVICTION, "NodeLost", trouble)
    terminated = _terminated(pod)
    if terminated is None:  # never ran: the kubelet refused it (device plugin, resources, affinity)
        reason = str(pod_status.get("reason") or "AdmissionFailed")
        return Verdict(FAILURE, reason, str(pod_status.get("message") or "the pod failed before its container ran"))
    code = terminated.get("exitCode")
    if terminated.get("reason") == "OOMKilled":
        return Verdict(FAILURE, "OOMKilled", f"out of memory (exit code {code})")
    detail = f" ({terminated['reason']})" if terminated.get("reason") not in (None, "Error") else ""
    return Verdict(FAILURE, "ExitCode", f"exit code {code}{detail}")


def _is_ready(pod: Mapping[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return pod.get("status", {}).get("phase") == "Running" and conditions.is_true(conds, "Ready")


def _index(pod: Mapping[str, Any]) -> int:
    try:
        return int(pod.get("metadata", {}).get("labels", {}).get(constants.LABEL_INDEX, "-1"))
    except ValueError:
        return -1


def _name(pod: Mapping[str, Any]) -> str:
    return str(pod.get("metadata", {}).get("name", ""))


def _uid(pod: Mapping[str, Any]) -> str:
    return str(pod.get("metadata", {}).get("uid", ""))


def waiting_reason(pod: Mapping[str, Any]) -> str:
    """Why a pod is not Ready yet, in the cluster's words: the scheduler's message for an
    unscheduled pod, the container's waiting reason (image pull, ...) for a started one."""
    pod_status = pod.get("status", {})
    scheduled = conditions.find(pod_status.get("conditions") or [], "PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        return str(scheduled.get("message") or scheduled.get("reason") or "not scheduled")
    for container in pod_status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return f"{waiting.get('reason', 'waiting')}: {waiting.get('message', '')}".rstrip(": ")
    return "not scheduled yet" if not pod.get("spec", {}).get("nodeName") else "starting"


@dataclass
class _Census:
    """The worker pods sorted by what they mean for the job."""

    active: list[Mapping[str, Any]] = field(default_factory=list)
    ready: int = 0
    pending: list[Mapping[str, Any]] = field(default_factory=list)
    succeeded: list[Mapping[str, Any]] = field(default_factory=list)
    lost: int = 0
    """Pods lost in this observation (evicted or failed), each owed a replacement."""
    failures: list[tuple[str, Verdict]] = field(default_factory=list)
    """(pod, verdict) of the failures counted in this observation."""


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
    census: _Census = field(default_factory=_Census)

    def all(self) -> _Census:
        for pod in self.seen.pods:
            if _uid(pod) not in self.seen.accounted:  # else counted or deleted by the operator already
                self.pod(pod)
        if not self.finished:
            for pod in self.seen.vanished:
                if _uid(pod) not in self.seen.accounted and pod.get("status", {}).get("phase") not in (
                    "Succeeded",
                    "Failed",
                ):
                    self.gone(pod, "was deleted by someone other than the operator")
        return self.census

    def pod(self, pod: Mapping[str, Any]) -> None:
        phase = pod.get("status", {}).get("phase", "Pending")
        if phase == "Succeeded":
            self.census.succeeded.append(pod)
        elif self.finished:
            self.census.active.append(pod)  # only the clean-up looks at it
        elif pod.get("metadata", {}).get("deletionTimestamp"):  # deleted, not by us: a user, the eviction API...
            disruption = _disruption(pod)
            reason = str(disruption.get("reason")) if disruption else "deleted by someone other than the operator"
            self.gone(pod, f"is being deleted ({reason})")
        else:
            node_name = pod.get("spec", {}).get("nodeName")
            seen = self.seen
            trouble = node_trouble(seen.nodes.get(node_name)) if node_name and seen.node_handling else None
            if phase == "Failed":
                verdict = classify(pod, trouble)
                said = f"{verdict.reason}: {verdict.message}" if verdict.message else verdict.reason
                text = f"({said})" if verdict.kind == EVICTION else verdict.message
                self.lose(pod, verdict, 0, text)
            elif trouble is not None:
                grace = 0 if trouble == "node is gone" else None
                self.lose(pod, Verdict(EVICTION, "NodeLost", trouble), grace, f"on {node_name}: {trouble}")
            else:
                self.census.active.append(pod)
                if _is_ready(pod):
                    self.census.ready += 1
                else:
                    self.census.pending.append(pod)

    def lose(self, pod: Mapping[str, Any], verdict: Verdict, grace: int | None, text: str) -> None:
        """A pod evicted or failed: counted, deleted, owed a replacement."""
        name, uid = _name(pod), _uid(pod)
        if verdict.kind == EVICTION:
            self.counts.evictions += 1
            self.result.events.append(("Warning", "Evicted", f"worker pod {name} {text}"))
        else:
            self.counts.failures += 1
            self.census.failures.append((name, verdict))
            self.result.events.append(
                ("Warning", "WorkerFailed", f"worker pod {name} failed: {verdict.reason}, {text}")
            )
        self.result.delete.append(Delete("v1", "Pod", name, uid, grace, f"{verdict.kind}: {verdict.reason}"))
        self.result.accounted.append(uid)
        self.census.lost += 1

    def gone(self, pod: Mapping[str, Any], text: str) -> None:
        """A pod someone else deleted: an eviction, owed a replacement (it goes by itself)."""
        self.counts.evictions += 1
        self.result.events.append(("Warning", "Evicted", f"worker pod {_name(pod)} {text}"))
        self.result.accounted.append(_uid(pod))
        self.census.lost += 1


def plan(seen: Observed) -> Plan:
    """Decide one reconcile's actions and the job's new status."""
    old = seen.status
    result = Plan()
    counts = _Counts(old)
    finished = old.get("phase") in conditions.FINISHED_PHASES
    census = _Judge(seen, counts, result, finished).all()
    if finished:
        _delete(result, [*_cleanup(seen, census), *_etcd_deletes(seen, "job finished")])
        result.status = dict(old)  # frozen at the end: nothing after it changes the record
        return result

    spec, now = seen.spec, seen.now
    was_suspended = old.get("phase") == conditions.PHASE_SUSPENDED
    resumes = int(old.get("resumes", 0)) + (1 if was_suspended and not spec.suspend else 0)
    job = replace(seen.job, resumes=resumes, etcd_tls=_etcd_tls(seen.etcd))
    clocks = _Clocks.read(old, now, spec, suspended=spec.suspend, resumed=was_suspended and not spec.suspend)
    clocks.observe(census.ready, spec.min_replicas)
    backoff = _Backoff.read(old, now)
    last_failure = _last_failure(census, old, now)
    if census.failures:
        backoff.failed(len(census.failures), previous=old.get("lastFailure"), now=now)

    outcome = _outcome(seen, census, counts, clocks, last_failure)
    conds = list(old.get("conditions") or [])
    conds = conditions.set_condition(conds, conditions.INVALID_SPEC, False, "SpecValid", "the spec is valid", now)
    if outcome is not None:  # Succeeded or Failed, now
        phase, reason, message = outcome
        clocks.completion = conditions.timestamp(now)
        conds = _finished_conditions(conds, phase, reason, message, now)
        result.events.append(("Normal" if phase == conditions.PHASE_SUCCEEDED else "Warning", phase, message))
        _delete(result, [*_cleanup(seen, census), *_etcd_deletes(seen, "job finished")])
    elif spec.suspend:
        phase = conditions.PHASE_SUSPENDED
        conds = _suspended_conditions(conds, census, now)
        stopping = [Delete("v1", "Pod", _name(pod), _uid(pod), None, "job suspended") for pod in census.active]
        _delete(result, [*stopping, *_etcd_deletes(seen, "job suspended")])
        if not was_suspended:
            result.events.append(
                ("Normal", "Suspended", f"stopping {len(census.active)} worker pod(s) and the managed etcd")
            )
    else:
        if was_suspended:
            result.events.append(("Normal", "Resumed", f"starting again as run {job.run_id}"))
        blocked = _ensure_etcd(seen, job, result)
        held = backoff.hold(now)
        if not blocked:
            _scale(seen, job, census, counts, result, held=held, released=backoff.released)
        backoff.keep(min(held, max(0, spec.desired - len(census.active))))
        if census.failures and held:
            result.events.append(("Warning", "BackOff", backoff.describe(now)))
        why = _refusals(seen, result, blocked=blocked)  # also queues the etcd's refusal, if any
        phase, conds = _active_conditions(conds, seen, census, clocks, why=why, now=now)
    conds = conditions.replica_failure(conds, [*seen.create_failures, *result.refused], now)
    result.status = {
        "phase": phase,
        "selector": job.selector(),
        "runId": job.run_id,
        "resumes": resumes,
        "replicas": {"desired": spec.desired, "ready": census.ready, "pending": len(census.pending)},
        "evictions": counts.evictions,
        "restarts": counts.restarts,
        "failures": counts.failures,
        "lastFailure": last_failure,
        "backoff": backoff.record(),
        **_progress(seen.progress, old),
        **clocks.record(),
        "conditions": conds,
    }
    return result


@dataclass
class _Clocks:
    """The times the lifecycle's rules count from (each is in the status; None: not running).

    - `start`: when the current active period began (creation, or the last resume);
      activeDeadlineSeconds and the start-up timeout count from it;
    - `reached_min`: the first time in this period the job had minReplicas ready; until
      then it is Pending and WaitingForCapacity;
    - `below_since`: when ready workers last fell below minReplicas after reaching it;
      the below-minimum grace counts from it.
    """

    start: str | None
    reached_min: str | None
    below_since: str | None
    completion: str | None
    now: datetime

    @classmethod
    def read(cls, old: Mapping[str, Any], now: datetime, spec: JobSpec, *, suspended: bool, resumed: bool) -> _Clocks:
        if suspended:
            return cls(None, None, None, None, now)
        if resumed:
            return cls(conditions.timestamp(now), None, None, None, now)
        return cls(
            old.get("startTime") or conditions.timestamp(now),
            old.get("reachedMinAt"),
            old.get("belowMinSince"),
            None,
            now,
        )

    def observe(self, ready: int, minimum: int) -> None:
        if self.start is None:
            return
        if ready >= minimum:
            self.reached_min = self.reached_min or conditions.timestamp(self.now)
            self.below_since = None
        elif self.reached_min is not None and self.below_since is None:
            self.below_since = conditions.timestamp(self.now)

    def since(self, stamp: str | None) -> float:
        return 0.0 if stamp is None else (self.now - conditions.parse_timestamp(stamp)).total_seconds()

    def record(self) -> dict[str, Any]:
        return {
            "startTime": self.start,
            "reachedMinAt": self.reached_min,
            "belowMinSince": self.below_since,
            "completionTime": self.completion,
        }


@dataclass
class _Backoff:
    """Replacements held back after consecutive worker failures (`status.backoff`)."""

    streak: int
    until: datetime | None
    replacements: int
    released: int = 0
    """Replacements whose wait ended in this reconcile: they are created now, as replacements."""

    @classmethod
    def read(cls, old: Mapping[str, Any], now: datetime) -> _Backoff:
        """The backoff in the status; a streak with nothing held is forgotten `BACKOFF_RESET_SECONDS` after
        the last failure."""
        raw = old.get("backoff") or {}
        until = conditions.parse_timestamp(raw["until"]) if raw.get("until") else None
        held = int(raw.get("replacements", 0))
        last = (old.get("lastFailure") or {}).get("time")
        if not held and (
            last is None or (now - conditions.parse_timestamp(last)).total_seconds() >= constants.BACKOFF_RESET_SECONDS
        ):
            return cls(0, None, 0)
        return cls(int(raw.get("consecutiveFailures", 0)), until, held)

    def failed(self, count: int, *, previous: Mapping[str, Any] | None, now: datetime) -> None:
        """`count` new failures: the streak grows (or starts again after a quiet while) and so does the wait."""
        last = conditions.parse_timestamp(previous["time"]) if previous and previous.get("time") else None
        quiet = last is None or (now - last).total_seconds() >= constants.BACKOFF_RESET_SECONDS
        self.streak = (0 if quiet else self.streak) + count
        delay = min(constants.BACKOFF_BASE_SECONDS * 2 ** (self.streak - 1), constants.BACKOFF_CAP_SECONDS)
        self.until = now + timedelta(seconds=delay)
        self.replacements += count

    def hold(self, now: datetime) -> int:
        """How many replacements wait now; those whose wait is over are released."""
        if self.replacements and self.until is not None and now < self.until:
            return self.replacements
        self.released, self.replacements = self.replacements, 0
        return 0

    def keep(self, held: int) -> None:
        self.replacements = held

    def describe(self, now: datetime) -> str:
        wait = 0 if self.until is None else round((self.until - now).total_seconds())
        return (
            f"replacing {self.replacements} failed worker pod(s) in {wait} s "
            f"({self.streak} consecutive failure(s); evictions are replaced at once)"
        )

    def record(self) -> dict[str, Any] | None:
        if not self.streak:
            return None
        return {
            "consecutiveFailures": self.streak,
            "until": None if self.until is None else conditions.timestamp(self.until),
            "replacements": self.replacements,
        }


def _outcome(
    seen: Observed, census: _Census, counts: _Counts, clocks: _Clocks, last_failure: Mapping[str, Any] | None
) -> tuple[str, str, str] | None:
    """(phase, reason, message) if the job finishes in this reconcile: success first, then failure rules."""
    spec = seen.spec
    if census.succeeded:
        names = ", ".join(sorted(_name(p) for p in census.succeeded))
        return conditions.PHASE_SUCCEEDED, "RunCompleted", f"the run completed: worker pod {names} exited 0"
    if counts.failures > spec.max_restarts:
        last = (
            f" (last: {last_failure['pod']}, {last_failure['reason']}: {last_failure['message']})"
            if last_failure
            else ""
        )
        message = f"{counts.failures} worker failures exceed failurePolicy.maxRestarts {spec.max_restarts}{last}"
        return conditions.PHASE_FAILED, conditions.TOO_MANY_FAILURES, message
    if clocks.start is None:  # suspended: no clock runs
        return None
    if spec.active_deadline_seconds is not None and clocks.since(clocks.start) > spec.active_deadline_seconds:
        message = f"active for more than activeDeadlineSeconds {spec.active_deadline_seconds} s since {clocks.start}"
        return conditions.PHASE_FAILED, conditions.DEADLINE_EXCEEDED, message
    if clocks.reached_min is None and clocks.since(clocks.start) > spec.startup_timeout_seconds:
        message = (
            f"minReplicas {spec.min_replicas} not reached within failurePolicy.startupTimeoutSeconds "
            f"{spec.startup_timeout_seconds} s of {clocks.start} ({census.ready} ready)"
        )
        return conditions.PHASE_FAILED, conditions.STARTUP_TIMEOUT, message
    if clocks.below_since is not None and clocks.since(clocks.below_since) > spec.below_min_grace_seconds:
        message = (
            f"ready workers stayed below minReplicas {spec.min_replicas} for more than "
            f"failurePolicy.belowMinGraceSeconds {spec.below_min_grace_seconds} s (since {clocks.below_since})"
        )
        return conditions.PHASE_FAILED, conditions.BELOW_MIN_TOO_LONG, message
    return None


def _finished_conditions(
    conds: list[dict[str, Any]], phase: str, reason: str, message: str, now: datetime
) -> list[dict[str, Any]]:
    done = "the job succeeded" if phase == conditions.PHASE_SUCCEEDED else "the job failed"
    conds = conditions.set_condition(conds, phase, True, reason, message, now)
    for kind in (conditions.RUNNING, conditions.SCALING, conditions.BELOW_MIN, conditions.WAITING_FOR_CAPACITY):
        conds = conditions.clear_condition(conds, kind, reason, done, now)
    return conds


def _suspended_conditions(conds: list[dict[str, Any]], census: _Census, now: datetime) -> list[dict[str, Any]]:
    stopping = f"; {len(census.active)} worker pod(s) stopping" if census.active else ""
    conds = conditions.set_condition(
        conds,
        conditions.SUSPENDED,
        True,
        "JobSuspended",
        f"spec.suspend is true: no workers, no managed etcd{stopping}",
        now,
    )
    for kind in (conditions.RUNNING, conditions.SCALING, conditions.BELOW_MIN, conditions.WAITING_FOR_CAPACITY):
        conds = conditions.clear_condition(conds, kind, "JobSuspended", "the job is suspended", now)
    return conds


def _active_conditions(
    conds: list[dict[str, Any]],
    seen: Observed,
    census: _Census,
    clocks: _Clocks,
    *,
    why: str | None,
    now: datetime,
) -> tuple[str, list[dict[str, Any]]]:
    """Phase and conditions of a job that is neither finished nor suspended."""
    spec, ready = seen.spec, census.ready
    conds = conditions.set_condition(
        conds, conditions.CREATED, True, "ObjectsCreated", "the job's objects were created", now
    )
    conds = conditions.clear_condition(conds, conditions.SUSPENDED, "JobResumed", "spec.suspend is false", now)
    if clocks.reached_min is None:
        why = why or _pending_summary(census)
        message = (
            f"{ready} of minReplicas {spec.min_replicas} worker(s) ready: {why}; the job fails if minReplicas is not "
            f"reached within failurePolicy.startupTimeoutSeconds {spec.startup_timeout_seconds} s of {clocks.start}"
        )
        conds = conditions.set_condition(
            conds, conditions.WAITING_FOR_CAPACITY, True, "MinReplicasNotReached", message, now
        )
    else:
        conds = conditions.clear_condition(
            conds,
            conditions.WAITING_FOR_CAPACITY,
            "MinReplicasReached",
            f"minReplicas reached at {clocks.reached_min}",
            now,
        )
    below = ready < spec.min_replicas
    if clocks.reached_min is None:  # not "below" a minimum it never reached: WaitingForCapacity says it
        conds = conditions.set_condition(
            conds, conditions.BELOW_MIN, False, "NotStarted", "minReplicas not reached yet since the start", now
        )
    else:
        conds = conditions.set_condition(
            conds, conditions.BELOW_MIN, below, "NotEnoughWorkers" if below else "EnoughWorkers",
            f"{ready} ready worker(s), minReplicas {spec.min_replicas}", now,
        )  # fmt: skip
    conds = conditions.set_condition(
        conds, conditions.RUNNING, not below, "Training" if not below else "WaitingForWorkers",
        f"training with {ready} worker(s)" if not below else f"{ready} of at least {spec.min_replicas} ready", now,
    )  # fmt: skip
    scaling = ready != spec.desired
    conds = conditions.set_condition(
        conds, conditions.SCALING, scaling, "ScalingToDesired" if scaling else "AtDesired",
        f"{ready} ready of {spec.desired} desired", now,
    )  # fmt: skip
    if clocks.reached_min is None:
        return conditions.PENDING, conds
    if below:
        return conditions.PHASE_BELOW_MIN, conds
    return (conditions.PHASE_SCALING if scaling else conditions.PHASE_RUNNING), conds


def _etcd_tls(etcd: Mapping[str, Mapping[str, Any]]) -> bool:
    """Mutual TLS for the managed etcd, except where an etcd made without it runs (an operator upgrade
    under a running job): its workers hold no certificate, so it stays as it is until it is made anew."""
    deployment = etcd.get("Deployment")
    if deployment is None:
        return True
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
    return "--client-cert-auth" in (containers[0].get("command") or [])


def _last_failure(census: _Census, old: Mapping[str, Any], now: datetime) -> Any:
    """`status.lastFailure`: the newest failure this reconcile judged, or the one recorded before."""
    if not census.failures:
        return old.get("lastFailure")
    name, verdict = census.failures[-1]
    return {"pod": name, "reason": verdict.reason, "message": verdict.message, "time": conditions.timestamp(now)}


def _refusals(seen: Observed, result: Plan, *, blocked: bool) -> str | None:
    """Why the job cannot start, if the cluster refuses its objects (the etcd's pods: an Event once)."""
    refusal = etcd_refusal(seen.etcd, seen.now)
    if refusal is not None:
        result.refused.append(refusal)
        said = conditions.find(seen.status.get("conditions") or [], conditions.REPLICA_FAILURE) or {}
        if refusal.message not in str(said.get("message", "")):  # said once, not at every reconcile
            result.events.append(("Warning", refusal.reason, refusal.message))
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


def _pending_summary(census: _Census) -> str:
    if not census.pending:
        return "no worker pod yet"
    first = sorted(census.pending, key=_name)[0]
    return f"{len(census.pending)} pending, {_name(first)}: {waiting_reason(first)}"


def _progress(progress: Mapping[str, Any], old: Mapping[str, Any]) -> dict[str, Any]:
    """Rendezvous round and last checkpoint as the run reported them; the last known values otherwise."""
    result: dict[str, Any] = {}
    round_record = progress.get("round") or {}
    if isinstance(round_record.get("round"), int):
        result["rendezvousRound"] = round_record["round"]
    elif "rendezvousRound" in old:
        result["rendezvousRound"] = old["rendezvousRound"]
    checkpoint = progress.get("checkpoint") or {}
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


def _ensure_etcd(seen: Observed, job: JobRef, result: Plan) -> bool:
    """Create the managed etcd's missing objects and update changed ones; True while one's name is taken.

    A name taken by an object the job does not own is left alone and tried again every
    `NAME_RETRY_SECONDS`; meanwhile no worker is made, as workers would reach that
    object (a Service of the same name) instead of their own rendezvous.
    """
    if seen.spec.rdzv_endpoint:
        return False
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
            result.create.append(desired)
            continue
        wanted = desired["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH]
        if (actual.get("metadata", {}).get("annotations") or {}).get(constants.ANNOTATION_SPEC_HASH) != wanted:
            result.update.append(Update(desired["apiVersion"], kind, name, builders.update_patch(actual, desired)))
            result.events.append(("Normal", "Updated", f"{kind} {name} updated in place to the job's current spec"))
    return blocked


def _etcd_deletes(seen: Observed, why: str) -> list[Delete]:
    """Delete the managed etcd's objects the job owns (by uid: a same-named object of someone else stays)."""
    deletes = []
    for api_version, kind in ETCD_KINDS:
        actual = seen.etcd.get(kind)
        if actual is not None and str(actual.get("metadata", {}).get("uid", "")) not in seen.accounted:
            meta = actual.get("metadata", {})
            deletes.append(Delete(api_version, kind, str(meta.get("name", "")), str(meta.get("uid", "")), None, why))
    return deletes


def _scale(
    seen: Observed, job: JobRef, census: _Census, counts: _Counts, result: Plan, *, held: int, released: int
) -> None:
    """Create pods up to `desired` (lowest free indices), less those held back by the failure backoff;
    or delete the surplus (pending first, then the highest indices)."""
    desired = seen.spec.desired
    taken = {_index(pod) for pod in seen.pods}
    names = [
        *seen.names_in_use,
        *(f.key.removeprefix("Pod/") for f in seen.create_failures if f.key.startswith("Pod/")),
    ]
    prefix = f"{job.name}-worker-"
    taken |= {int(n.removeprefix(prefix)) for n in names if n.startswith(prefix) and n.removeprefix(prefix).isdigit()}
    missing = desired - len(census.active)
    if missing > 0:
        creating = missing - min(held, missing)
        owed = max(0, census.lost + released - held)
        index = 0
        for _ in range(creating):
            while index in taken:
                index += 1
            taken.add(index)
            result.create.append(builders.worker_pod(job, seen.spec, index))
            name = job.worker_name(index)
            if owed > 0:
                owed -= 1
                counts.restarts += 1
                result.events.append(("Normal", "Replaced", f"created worker pod {name} to replace a lost one"))
            else:
                result.events.append(("Normal", "ScaledUp", f"created worker pod {name} (desired {desired})"))
    elif missing < 0:
        for pod in sorted(census.active, key=lambda p: (_is_ready(p), -_index(p)))[:-missing]:
            name = _name(pod)
            result.delete.append(Delete("v1", "Pod", name, _uid(pod), None, "scale down"))
            result.accounted.append(_uid(pod))
            result.events.append(("Normal", "ScaledDown", f"deleted worker pod {name} (desired {desired})"))


def _cleanup(seen: Observed, census: _Census) -> list[Delete]:
    """Worker pods to delete when the job finished.

    Pending ones always (they never ran; kept, they would make the cluster autoscaler buy a
    spot VM for a job that is over), running ones unless `cleanPodPolicy: None` (with their
    grace period), finished ones only with `All`. Already-deleted ones are not asked again.
    """
    policy = seen.spec.clean_pod_policy
    chosen = []
    for pod in [*census.active, *census.succeeded]:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        phase = pod.get("status", {}).get("phase", "Pending")
        running = phase == "Running"
        done = phase in ("Succeeded", "Failed")
        if phase in {"Pending", "Unknown"} or (running and policy != "None") or (done and policy == "All"):
            chosen.append(Delete("v1", "Pod", _name(pod), _uid(pod), None, "job finished"))
    return chosen
