"""`torchspot evict node NAME [--hard]`: rehearse a spot eviction on any cluster, through the Kubernetes API.

What it does is what a node's eviction does to Kubernetes objects, without the cloud:
cordon the node (no new pods land there), then delete its pods with their own grace
period, so each gets SIGTERM and the time to write its emergency checkpoint (with
`--hard`, grace 0: the kubelet kills them at once, as when a VM vanishes). DaemonSet
pods stay, as with `kubectl drain`. The operator then sees its workers go and
replaces them. The node itself is left cordoned; `kubectl uncordon NAME` undoes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchspot_operator.kube import Kube


class NodeNotFoundError(LookupError):
    """The node named on the command line does not exist."""


@dataclass
class Eviction:
    """What an eviction did: the pods it deleted and the ones it left (DaemonSets)."""

    node: str
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def _owned_by_daemonset(pod: Mapping[str, Any]) -> bool:
    return any(ref.get("kind") == "DaemonSet" for ref in pod.get("metadata", {}).get("ownerReferences") or [])


async def evict_node(kube: Kube, node: str, *, hard: bool) -> Eviction:
    """Cordon `node` and delete its pods (grace 0 when `hard`); DaemonSet pods are kept."""
    if await kube.get("v1", "nodes", None, node) is None:
        raise NodeNotFoundError(f"node {node!r} not found")
    await kube.patch("v1", "nodes", None, node, {"spec": {"unschedulable": True}})
    result = Eviction(node)
    for pod in await kube.list("v1", "Pod", None, fields={"spec.nodeName": node}):
        meta = pod["metadata"]
        name = f"{meta['namespace']}/{meta['name']}"
        if _owned_by_daemonset(pod):
            result.kept.append(name)
            continue
        await kube.delete("v1", "Pod", meta["namespace"], meta["name"], grace=0 if hard else None)
        result.deleted.append(name)
    return result
