"""The sandbox's scheduler: each Pending pod bound to a ready node it fits (node selector,
tolerations of NoSchedule/NoExecute taints, GPU capacity), spreading pods over the nodes.
Whether a pod fits a node is pure; `bind_pending` makes the bindings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchspot_lab.cluster.cloud import SimNode
from torchspot_lab.kubeapi import KubeApi
from torchspot_operator import constants
from torchspot_operator.kube import ApiError, Kube


def tolerates(tolerations: list[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Whether one of the pod's tolerations covers the taint, by Kubernetes' rules (pure)."""
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("operator", "Equal") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def gpus_requested(pod: Mapping[str, Any]) -> int:
    """GPUs a pod asks for (limits, or requests), summed over its containers (pure)."""
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        resources = container.get("resources") or {}
        wanted = (resources.get("limits") or {}).get(constants.GPU_RESOURCE) or (resources.get("requests") or {}).get(
            constants.GPU_RESOURCE
        )
        total += int(wanted or 0)
    return total


def fits(pod: Mapping[str, Any], node: Mapping[str, Any], gpus_free: int) -> bool:
    """Whether the scheduler may bind `pod` to `node` (pure)."""
    spec = pod.get("spec", {})
    labels = node.get("metadata", {}).get("labels", {})
    if node.get("spec", {}).get("unschedulable"):
        return False
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    tolerations = spec.get("tolerations") or []
    for taint in node.get("spec", {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return False
    return gpus_requested(pod) <= gpus_free


def bind_pending(
    api: KubeApi,
    kube: Kube,
    pods: list[dict[str, Any]],
    nodes: Mapping[str, SimNode],
    bodies: Mapping[str, Mapping[str, Any]],
) -> None:
    """Bind each Pending pod, oldest first, to the ready node it fits with the fewest pods; one that
    fits nowhere stays Pending (the cluster autoscaler's signal). `bodies` are the listed Nodes."""
    used: dict[str, int] = {}
    count: dict[str, int] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if node and pod.get("status", {}).get("phase") in (None, "Pending", "Running"):
            used[node] = used.get(node, 0) + gpus_requested(pod)
            count[node] = count.get(node, 0) + 1
    waiting = [
        p
        for p in pods
        if not p.get("spec", {}).get("nodeName") and p.get("status", {}).get("phase", "Pending") == "Pending"
    ]
    for pod in sorted(waiting, key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"])):
        candidates = []
        for node in nodes.values():
            if node.state != "ready":
                continue
            body = bodies.get(node.name)
            if body is not None and fits(pod, body, node.gpus - used.get(node.name, 0)):
                candidates.append(node.name)
        if not candidates:
            continue
        chosen = min(candidates, key=lambda n: (count.get(n, 0), n))
        meta = pod["metadata"]
        try:
            api.run(kube.patch("v1", "pods", meta["namespace"], meta["name"], {"spec": {"nodeName": chosen}}))
        except ApiError as exc:
            if exc.status != 404:
                raise
            continue  # deleted since the list (the operator replaced it, or its job ended): nothing to bind
        pod.setdefault("spec", {})["nodeName"] = chosen
        used[chosen] = used.get(chosen, 0) + gpus_requested(pod)
        count[chosen] = count.get(chosen, 0) + 1
