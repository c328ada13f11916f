"""The sandbox's cloud: the scenario's nodes as AKS registers them, and what the spot market does to
them. A node is taken away (deleted, as Azure and the cloud controller do, and a little later any
pod still bound to it, as the pod garbage collector does), frozen (NotReady with the unreachable
taint after the scenario's delay, as the node lifecycle controller marks a node whose kubelet went
silent) or added back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.scenario import Scenario
from torchspot_operator import conditions, constants
from torchspot_operator.kube import Kube

POD_GC_DELAY = 5.0
"""Seconds after a node is deleted until its leftover pods are (the operator deletes its own at once)."""
AGENT_POOL = "kubernetes.azure.com/agentpool"
SYSTEM_MODE = "kubernetes.azure.com/mode"
UNREACHABLE_TAINT = {"key": constants.UNREACHABLE_TAINT, "effect": "NoExecute"}


def node_object(
    name: str,
    *,
    spot: bool,
    gpus: int,
    cpu: int,
    labels: Mapping[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (),
) -> dict[str, Any]:
    """A Node as AKS registers it: pool labels, the spot label and taint, capacity (pure). `labels` and
    `taints`: its pool's own (an AKS node pool's `nodeLabels` and `nodeTaints`), beside AKS's."""
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        AGENT_POOL: "gpuspot" if spot else "system",
        SYSTEM_MODE: "user" if spot else "system",
    }
    node_taints: list[dict[str, str]] = [dict(taint) for taint in taints]
    if spot:
        node_labels[constants.SPOT_LABEL] = constants.SPOT_VALUE
        node_taints.append({"key": constants.SPOT_LABEL, "value": constants.SPOT_VALUE, "effect": "NoSchedule"})
    node_labels.update(labels or {})
    capacity = {"cpu": str(cpu), "memory": "256Gi", "pods": "110"}
    if gpus:
        capacity[constants.GPU_RESOURCE] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": node_labels},
        "spec": {"taints": node_taints, "providerID": f"sandbox:///{name}"},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


@dataclass
class SimNode:
    """One simulated node and what the sandbox knows about it."""

    name: str
    spot: bool
    gpus: int
    state: str = "ready"
    """ready, frozen, evicting or gone."""
    frozen_at: float = 0.0
    marked_not_ready: bool = False


class Cloud:
    """The nodes of the scenario's pools, and their fate.

    :param api: the emulated API (its event loop runs our API calls).
    :param kube: the API client the node agent shares.
    :param scenario: the pools and the freeze delay.
    :param stopped: set when the sandbox stops: pending pod collections are skipped then.
    :param errors: where failures of background work go, for the sandbox's report.
    """

    def __init__(
        self, api: KubeApi, kube: Kube, scenario: Scenario, *, stopped: threading.Event, errors: list[str]
    ) -> None:
        self.api = api
        self.kube = kube
        self.scenario = scenario
        self.nodes: dict[str, SimNode] = {}
        self._stopped = stopped
        self._errors = errors
        self._spot_count = 0
        self._timers: list[threading.Timer] = []

    def start(self) -> None:
        """Create the scenario's initial nodes."""
        for name, spot in self.scenario.initial_nodes():
            self.add_node(name, spot=spot)
        self._spot_count = self.scenario.spot.nodes

    def stop(self) -> None:
        """Cancel the pod collections still pending."""
        for timer in self._timers:
            timer.cancel()

    def add_node(
        self,
        name: str,
        *,
        spot: bool,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
    ) -> None:
        """Register a node of the spot or the on-demand pool, with its pool's own labels and taints if any."""
        pool = self.scenario.spot if spot else self.scenario.on_demand
        self.nodes[name] = SimNode(name, spot, pool.gpus)
        body = node_object(name, spot=spot, gpus=pool.gpus, cpu=pool.cpu, labels=labels, taints=taints)
        self.api.run(self.kube.create(body))

    def add_spot(
        self, count: int, *, labels: Mapping[str, str] | None = None, taints: Sequence[Mapping[str, str]] = ()
    ) -> list[str]:
        """Capacity returns: `count` new spot nodes, numbered on from the last (`add_node`)."""
        names = []
        for _ in range(count):
            self._spot_count += 1
            name = f"spot-{self._spot_count}"
            self.add_node(name, spot=True, labels=labels, taints=taints)
            names.append(name)
        return names

    def freeze(self, name: str) -> SimNode:
        """Mark a node hung from now on; `mark_not_ready` reports it after the scenario's delay."""
        node = self.nodes[name]
        node.state, node.frozen_at = "frozen", time.monotonic()
        return node

    def mark_not_ready(self, bodies: Mapping[str, Mapping[str, Any]], on_action: Callable[[str, str], None]) -> None:
        """Frozen nodes whose delay is over: Ready Unknown and the unreachable taint, as the node lifecycle
        controller marks a node whose kubelet stopped posting its status."""
        for node in self.nodes.values():
            due = node.frozen_at + self.scenario.not_ready_after
            if node.state == "frozen" and not node.marked_not_ready and time.monotonic() >= due:
                node.marked_not_ready = True
                status = {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}]}
                taint = {**UNREACHABLE_TAINT, "timeAdded": conditions.timestamp(datetime.now(UTC))}
                taints = (bodies.get(node.name) or {}).get("spec", {}).get("taints") or []
                patch = {"spec": {"taints": [*taints, taint]}, "status": status}
                self.api.run(self.kube.patch("v1", "nodes", None, node.name, patch))
                on_action("notready", f"{node.name} NotReady (frozen {self.scenario.not_ready_after:g} s ago)")

    def delete_node(self, node: SimNode) -> None:
        """The VM is gone: its Node is deleted, and its leftover pods `POD_GC_DELAY` later."""
        node.state = "gone"
        self.api.run(self.kube.delete("v1", "nodes", None, node.name))
        timer = threading.Timer(POD_GC_DELAY, self._collect_pods, args=(node.name,))
        self._timers.append(timer)
        timer.start()

    def _collect_pods(self, node: str) -> None:
        """The pod garbage collector: pods still bound to a node that is gone are deleted."""
        if self._stopped.is_set():
            return
        try:
            for pod in self.api.run(self.kube.list("v1", "Pod", None, fields={"spec.nodeName": node})):
                meta = pod["metadata"]
                self.api.run(self.kube.delete("v1", "Pod", meta["namespace"], meta["name"], grace=0))
        except Exception as exc:  # the sandbox may be shutting down; reported with the others
            self._errors.append(f"pod garbage collection of {node}: {type(exc).__name__}: {exc}")
