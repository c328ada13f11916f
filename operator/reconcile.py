"""Desired against actual: what to create, delete, say and record for one ElasticJob. Pure.

`plan` takes what the API layer observed (the job, its worker pods, their nodes, its
etcd objects, the time) and returns a `Plan`. It is level-based: the same observation
gives the same plan whether a create, an update, a pod event, a node event, a resume
or the timer asked for it, so repeating it converges instead of piling up actions.

How pods are judged:
- *lost*: on a node that is gone, NotReady, being deleted, cordoned, or tainted for
  eviction (spot eviction, autoscaler scale-down). Deleted at once with their grace
  period, so torchrun's SIGTERM handling writes the emergency checkpoint and the
  survivors re-form now, not after heartbeats or collective timeouts. An eviction.
- *evicted*: failed by a signal or by Kubernetes (reason Evicted, a DisruptionTarget
  condition, exit code above 128). Deleted and replaced; never counts as a failure.
- *application failure*: exited non-zero by itself. Replaced, and counted against
  `failurePolicy.maxRestarts`.
- *succeeded*: exited 0. torchrun agents exit 0 only when the whole worker group
  finished, so the first success means the run is complete: nothing is replaced from
  then on, and the job is Succeeded once no worker pod is still active.
- *pending*: not yet Ready (unscheduled pods are the autoscaler's signal to add spot
  nodes; they are kept, and training goes on at the size that is Ready).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from torchspot.operator import builders, constants, status
from torchspot.operator.builders import JobRef
from torchspot.operator.spec import JobSpec

SIGNAL_EXIT = 128
"""Exit codes above this mean a signal ended the container (137 = SIGKILL, 143 = SIGTERM)."""
EVICTED_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "Shutdown", "Terminated", "NodeShutdown"})


@dataclass(frozen=True)
class Delete:
    """Delete a worker pod; `grace` None keeps the pod's own grace period."""

    name: str
    grace: int | None
    why: str


@dataclass
class Plan:
    """What one reconcile decided."""

    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[Delete] = field(default_factory=list)
    delete_etcd: bool = False
    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type, reason, message): Normal or Warning Kubernetes Events."""


@dataclass(frozen=True)
class Observed:
    """What the API layer read for one job."""

    job: JobRef
    spec: JobSpec
    status: Mapping[str, Any]
    pods: Sequence[Mapping[str, Any]]
    nodes: Mapping[str, Mapping[str, Any]]
    """The nodes the worker pods are bound to, by name (a missing name: the node is gone)."""
    etcd_objects: frozenset[str]
    """Kinds of the managed etcd's objects that exist (Deployment, Service, PodDisruptionBudget)."""
    now: datetime
    progress: Mapping[str, Any] = field(default_factory=dict)
    """What the run reported through etcd: `round` and `checkpoint` records (see operator/progress.py)."""
    node_handling: bool = True
    """False: a bad node is not a reason to move its workers (`constants.NODE_HANDLING_ENV`)."""


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


def _exit_code(pod: Mapping[str, Any]) -> int | None:
    for container in pod.get("status", {}).get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated is not None:
            return int(terminated.get("exitCode", 0))
    return None


def _is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return pod.get("status", {}).get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def failure_kind(pod: Mapping[str, Any]) -> str:
    """`evicted` (a signal or Kubernetes ended it) or `application` (it exited non-zero by itself)."""
    pod_status = pod.get("status", {})
    if pod_status.get("reason") in EVICTED_REASONS:
        return "evicted"
    if any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in pod_status.get("conditions") or []
    ):
        return "evicted"
    code = _exit_code(pod)
    if code is None or code > SIGNAL_EXIT:
        return "evicted"
    return "application"


def _index(pod: Mapping[str, Any]) -> int:
    try:
        return int(pod.get("metadata", {}).get("labels", {}).get(constants.LABEL_INDEX, "-1"))
    except ValueError:
        return -1


@dataclass
class _Census:
    """The worker pods sorted by what they mean for the job."""

    active: list[Mapping[str, Any]] = field(default_factory=list)
    ready: int = 0
    pending: int = 0
    succeeded: bool = False
    to_replace: int = 0


def _judge(seen: Observed, counters: dict[str, int], result: Plan) -> _Census:
    """Sort the pods (see the module docstring), queueing deletions and events for the lost and failed."""
    census = _Census()
    for pod in seen.pods:
        meta = pod.get("metadata", {})
        name = meta.get("name", "")
        if meta.get("deletionTimestamp"):
            continue  # leaving already; its replacement was counted when it was deleted
        phase = pod.get("status", {}).get("phase", "Pending")
        node_name = pod.get("spec", {}).get("nodeName")
        if phase == "Succeeded":
            census.succeeded = True
            continue
        if phase == "Failed":
            kind = failure_kind(pod)
            if kind == "evicted":
                counters["evictions"] += 1
                result.events.append(("Warning", "Evicted", f"worker pod {name} was evicted ({_why(pod)})"))
            else:
                counters["applicationFailures"] += 1
                message = f"worker pod {name} exited with code {_exit_code(pod)}"
                result.events.append(("Warning", "WorkerFailed", message))
            result.delete.append(Delete(name, 0, f"{kind} failure"))
            census.to_replace += 1
            continue
        trouble = node_trouble(seen.nodes.get(node_name)) if node_name and seen.node_handling else None
        if trouble is not None:
            counters["evictions"] += 1
            result.events.append(("Warning", "Evicted", f"worker pod {name} on {node_name}: {trouble}"))
            result.delete.append(Delete(name, 0 if trouble == "node is gone" else None, trouble))
            census.to_replace += 1
            continue
        census.active.append(pod)
        if _is_ready(pod):
            census.ready += 1
        else:
            census.pending += 1
    return census


def plan(seen: Observed) -> Plan:
    """Decide one reconcile's actions and the job's new status."""
    job, spec, old = seen.job, seen.spec, seen.status
    result = Plan()
    counters = {key: int(old.get(key, 0)) for key in ("evictions", "restarts", "applicationFailures")}
    census = _judge(seen, counters, result)
    active, ready, pending, succeeded = census.active, census.ready, census.pending, census.succeeded
    finished_phase = old.get("phase") in status.FINISHED_PHASES

    desired = spec.desired
    app_failed = counters["applicationFailures"] > spec.max_restarts
    below_since = old.get("belowMinSince")
    if ready >= spec.min_replicas or succeeded:
        below_since = None
    elif below_since is None:
        below_since = status.timestamp(seen.now)
    below_too_long = (
        below_since is not None
        and (seen.now - status.parse_timestamp(below_since)).total_seconds() > spec.below_min_grace_seconds
    )

    done = finished_phase or succeeded or app_failed or below_too_long
    if not done:
        if not spec.rdzv_endpoint:
            etcd = [
                builders.etcd_deployment(job, spec),
                builders.etcd_service(job),
                builders.etcd_disruption_budget(job),
            ]
            result.create.extend(obj for obj in etcd if obj["kind"] not in seen.etcd_objects)
        _scale(seen, active, census.to_replace, counters, result)

    phase, conditions = status.conditions_for(
        old.get("conditions") or [],
        seen.now,
        ready=ready,
        desired=desired,
        spec=spec,
        started=bool(old.get("startedAt")) or ready >= spec.min_replicas,
        succeeded=succeeded and not active,
        finishing=succeeded,
        failed_reason=_failed_reason(old, app_failed, below_too_long, counters, spec),
    )
    if phase in status.FINISHED_PHASES:
        result.delete_etcd = bool(seen.etcd_objects) and not spec.rdzv_endpoint
        result.delete.extend(_cleanup(spec, seen.pods, result.delete))
    result.status = {
        "phase": phase,
        "selector": job.selector(),
        "runId": job.run_id,
        "replicas": {"desired": desired, "ready": ready, "pending": pending},
        **counters,
        **_progress(seen.progress, old),
        "belowMinSince": below_since,
        "startedAt": old.get("startedAt") or (status.timestamp(seen.now) if ready >= spec.min_replicas else None),
        "conditions": conditions,
    }
    return result


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


def _why(pod: Mapping[str, Any]) -> str:
    pod_status = pod.get("status", {})
    reason = pod_status.get("reason")
    code = _exit_code(pod)
    return reason or (f"exit code {code}" if code is not None else "no exit code")


def _failed_reason(
    old: Mapping[str, Any], app_failed: bool, below_too_long: bool, counters: Mapping[str, int], spec: JobSpec
) -> tuple[str, str] | None:
    if old.get("phase") == "Failed":
        for condition in old.get("conditions") or []:
            if condition.get("type") == status.FAILED:
                return condition.get("reason", "Failed"), condition.get("message", "")
    if app_failed:
        return (
            "TooManyFailures",
            f"{counters['applicationFailures']} application failures exceed failurePolicy.maxRestarts "
            f"{spec.max_restarts}",
        )
    if below_too_long:
        return (
            "BelowMinTooLong",
            f"ready workers stayed below minReplicas {spec.min_replicas} for more than "
            f"{spec.below_min_grace_seconds} s",
        )
    return None


def _scale(
    seen: Observed, active: list[Mapping[str, Any]], replace: int, counters: dict[str, int], result: Plan
) -> None:
    """Create pods up to `desired` (lowest free indices) or delete the surplus (pending, then highest)."""
    desired = seen.spec.desired
    taken = {_index(pod) for pod in seen.pods}
    missing = desired - len(active)
    if missing > 0:
        index = 0
        for _ in range(missing):
            while index in taken:
                index += 1
            taken.add(index)
            result.create.append(builders.worker_pod(seen.job, seen.spec, index))
            name = seen.job.worker_name(index)
            if replace > 0:
                replace -= 1
                counters["restarts"] += 1
                result.events.append(("Normal", "Replaced", f"created worker pod {name} to replace a lost one"))
            else:
                result.events.append(("Normal", "ScaledUp", f"created worker pod {name} (desired {desired})"))
    elif missing < 0:
        # Pending pods go first (they train nothing yet), then the highest indices.
        for pod in sorted(active, key=lambda p: (_is_ready(p), -_index(p)))[:-missing]:
            name = pod["metadata"]["name"]
            result.delete.append(Delete(name, None, "scale down"))
            result.events.append(("Normal", "ScaledDown", f"deleted worker pod {name} (desired {desired})"))


def _cleanup(spec: JobSpec, pods: Sequence[Mapping[str, Any]], already: list[Delete]) -> list[Delete]:
    """Worker pods to delete when the job finished: all of them, those still active, or none."""
    if spec.clean_pod_policy == "None":
        return []
    gone = {d.name for d in already}
    chosen = []
    for pod in pods:
        meta = pod.get("metadata", {})
        finished = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
        if meta.get("deletionTimestamp") or meta.get("name") in gone:
            continue
        if spec.clean_pod_policy == "All" or not finished:
            chosen.append(Delete(meta["name"], None, "job finished"))
    return chosen
