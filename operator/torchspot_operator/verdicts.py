"""Each worker pod judged: eviction, failure, success or active. Pure.

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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchspot_operator import conditions, constants

DISRUPTED_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "Shutdown", "Terminated", "NodeShutdown"})


EVICTION = "eviction"


FAILURE = "failure"


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


def disruption_target(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's DisruptionTarget condition, if it is True."""
    found = conditions.find(pod.get("status", {}).get("conditions") or [], "DisruptionTarget")
    return found if found is not None and found.get("status") == "True" else None


def classify(pod: Mapping[str, Any], trouble: str | None = None) -> Verdict:
    """Why a Failed worker pod ended: an eviction if the cluster says so (or its node is in
    `trouble`), else a failure: OOMKilled, an exit code, or refused before it ran."""
    pod_status = pod.get("status", {})
    disruption = disruption_target(pod)
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


def is_ready(pod: Mapping[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return pod.get("status", {}).get("phase") == "Running" and conditions.is_true(conds, "Ready")


def pod_index(pod: Mapping[str, Any]) -> int:
    try:
        return int(pod.get("metadata", {}).get("labels", {}).get(constants.LABEL_INDEX, "-1"))
    except ValueError:
        return -1


def pod_name(pod: Mapping[str, Any]) -> str:
    return str(pod.get("metadata", {}).get("name", ""))


def pod_uid(pod: Mapping[str, Any]) -> str:
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
class Census:
    """The worker pods sorted by what they mean for the job."""

    active: list[Mapping[str, Any]] = field(default_factory=list)
    ready: int = 0
    pending: list[Mapping[str, Any]] = field(default_factory=list)
    succeeded: list[Mapping[str, Any]] = field(default_factory=list)
    lost: int = 0
    """Pods lost in this observation (evicted or failed), each owed a replacement."""
    failures: list[tuple[str, Verdict]] = field(default_factory=list)
    """(pod, verdict) of the failures counted in this observation."""
