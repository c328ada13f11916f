"""The sandbox's node agent: plays the cluster's controllers, polling the API a few times a second.

The API emulator has no controllers. Each round the agent lists pods, Deployments, Services and
Nodes once, and then:
- the cloud (cloud.py) reports frozen nodes NotReady after the scenario's delay;
- the kubelet (kubelet.py) stops the pods that were deleted;
- a ReplicaSet's work: one pod per Deployment (the managed etcd), named after it;
- Service routing: each Service address pods may name -> the loopback port of the pod behind it;
- the scheduler (scheduler.py) binds Pending pods;
- the kubelet starts the bound ones and reports those that exited.
The scenario's actions (evict, freeze, add capacity) arrive from the sandbox's thread.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torchspot_lab.cluster.cloud import Cloud, SimNode
from torchspot_lab.cluster.kubelet import Kubelet, RunningPod
from torchspot_lab.cluster.scheduler import bind_pending
from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.scenario import Scenario
from torchspot_operator.kube import Kube

log = logging.getLogger(__name__)

POLL = 0.25
"""Seconds between two looks at the API: how fast pods start, stop and get scheduled."""


class NodeAgent:
    """Plays the cluster's controllers for the sandbox (see the module docstring).

    :param api: the emulated API (its event loop runs our API calls).
    :param workdir: where pods get their folders and logs.
    :param scenario: the pools to create at the start and the freeze delay.
    :param on_action: told (kind, text) of every eviction, freeze and node added, for the timeline.
    """

    def __init__(
        self,
        api: KubeApi,
        workdir: Path,
        scenario: Scenario,
        on_action: Callable[[str, str], None] = lambda kind, text: None,
    ) -> None:
        self.api = api
        self.kube = Kube(server=api.url, headers={}, ssl_context=True)
        self.workdir = workdir
        self.scenario = scenario
        self.on_action = on_action
        self.errors: list[str] = []
        self.services: dict[str, str] = {}
        """`host:port` as pods and the operator name it (Service DNS) -> `127.0.0.1:<port>`."""
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="node-agent", daemon=True)
        self.cloud = Cloud(api, self.kube, scenario, stopped=self._stop, errors=self.errors)
        self.kubelet = Kubelet(api, self.kube, workdir, services=lambda: self.services)

    @property
    def nodes(self) -> dict[str, SimNode]:
        """The simulated nodes by name."""
        return self.cloud.nodes

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Create the initial nodes and start playing the controllers."""
        (self.workdir / "pods").mkdir(parents=True, exist_ok=True)
        self.cloud.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and every process (SIGKILL: the run is over)."""
        self._stop.set()
        self.cloud.stop()
        self._thread.join(30)
        with self._lock:
            self.kubelet.kill_all()
        self.api.run(self.kube.close())

    # -- the scenario's actions -------------------------------------------------------

    def evict(self, name: str, *, notice: bool) -> None:
        """Take a node away: with notice, SIGTERM and the grace period; else SIGKILL. Then delete the Node."""
        with self._lock:
            node = self.nodes[name]
            node.state = "evicting"
            victims = self.kubelet.on_node(name)
        self.on_action("evict", f"{name} evicted {'with notice' if notice else 'without notice'}")
        threading.Thread(target=self._evict, args=(node, victims, notice), name=f"evict-{name}", daemon=True).start()

    def _evict(self, node: SimNode, victims: list[RunningPod], notice: bool) -> None:
        self.kubelet.shut_down(victims, notice=notice)
        with self._lock:
            self.cloud.delete_node(node)

    def freeze(self, name: str) -> None:
        """Stop a node's processes where they stand (a hung VM); NotReady follows after the scenario's delay."""
        with self._lock:
            self.cloud.freeze(name)
            for pod in self.kubelet.on_node(name):
                self.kubelet.signal(pod, signal.SIGSTOP)
        self.on_action("freeze", f"{name} frozen (NotReady after {self.scenario.not_ready_after:g} s)")

    def add_spot(
        self, count: int, *, labels: Mapping[str, str] | None = None, taints: Sequence[Mapping[str, str]] = ()
    ) -> list[str]:
        """Capacity returns: `count` new spot nodes, with their pool's own labels and taints if any (a pool
        that only some jobs' pods tolerate: several jobs in one sandbox, each on its own nodes)."""
        with self._lock:  # the loop iterates over the nodes
            names = self.cloud.add_spot(count, labels=labels, taints=taints)
        self.on_action("add", f"spot capacity back: {', '.join(names)}")
        return names

    def resolve(self, endpoint: str) -> str:
        """A Service address as pods name it, mapped to the loopback port behind it (else unchanged)."""
        with self._lock:
            return self.services.get(endpoint, endpoint)

    # -- the loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(POLL):
            try:
                self._step()
            except Exception as exc:  # a bad step must not end the sandbox; it is reported at the end
                log.exception("node agent step failed")
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _step(self) -> None:
        pods = self.api.run(self.kube.list("v1", "Pod", None))
        deployments = self.api.run(self.kube.list("apps/v1", "Deployment", None))
        services = self.api.run(self.kube.list("v1", "Service", None))
        bodies = {n["metadata"]["name"]: n for n in self.api.run(self.kube.list("v1", "Node", None))}
        with self._lock:
            self.cloud.mark_not_ready(bodies, self.on_action)
            self.kubelet.stop_deleted(pods, self.nodes)
            self._replicate(deployments, pods)
            self._map_services(services)
            bind_pending(self.api, self.kube, pods, self.nodes, bodies)
            self.kubelet.run_bound(pods, self.nodes)
            self.kubelet.report_exits()

    def _replicate(self, deployments: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        """One pod per Deployment (what a ReplicaSet would keep), named after it."""
        for deployment in deployments:
            meta = deployment["metadata"]
            name = f"{meta['name']}-0"
            if any(p["metadata"]["name"] == name and p["metadata"].get("namespace") == meta["namespace"] for p in pods):
                continue
            template = deployment["spec"]["template"]
            owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"], "uid": meta.get("uid", "")}
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": meta["namespace"],
                    "labels": dict(template.get("metadata", {}).get("labels", {})),
                    "ownerReferences": [owner],
                },
                "spec": template["spec"],
                "status": {"phase": "Pending"},
            }
            self.api.run(self.kube.create(pod))

    def _map_services(self, services: list[dict[str, Any]]) -> None:
        self.services = service_routes(services, list(self.kubelet.pods.values()))


def service_routes(services: list[dict[str, Any]], pods: list[RunningPod]) -> dict[str, str]:
    """Every address a Service answers to (`name`, `name.ns`, `name.ns.svc`, `...cluster.local`, with its
    port) -> the loopback address of the running pod its selector picks (pure)."""
    mapping: dict[str, str] = {}
    for service in services:
        meta, spec = service["metadata"], service.get("spec", {})
        selector: Mapping[str, Any] = spec.get("selector") or {}
        backend = next(
            (
                p
                for p in pods
                if p.namespace == meta["namespace"]
                and selector
                and all(p.labels.get(k) == v for k, v in selector.items())
            ),
            None,
        )
        if backend is None:
            continue
        for port in spec.get("ports", []):
            local = backend.ports.get(int(port.get("targetPort", port["port"])))
            if local is None:
                continue
            name, namespace = meta["name"], meta["namespace"]
            for host in (
                name,
                f"{name}.{namespace}",
                f"{name}.{namespace}.svc",
                f"{name}.{namespace}.svc.cluster.local",
            ):
                mapping[f"{host}:{port['port']}"] = f"127.0.0.1:{local}"
    return mapping
