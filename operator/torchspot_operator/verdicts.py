"""Each worker pod judged: eviction, failure, success or active. Pure.

How a worker pod is judged, in the spirit of Kubernetes Job's podFailurePolicy:
- *eviction*: what the cluster says is one: a `DisruptionTarget` condition (any of its
  reasons: preemption, the taint manager, the eviction API, pod GC, the kubelet under node
  pressure), a node reason (graceful node shutdown, preemption), a node fault at admission
  (the device plugin of a fresh spot VM not registered yet), its node gone, being deleted
  or drained (nodes.py; a NotReady node only after the pod's grace), or a deletion by
  anyone but the operator (a user's `kubectl delete pod`). Replaced at once and not
  counted against `failurePolicy.maxRestarts`, within the eviction budget (lifecycle.py).
  A worker that exited with the node-fault code (`constants.NODE_FAULT_EXIT_CODE`: its node cannot
  run the program) is an eviction too, and the job's new workers avoid its node.
- *failure*: a non-zero exit, OOMKilled, a kubelet limit eviction (`Evicted` with no
  DisruptionTarget: the pod's own emptyDir or ephemeral-storage limit), a container that
  waits for what retrying cannot fix, or a pod the kubelet refused before it ran for a
  reason of its own. Counted against `failurePolicy.maxRestarts`; replacements after
  consecutive failures back off (10 s doubling, capped at 5 min). Failed pods are kept
  for their logs (the newest `FAILED_PODS_KEPT`), marked as counted.
- *success*: the trainer exited 0. torchrun's agent exits 0 only after every agent of
  the group reached its exit barrier with its workers done, so one success means the run
  is complete: the job is Succeeded in that same reconcile. A pod that exited 0 while
  being deleted or disrupted (a wrapper that exits 0 on SIGTERM) is an eviction instead.
- *active*: anything else; Ready ones train, the rest are pending (unscheduled pods are
  the cluster autoscaler's signal to add spot nodes: they are kept, and training goes on
  at the size that is Ready).
Each pod is judged once: the controller passes the uids it already counted or deleted
(`accounted`), kept failed pods carry their mark, and the plan returns those it counts now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from torchspot_operator import conditions, constants, nodes

NODE_REASONS = frozenset({"Preempting", "Shutdown", "Terminated", "NodeShutdown"})
"""Pod reasons of a node's doing (scheduler preemption, graceful node shutdown): evictions even from
a kubelet too old to add a DisruptionTarget condition. `Evicted` is not among them: with no
DisruptionTarget it is the kubelet enforcing the pod's own limits (an emptyDir's sizeLimit, its
ephemeral storage), which Kubernetes counts as the pod's fault."""


EVICTION = "eviction"


FAILURE = "failure"


@dataclass(frozen=True)
class Verdict:
    """Why a worker pod ended: `EVICTION` or `FAILURE`, with a reason and a message for people."""

    kind: str
    reason: str
    message: str


POD_METADATA = (
    "name", "namespace", "uid", "resourceVersion", "creationTimestamp", "deletionTimestamp", "labels",
    "ownerReferences",
)  # fmt: skip
POD_STATUS = ("phase", "reason", "message", "conditions")
CONTAINER_STATUS = ("name", "state", "lastState", "ready", "restartCount")
CONDITION = ("type", "status", "reason", "message", "lastTransitionTime")
POD_CONDITIONS = ("Ready", "PodScheduled", "DisruptionTarget")
"""The pod conditions the verdicts read (readiness, scheduling, and how the cluster evicted it)."""


def project(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator's decisions read of a worker pod, and nothing else: what the pod index keeps.

    A pod as the API serves it is about 23 KiB with its `managedFields`, volumes, environment and
    every container's status; this keeps its identity, owner, node, tolerations (the NotReady grace),
    the operator's own annotations, phase, conditions and the trainer container's name and status:
    8,000 workers then cost a few MiB of cache, not 180."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    kept = {key: meta[key] for key in POD_METADATA if key in meta}
    for key in ("labels", "annotations"):  # only the operator's own
        ours = {k: v for k, v in (meta.get(key) or {}).items() if k.startswith(constants.GROUP)}
        if ours:
            kept[key] = ours
    containers = spec.get("containers") or []
    trainer = trainer_status(pod)
    graced = (constants.NOT_READY_TAINT, constants.UNREACHABLE_TAINT, None)  # what `nodes.grace` reads
    projected: dict[str, Any] = {
        "metadata": kept,
        "spec": {
            **({"nodeName": spec["nodeName"]} if spec.get("nodeName") else {}),
            "tolerations": [t for t in spec.get("tolerations") or [] if t.get("key") in graced],
            "containers": [{"name": containers[0].get("name")}] if containers else [],
        },
        "status": {key: status[key] for key in POD_STATUS if key in status},
    }
    projected["status"]["conditions"] = [
        {k: c[k] for k in CONDITION if k in c}
        for c in status.get("conditions") or []
        if c.get("type") in POD_CONDITIONS
    ]
    if trainer is not None:
        projected["status"]["containerStatuses"] = [{k: trainer[k] for k in CONTAINER_STATUS if k in trainer}]
    return projected


def trainer_status(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The status of the pod's trainer container (the template's first container), found by its name:
    sidecars (a service mesh's proxy, a log shipper) report their own containers beside it."""
    containers = pod.get("spec", {}).get("containers") or [{}]
    name = containers[0].get("name")
    statuses = pod.get("status", {}).get("containerStatuses") or []
    found = next((c for c in statuses if c.get("name") == name), None)
    if found is None and statuses and (name is None or all("name" not in c for c in statuses)):
        return dict(statuses[0])  # a status without names (an old record): the only one there is
    return None if found is None else dict(found)


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    status = trainer_status(pod)
    terminated = ((status or {}).get("state") or {}).get("terminated")
    return None if terminated is None else dict(terminated)


def disruption_target(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's DisruptionTarget condition, if it is True."""
    found = conditions.find(pod.get("status", {}).get("conditions") or [], "DisruptionTarget")
    return found if found is not None and found.get("status") == "True" else None


def run_completed(pod: Mapping[str, Any]) -> bool:
    """Whether a worker pod says its run completed: it exited 0 (Succeeded), and not while the cluster
    stopped it (being deleted, or a DisruptionTarget: a wrapper that exits 0 on SIGTERM in a drain)."""
    if pod.get("status", {}).get("phase") != "Succeeded":
        return False
    return not (pod.get("metadata", {}).get("deletionTimestamp") or disruption_target(pod))


def classify(pod: Mapping[str, Any], trouble: str | None = None) -> Verdict:
    """Why a Failed worker pod ended: an eviction if the cluster says so (a DisruptionTarget, a node
    reason, a node fault at admission, or its node gone: `trouble`) or its worker found its node
    unable to run the program (the node-fault exit code), else a failure: a limit eviction,
    OOMKilled, an exit code, or refused before it ran."""
    pod_status = pod.get("status", {})
    disruption = disruption_target(pod)
    if disruption is not None:
        return Verdict(
            EVICTION, str(disruption.get("reason") or "DisruptionTarget"), str(disruption.get("message", ""))
        )
    reason = str(pod_status.get("reason") or "")
    message = str(pod_status.get("message") or "")
    if reason in NODE_REASONS:
        return Verdict(EVICTION, reason, message)
    if trouble is not None:
        return Verdict(EVICTION, "NodeLost", trouble)
    if reason == "Evicted":  # no DisruptionTarget: the kubelet enforced the pod's own limit
        return Verdict(FAILURE, "LimitEvicted", message or "evicted by the kubelet for exceeding a limit of its own")
    terminated = _terminated(pod)
    if terminated is None:  # never ran: the kubelet refused it
        if reason.startswith(constants.NODE_FAULT_REASONS):  # the node's device plugin, not the job
            return Verdict(EVICTION, reason, message or "the node refused the pod")
        return Verdict(FAILURE, reason or "AdmissionFailed", message or "the pod failed before its container ran")
    code = terminated.get("exitCode")
    if code == constants.NODE_FAULT_EXIT_CODE:
        node = pod.get("spec", {}).get("nodeName") or "its node"
        return Verdict(EVICTION, constants.NODE_FAULT_REASON, f"exit code {code}: {node} cannot run the program")
    if terminated.get("reason") == "OOMKilled":
        return Verdict(FAILURE, "OOMKilled", f"out of memory (exit code {code})")
    detail = f" ({terminated['reason']})" if terminated.get("reason") not in (None, "Error") else ""
    return Verdict(FAILURE, "ExitCode", f"exit code {code}{detail}")


@dataclass(frozen=True)
class Loss:
    """A live worker pod judged lost (`judge`): why, the deletion's grace (None: the pod's own; 0 for a
    node that is gone, where nobody would run the pod's shutdown), the event's text, and whether the pod
    is kept for its logs (a Failed one) rather than deleted."""

    verdict: Verdict
    grace: int | None
    text: str
    keep: bool = False


def judge(
    pod: Mapping[str, Any],
    phase: str,
    node: Mapping[str, Any] | None,
    *,
    node_handling: bool,
    policy: nodes.NodePolicy,
    admitted: bool,
    now: datetime,
) -> Loss | None:
    """A live worker pod (neither finished nor being deleted): lost, and why, or None where it is active.
    Pure. In order: Failed (`classify`, a node that cannot run the program named so its replacements avoid
    it); its node gone, being deleted or drained (`nodes.definite`); its node NotReady past the pod's
    grace, where the cluster-wide rate limit let the plan act on it (`admitted`); a wait that retrying
    cannot fix, for `PERMANENT_WAIT_SECONDS`. `node_handling` False: a node's state moves no pod."""
    node_name = str(pod.get("spec", {}).get("nodeName") or "")
    definite = nodes.definite(node) if node_name and node_handling else None
    if phase == "Failed":
        verdict = classify(pod, definite)
        said = f"{verdict.reason}: {verdict.message}" if verdict.message else verdict.reason
        text = f"({said})" if verdict.kind == EVICTION else verdict.message
        if verdict.reason == constants.NODE_FAULT_REASON and node_name:
            text += "; its replacements avoid that node"
        return Loss(verdict, None, text, keep=True)
    if definite is not None:
        grace = 0 if definite == "node is gone" else None
        return Loss(Verdict(EVICTION, "NodeLost", definite), grace, f"on {node_name}: {definite}")
    soft = nodes.soft(node, policy) if node is not None and node_handling else None
    if soft is not None and admitted and nodes.due(pod, node or {}, policy, now):
        return Loss(Verdict(EVICTION, "NodeNotReady", soft), None, f"on {node_name}: {soft}, past the pod's grace")
    stuck, since = permanent_wait(pod), waiting_since(pod)
    waited = None if since is None else (now - conditions.parse_timestamp(since)).total_seconds()
    if stuck is not None and waited is not None and waited >= constants.PERMANENT_WAIT_SECONDS:
        reason, message = stuck
        return Loss(Verdict(FAILURE, reason, message), None, f"{message} (for {constants.PERMANENT_WAIT_SECONDS} s)")
    return None


def permanent_wait(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) if the trainer container waits for something retrying will not fix."""
    waiting = ((trainer_status(pod) or {}).get("state") or {}).get("waiting") or {}
    reason = str(waiting.get("reason") or "")
    if reason in constants.PERMANENT_WAIT_REASONS:
        return reason, str(waiting.get("message") or reason)
    return None


def waiting_since(pod: Mapping[str, Any]) -> str | None:
    """When the pod was bound to its node (its PodScheduled condition), else when it was created."""
    scheduled = conditions.find(pod.get("status", {}).get("conditions") or [], "PodScheduled")
    if scheduled is not None and scheduled.get("status") == "True" and scheduled.get("lastTransitionTime"):
        return str(scheduled["lastTransitionTime"])
    created = pod.get("metadata", {}).get("creationTimestamp")
    return None if created is None else str(created)


def is_ready(pod: Mapping[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return pod.get("status", {}).get("phase") == "Running" and conditions.is_true(conds, "Ready")


def pod_index(pod: Mapping[str, Any]) -> int:
    """The worker's number: its annotation, or the end of its name (`<job>-worker-<n>`); -1 if neither."""
    meta = pod.get("metadata", {})
    said = (meta.get("annotations") or {}).get(constants.ANNOTATION_INDEX) or str(meta.get("name", "")).rsplit("-", 1)[
        -1
    ]
    return int(said) if said.isdigit() else -1


def kept(pod: Mapping[str, Any]) -> bool:
    """A failed pod the operator counted and keeps for its logs (`constants.ANNOTATION_ACCOUNTED`)."""
    return constants.ANNOTATION_ACCOUNTED in (pod.get("metadata", {}).get("annotations") or {})


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
    waiting = ((trainer_status(pod) or {}).get("state") or {}).get("waiting")
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
    kept: list[Mapping[str, Any]] = field(default_factory=list)
    """Failed pods counted before and kept for their logs (`constants.FAILED_PODS_KEPT` at most)."""
    lost: int = 0
    """Pods lost in this observation (evicted or failed), each owed a replacement."""
    evictions: list[Verdict] = field(default_factory=list)
    """The evictions counted in this observation (for the eviction budget)."""
    failures: list[tuple[str, Verdict]] = field(default_factory=list)
    """(pod, verdict) of the failures counted in this observation."""
    faulty_nodes: list[str] = field(default_factory=list)
    """The nodes of the node faults counted in this observation (`constants.NODE_FAULT_REASON`)."""
