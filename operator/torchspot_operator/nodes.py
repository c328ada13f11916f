"""What a worker's node says about the worker, as Kubernetes' node lifecycle controller reads it. Pure,
apart from `RateLimiter`'s clock.

Two kinds of signal, kept apart because they deserve different trust:
- *definite*: the node object is gone or being deleted, or carries a drain taint
  (`constants.DRAIN_TAINTS`: the cluster autoscaler removing it, AKS auto-drain before a
  spot preempt). The node is going; its workers are moved off at once, so the job re-forms
  without them and their replacements start elsewhere.
- *soft*: Ready is False or Unknown (or, with cordon handling on, the node is cordoned).
  That can be the node, or the control plane's view of it: after an API-server outage or a
  network blip every node turns Unknown at once while every kubelet and its pods run on.
  So a NotReady node's worker is moved only after its grace (the pod's toleration of the
  not-ready or unreachable taint, 300 s unless it says; or the operator's setting), never
  while more than a share of the watched nodes is NotReady (`full_disruption`), and at most
  `NODE_EVICTION_RATE` nodes a second cluster-wide (`RateLimiter`), as the node lifecycle
  controller does.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from torchspot_operator import conditions, constants


@dataclass(frozen=True)
class NodePolicy:
    """The operator's node settings (settings.py), as the plan applies them."""

    grace_seconds: float | None = None
    """How long a worker may stay on a NotReady node; None: its own tolerations say."""
    cordon: bool = False
    """Whether a cordoned node's workers are moved off (rate-limited, as NotReady ones)."""
    full_disruption_share: float = constants.FULL_DISRUPTION_SHARE
    eviction_rate: float = constants.NODE_EVICTION_RATE


def project(node: Mapping[str, Any]) -> dict[str, Any]:
    """What the node rules read of a node, and nothing else: what the operator's node cache keeps.

    A node as the API serves it is about 100 KiB (its images list, managedFields, capacity and
    labels); this keeps its name, uid (a listing's deletions are found by it), deletion time,
    `unschedulable`, the taints the rules name (drain, not-ready, unreachable) and its Ready
    condition: a thousand nodes cost well under a MiB."""
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    watched = {*constants.DRAIN_TAINTS, constants.NOT_READY_TAINT, constants.UNREACHABLE_TAINT}
    ready = conditions.find(node.get("status", {}).get("conditions") or [], "Ready")
    return {
        "metadata": {key: meta[key] for key in ("name", "uid", "deletionTimestamp") if key in meta},
        "spec": {
            **({"unschedulable": True} if spec.get("unschedulable") else {}),
            "taints": [dict(t) for t in spec.get("taints") or [] if t.get("key") in watched],
        },
        "status": {"conditions": [] if ready is None else [dict(ready)]},
    }


def definite(node: Mapping[str, Any] | None) -> str | None:
    """Why a node's pods must leave now (it is gone, being deleted or drained), or None."""
    if node is None:
        return "node is gone"
    if node.get("metadata", {}).get("deletionTimestamp"):
        return "node is being deleted"
    for taint in node.get("spec", {}).get("taints") or []:
        if taint.get("key") in constants.DRAIN_TAINTS:
            return f"node has taint {taint['key']}"
    return None


def ready_status(node: Mapping[str, Any]) -> tuple[str, str | None]:
    """The node's Ready condition: its status ("True", "False", "Unknown") and when it last flipped."""
    found = conditions.find(node.get("status", {}).get("conditions") or [], "Ready")
    if found is None:
        return "Unknown", None
    return str(found.get("status", "Unknown")), found.get("lastTransitionTime")


def soft(node: Mapping[str, Any], policy: NodePolicy) -> str | None:
    """Why a node may be failing (NotReady, Unknown; cordoned with cordon handling on), or None."""
    status, _ = ready_status(node)
    if status == "False":
        return "node is NotReady"
    if status != "True":
        return "node is unreachable (Ready Unknown)"
    if policy.cordon and node.get("spec", {}).get("unschedulable"):
        return "node is cordoned"
    return None


def grace(pod: Mapping[str, Any], node: Mapping[str, Any], policy: NodePolicy) -> float:
    """Seconds the pod may stay on its NotReady node: the policy's, else its toleration of the taint the
    node lifecycle controller puts there (not-ready for False, unreachable for Unknown), else 300."""
    if policy.grace_seconds is not None:
        return policy.grace_seconds
    status, _ = ready_status(node)
    if status == "True":  # cordoned: no toleration applies
        return 0.0
    key = constants.NOT_READY_TAINT if status == "False" else constants.UNREACHABLE_TAINT
    for toleration in pod.get("spec", {}).get("tolerations") or []:
        matches = toleration.get("key") == key or (not toleration.get("key") and toleration.get("operator") == "Exists")
        if matches and toleration.get("effect") in (None, "", "NoExecute"):
            seconds = toleration.get("tolerationSeconds")
            return float("inf") if seconds is None else max(0.0, float(seconds))
    return float(constants.DEFAULT_NOT_READY_TOLERATION_SECONDS)


def due(pod: Mapping[str, Any], node: Mapping[str, Any], policy: NodePolicy, now: datetime) -> bool:
    """Whether the pod's grace on its soft-troubled node is over."""
    status, since = ready_status(node)
    waited = 0.0 if since is None else (now - conditions.parse_timestamp(since)).total_seconds()
    if status == "True":  # cordoned (with cordon handling on): no grace
        return True
    return waited >= grace(pod, node, policy)


def full_disruption(nodes: Iterable[Mapping[str, Any]], share: float) -> bool:
    """Whether so many of the watched nodes are NotReady that the fault is the control plane's view:
    all of them, or more than two and at least `share` of them."""
    total = bad = 0
    for node in nodes:
        total += 1
        bad += ready_status(node)[0] != "True"
    return bad > 0 and (bad == total or (bad > 2 and bad >= share * total))


class RateLimiter:
    """A token bucket: `rate` admissions a second, one at a time (burst 1), as the node lifecycle
    controller's eviction queue; `clock` is injectable for tests."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._clock = clock
        self._next = float("-inf")

    def admit(self) -> bool:
        """Take a token if one is there."""
        now = self._clock()
        if self.rate <= 0 or now < self._next:
            return False
        self._next = now + 1.0 / self.rate
        return True


def selected(labels: Mapping[str, str], selector: str) -> bool:
    """Whether labels match a label selector as the API server matches them (every term: `key=value`,
    `key==value`, `key!=value`, `key`, `!key`, `key in (a,b)`, `key notin (a,b)`); empty: all do.
    The node watch's filter, applied here too: an API that ignores the selector (the lab's emulator)
    then still keeps other nodes out of the cache."""
    for term in (t.strip() for t in re.split(r",(?![^()]*\))", selector) if t.strip()):
        found = re.fullmatch(r"(\S+?)\s+(in|notin)\s+\((.*)\)", term)
        if found:
            key, verb, values = found.group(1), found.group(2), {v.strip() for v in found.group(3).split(",")}
            if (labels.get(key) in values) != (verb == "in") or (verb == "in" and key not in labels):
                return False
        elif "!=" in term:
            key, value = (part.strip() for part in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (part.strip() for part in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True
