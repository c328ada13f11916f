"""The sandbox's node agent: scheduler, kubelet, Deployment controller and cloud, on one machine.

The API emulator has no controllers, so this plays them, polling the API a few times
a second:

- nodes: creates the scenario's Node objects (the spot pool with AKS's label and
  taint), and on the scenario's orders evicts (with notice: SIGTERM to the node's
  processes, SIGKILL after the pod's grace period; hard: SIGKILL at once), then
  deletes the Node as Azure and the cloud controller would, and a little later any pod
  still bound to it as the pod garbage collector would; freezes (SIGSTOP, then
  NotReady after a delay); or adds spot nodes back;
- Deployments: one pod per Deployment (the managed etcd), as a ReplicaSet would;
- scheduling: binds each Pending pod to a ready node it fits (node selector,
  tolerations of NoSchedule/NoExecute taints, GPU capacity), spreading pods;
- kubelet: runs the first container of each bound pod as local processes with the
  pod's environment (`env`, `valueFrom` fields, `envFrom` Secrets, `$(VAR)`
  expansion), emptyDir mount paths mapped to a folder per pod, and Service addresses
  (`<svc>.<ns>.svc:<port>`) rewritten to the loopback port of the pod behind them;
  reports Running, then the exit code, back through the API; stops the processes of
  a pod that was deleted (SIGTERM, SIGKILL after its grace period).

Images are not pulled: `IMAGES` maps an image to what runs locally (the trainer
image to `torchspot-run`; an etcd image to a real etcd on a free loopback port).
"""

from __future__ import annotations

import base64
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torchspot_lab.etcd import EtcdServer
from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.local import signal_tree
from torchspot_lab.scenario import Scenario
from torchspot_operator import certs, constants
from torchspot_operator.kube import ApiError, Kube

log = logging.getLogger(__name__)

POLL = 0.25
"""Seconds between two looks at the API: how fast pods start, stop and get scheduled."""
LAUNCHER = [sys.executable, "-m", "torchspot_trainer.launch"]
IMAGES: dict[str, list[str]] = {"torchspot-trainer": LAUNCHER, "torchspot/trainer": LAUNCHER}
"""Image name fragments and the local command standing in for their entry point."""
ETCD_IMAGE = re.compile(r"(^|/)etcd:")
POD_GC_DELAY = 5.0
"""Seconds after a node is deleted until its leftover pods are (the operator deletes its own at once)."""
POD_IP = "127.0.0.1"
AGENT_POOL = "kubernetes.azure.com/agentpool"
SYSTEM_MODE = "kubernetes.azure.com/mode"
UNREACHABLE_TAINT = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
DISRUPTED = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_object(name: str, *, spot: bool, gpus: int, cpu: int) -> dict[str, Any]:
    """A Node as AKS registers it: pool labels, the spot label and taint, capacity (pure)."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        AGENT_POOL: "gpuspot" if spot else "system",
        SYSTEM_MODE: "user" if spot else "system",
    }
    taints: list[dict[str, str]] = []
    if spot:
        labels[constants.SPOT_LABEL] = constants.SPOT_VALUE
        taints.append({"key": constants.SPOT_LABEL, "value": constants.SPOT_VALUE, "effect": "NoSchedule"})
    capacity = {"cpu": str(cpu), "memory": "256Gi", "pods": "110"}
    if gpus:
        capacity[constants.GPU_RESOURCE] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints, "providerID": f"sandbox:///{name}"},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


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


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known variables are replaced, unknown ones left as written (pure)."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)


@dataclass
class SimNode:
    """One simulated node and what the agent knows about it."""

    name: str
    spot: bool
    gpus: int
    state: str = "ready"
    """ready, frozen, evicting or gone."""
    frozen_at: float = 0.0
    marked_not_ready: bool = False


@dataclass
class RunningPod:
    """A pod the kubelet runs: its process (or etcd server), where it logs, and its grace period."""

    namespace: str
    name: str
    uid: str
    node: str
    log_path: Path
    grace: float
    container: str = ""
    process: subprocess.Popen[bytes] | None = None
    etcd: EtcdServer | None = None
    ports: dict[int, int] = field(default_factory=dict)
    """Container port -> the loopback port that serves it."""
    labels: dict[str, str] = field(default_factory=dict)
    stopping: bool = False
    evicted: bool = False
    """Its node is being taken away: its end is reported as the kubelet's node shutdown, never as the app's."""
    reported_exit: bool = False


class NodeAgent:
    """Plays the cluster's controllers for the sandbox (see the module docstring).

    :param api: the emulated API (its event loop runs our API calls).
    :param workdir: where pods get their folders and logs.
    :param scenario: the pools to create at the start and the freeze delay.
    :param on_action: told (text) of every eviction, freeze and node added, for the timeline.
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
        self.nodes: dict[str, SimNode] = {}
        self.pods: dict[str, RunningPod] = {}
        self.services: dict[str, str] = {}
        """`host:port` as pods and the operator name it (Service DNS) -> `127.0.0.1:<port>`."""
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="node-agent", daemon=True)
        self._spot_count = 0
        self._timers: list[threading.Timer] = []
        self.errors: list[str] = []

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Create the initial nodes and start playing the controllers."""
        (self.workdir / "pods").mkdir(parents=True, exist_ok=True)
        for name, spot in self.scenario.initial_nodes():
            self._add_node(name, spot=spot)
        self._spot_count = self.scenario.spot.nodes
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and every process (SIGKILL: the run is over)."""
        self._stop.set()
        for timer in self._timers:
            timer.cancel()
        self._thread.join(30)
        with self._lock:
            for pod in list(self.pods.values()):
                self._kill(pod)
            self.pods.clear()
        self.api.run(self.kube.close())

    # -- the scenario's actions -------------------------------------------------------

    def evict(self, name: str, *, notice: bool) -> None:
        """Take a node away: with notice, SIGTERM and the grace period; else SIGKILL. Then delete the Node."""
        with self._lock:
            node = self.nodes[name]
            node.state = "evicting"
            victims = [p for p in self.pods.values() if p.node == name]
        self.on_action("evict", f"{name} evicted {'with notice' if notice else 'without notice'}")
        threading.Thread(target=self._evict, args=(node, victims, notice), name=f"evict-{name}", daemon=True).start()

    def _evict(self, node: SimNode, victims: list[RunningPod], notice: bool) -> None:
        if notice:
            for pod in victims:  # the kubelet shuts them down for the node's sake, and says so
                pod.evicted = True
                self._patch_status(pod, {"conditions": [DISRUPTED, {"type": "Ready", "status": "False"}]})
            self._stop_gracefully(victims)
        else:
            for pod in victims:  # the VM vanishes with its kubelet: nobody reports how the pods ended
                pod.reported_exit = True
                self._kill(pod)
        self._delete_node(node)

    def freeze(self, name: str) -> None:
        """Stop a node's processes where they stand (a hung VM); NotReady follows after the scenario's delay."""
        with self._lock:
            node = self.nodes[name]
            node.state, node.frozen_at = "frozen", time.monotonic()
            for pod in self.pods.values():
                if pod.node == name:
                    self._signal(pod, signal.SIGSTOP)
        self.on_action("freeze", f"{name} frozen (NotReady after {self.scenario.not_ready_after:g} s)")

    def add_spot(self, count: int) -> list[str]:
        """Capacity returns: `count` new spot nodes."""
        names = []
        with self._lock:  # the loop iterates over the nodes
            for _ in range(count):
                self._spot_count += 1
                name = f"spot-{self._spot_count}"
                self._add_node(name, spot=True)
                names.append(name)
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
            self._mark_frozen_nodes(bodies)
            self._stop_deleted(pods)
            self._replicate(deployments, pods)
            self._map_services(services)
            self._schedule(pods, bodies)
            self._run_bound(pods)
            self._report_exits()

    def _mark_frozen_nodes(self, bodies: Mapping[str, Mapping[str, Any]]) -> None:
        for node in self.nodes.values():
            due = node.frozen_at + self.scenario.not_ready_after
            if node.state == "frozen" and not node.marked_not_ready and time.monotonic() >= due:
                node.marked_not_ready = True
                status = {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}]}
                taint = {**UNREACHABLE_TAINT, "timeAdded": _now()}
                taints = (bodies.get(node.name) or {}).get("spec", {}).get("taints") or []
                patch = {"spec": {"taints": [*taints, taint]}, "status": status}
                self.api.run(self.kube.patch("v1", "nodes", None, node.name, patch))
                self.on_action("notready", f"{node.name} NotReady (frozen {self.scenario.not_ready_after:g} s ago)")

    def _stop_deleted(self, pods: list[dict[str, Any]]) -> None:
        present = {p["metadata"].get("uid") for p in pods}
        for uid, pod in list(self.pods.items()):
            if uid in present:
                continue
            del self.pods[uid]
            node = self.nodes.get(pod.node)
            if node is not None and node.state == "frozen":
                self._kill(pod)  # the node is hung: nothing there runs a graceful stop
            elif not pod.stopping:
                pod.stopping = True
                threading.Thread(target=self._stop_gracefully, args=([pod],), daemon=True).start()

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
        mapping: dict[str, str] = {}
        for service in services:
            meta, spec = service["metadata"], service.get("spec", {})
            selector = spec.get("selector") or {}
            backend = next(
                (
                    p
                    for p in self.pods.values()
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
        self.services = mapping

    def _schedule(self, pods: list[dict[str, Any]], bodies: Mapping[str, Mapping[str, Any]]) -> None:
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
            for node in self.nodes.values():
                if node.state != "ready":
                    continue
                body = bodies.get(node.name)
                if body is not None and fits(pod, body, node.gpus - used.get(node.name, 0)):
                    candidates.append(node.name)
            if not candidates:
                continue  # stays Pending: the autoscaler's signal
            chosen = min(candidates, key=lambda n: (count.get(n, 0), n))
            meta = pod["metadata"]
            try:
                self.api.run(
                    self.kube.patch("v1", "pods", meta["namespace"], meta["name"], {"spec": {"nodeName": chosen}})
                )
            except ApiError as exc:
                if exc.status != 404:
                    raise
                continue  # deleted since the list (the operator replaced it, or its job ended): nothing to bind
            pod.setdefault("spec", {})["nodeName"] = chosen
            used[chosen] = used.get(chosen, 0) + gpus_requested(pod)
            count[chosen] = count.get(chosen, 0) + 1

    def _run_bound(self, pods: list[dict[str, Any]]) -> None:
        for pod in pods:
            meta, spec = pod["metadata"], pod.get("spec", {})
            uid = meta.get("uid", "")
            node = self.nodes.get(spec.get("nodeName") or "")
            if uid in self.pods or node is None or node.state != "ready":
                continue
            if pod.get("status", {}).get("phase") not in (None, "Pending"):
                continue
            started = self._start(pod, node)
            if started is not None:
                self.pods[uid] = started
                status = {
                    "phase": "Running",
                    "podIP": POD_IP,
                    "hostIP": POD_IP,
                    "startTime": _now(),
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "containerStatuses": [
                        {
                            "name": spec["containers"][0]["name"],
                            "ready": True,
                            "state": {"running": {"startedAt": _now()}},
                        }
                    ],
                }
                self._patch_status(started, status)

    def _report_exits(self) -> None:
        for pod in list(self.pods.values()):
            if pod.process is None or pod.reported_exit or pod.process.poll() is None:
                continue
            pod.reported_exit = True
            code = pod.process.returncode
            exit_code = code if code >= 0 else 128 - code  # killed by signal n: 128 + n, as a container runtime says
            terminated = {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "finishedAt": _now(),
            }
            status: dict[str, Any] = {
                "phase": "Succeeded" if exit_code == 0 else "Failed",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [{"name": pod.container, "ready": False, "state": {"terminated": terminated}}],
            }
            if pod.evicted:  # graceful node shutdown: Failed, reason Terminated, whatever the exit code
                status.update(phase="Failed", reason="Terminated", message="the node was shut down (spot eviction)")
                status["conditions"] = [DISRUPTED, {"type": "Ready", "status": "False"}]
            self._patch_status(pod, status)

    # -- pods as processes --------------------------------------------------------------

    def _start(self, pod: dict[str, Any], node: SimNode) -> RunningPod | None:
        meta, spec = pod["metadata"], pod["spec"]
        container = spec["containers"][0]
        folder = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta.get('uid', '')[:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        running = RunningPod(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta.get("uid", ""),
            node=node.name,
            log_path=folder / "log.txt",
            grace=float(spec.get("terminationGracePeriodSeconds", 30)),
            container=str(container.get("name", "")),
            labels=dict(meta.get("labels", {})),
        )
        image = str(container.get("image", ""))
        if ETCD_IMAGE.search(image):
            tls = None
            if "--client-cert-auth" in (container.get("command") or []):  # its certificates, from its Secret
                files = self._secret_files(pod["metadata"]["namespace"], spec, whole=True)  # its client pair too
                if files is None:
                    return None  # the Secret is not there yet: try again next round
                tls = certs.from_secret_files(files)
            etcd = EtcdServer(folder / "etcd-data", log_path=running.log_path, tls=tls)
            etcd.start()
            running.etcd = etcd
            for port in container.get("ports", []):
                running.ports[int(port["containerPort"])] = etcd.port
            return running
        command = self._command(container, image)
        mounts = self._mounts(spec, container, folder)
        secrets = self._secret_mounts(pod["metadata"]["namespace"], spec, container, folder)
        env = self._environment(pod, container, node)
        if env is None or secrets is None:
            return None  # a Secret or Service it needs is not there yet: try again next round
        mounts.update(secrets)
        env = {key: ",".join(self._rewrite(part, mounts) for part in value.split(",")) for key, value in env.items()}
        args = [self._rewrite(expand(str(a), env), mounts) for a in command]
        with running.log_path.open("ab") as out:
            running.process = subprocess.Popen(
                args, env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return running

    def _command(self, container: Mapping[str, Any], image: str) -> list[str]:
        if container.get("command"):
            return [*container["command"], *container.get("args", [])]
        entry = next((cmd for fragment, cmd in IMAGES.items() if fragment in image), None)
        if entry is None:
            raise ValueError(f"the sandbox has no local stand-in for image {image!r} (known: {', '.join(IMAGES)})")
        return [*entry, *container.get("args", [])]

    def _environment(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], node: SimNode
    ) -> dict[str, str] | None:
        namespace = pod["metadata"]["namespace"]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV")}
        env["HOME"] = str(self.workdir)
        # The pods share this machine's cores: one thread each instead of one per core in every
        # pod (three ResNet workers on 2 cores train twice as fast so). The pod's env may override.
        env["OMP_NUM_THREADS"] = "1"
        for source in container.get("envFrom", []):
            ref = source.get("secretRef")
            if ref is None:
                continue
            secret = self.api.run(self.kube.get("v1", "secrets", namespace, ref["name"]))
            if secret is None:
                return None
            env.update(_secret_values(secret))
        fields = {"status.podIP": POD_IP, "spec.nodeName": node.name, "metadata.name": pod["metadata"]["name"],
                  "metadata.namespace": namespace}  # fmt: skip
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(str(item["value"]), env)
            elif "fieldRef" in (item.get("valueFrom") or {}):
                env[item["name"]] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
        for key, value in env.items():
            for address in _addresses(value):
                if address.endswith(f":{constants.ETCD_PORT}") and address not in self.services:
                    return None  # its rendezvous Service has no backend yet (DNS would not answer either)
                env[key] = value.replace(address, self.services.get(address, address))
        return env

    def _secret_files(
        self, namespace: str, spec: Mapping[str, Any], volume_name: str = "", *, whole: bool = False
    ) -> dict[str, bytes] | None:
        """The files of a pod's Secret volume (the named one, or the first), its items only unless
        `whole`; None if the Secret is missing."""
        volumes = [v for v in spec.get("volumes", []) if "secret" in v and volume_name in ("", v["name"])]
        if not volumes:
            return {}
        volume = volumes[0]["secret"]
        secret = self.api.run(self.kube.get("v1", "secrets", namespace, volume["secretName"]))
        if secret is None:
            return None
        data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
        items = (None if whole else volume.get("items")) or [{"key": k, "path": k} for k in data]
        return {item["path"]: data[item["key"]] for item in items if item["key"] in data}

    def _secret_mounts(
        self, namespace: str, spec: Mapping[str, Any], container: Mapping[str, Any], folder: Path
    ) -> dict[str, Path] | None:
        """Secret volumes as a kubelet projects them: their files in a folder of the pod (mount path ->
        folder); None while a Secret is missing."""
        secret_volumes = {v["name"] for v in spec.get("volumes", []) if "secret" in v}
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in secret_volumes:
                continue
            files = self._secret_files(namespace, spec, mount["name"])
            if files is None:
                return None
            local = folder / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            for name, data in files.items():
                (local / name).write_bytes(data)
                (local / name).chmod(0o600)
            mounts[mount["mountPath"].rstrip("/")] = local
        return mounts

    @staticmethod
    def _mounts(spec: Mapping[str, Any], container: Mapping[str, Any], folder: Path) -> dict[str, Path]:
        """emptyDir mount paths -> a folder of the pod (other volume kinds are left alone)."""
        empty = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        mounts = {}
        for mount in container.get("volumeMounts", []):
            if mount["name"] in empty:
                local = folder / "volumes" / mount["name"]
                local.mkdir(parents=True, exist_ok=True)
                mounts[mount["mountPath"].rstrip("/")] = local
        return mounts

    @staticmethod
    def _rewrite(arg: str, mounts: Mapping[str, Path]) -> str:
        flag, eq, value = arg.partition("=")
        target = value if eq else arg
        for path, local in mounts.items():
            if target == path or target.startswith(path + "/"):
                target = str(local) + target[len(path) :]
                break
        return f"{flag}={target}" if eq else target

    # -- signals ----------------------------------------------------------------------

    def _alive(self, pod: RunningPod) -> bool:
        return pod.process is not None and pod.process.poll() is None

    def _signal(self, pod: RunningPod, sig: signal.Signals) -> None:
        if self._alive(pod) and pod.process is not None:
            signal_tree(pod.process.pid, sig)

    def _kill(self, pod: RunningPod) -> None:
        if self._alive(pod) and pod.process is not None:
            signal_tree(pod.process.pid, signal.SIGCONT)
            signal_tree(pod.process.pid, signal.SIGKILL)
            pod.process.wait(10)
        if pod.etcd is not None:
            pod.etcd.stop()
            pod.etcd = None

    def _stop_gracefully(self, pods: list[RunningPod]) -> None:
        """What the kubelet does to pods it stops: SIGTERM, their grace period, SIGKILL."""
        for pod in pods:
            self._signal(pod, signal.SIGTERM)
        deadline = time.monotonic() + max((p.grace for p in pods), default=0.0)
        while time.monotonic() < deadline and any(self._alive(p) for p in pods):
            time.sleep(0.1)
        for pod in pods:
            self._kill(pod)

    # -- API helpers ------------------------------------------------------------------

    def _add_node(self, name: str, *, spot: bool) -> None:
        pool = self.scenario.spot if spot else self.scenario.on_demand
        self.nodes[name] = SimNode(name, spot, pool.gpus)
        self.api.run(self.kube.create(node_object(name, spot=spot, gpus=pool.gpus, cpu=pool.cpu)))

    def _delete_node(self, node: SimNode) -> None:
        with self._lock:
            node.state = "gone"
        self.api.run(self.kube.delete("v1", "nodes", None, node.name))
        timer = threading.Timer(POD_GC_DELAY, self._collect_pods, args=(node.name,))
        self._timers.append(timer)
        timer.start()

    def _collect_pods(self, node: str) -> None:
        """The pod garbage collector: pods still bound to a node that is gone are deleted."""
        if self._stop.is_set():
            return
        try:
            for pod in self.api.run(self.kube.list("v1", "Pod", None, fields={"spec.nodeName": node})):
                meta = pod["metadata"]
                self.api.run(self.kube.delete("v1", "Pod", meta["namespace"], meta["name"], grace=0))
        except Exception as exc:  # the sandbox may be shutting down; reported with the others
            self.errors.append(f"pod garbage collection of {node}: {type(exc).__name__}: {exc}")

    def _patch_status(self, pod: RunningPod, status: dict[str, Any]) -> None:
        try:
            self.api.run(self.kube.patch("v1", "pods", pod.namespace, pod.name, {"status": status}))
        except Exception as exc:  # the pod may have been deleted meanwhile
            log.debug("status of %s/%s not written: %s", pod.namespace, pod.name, exc)


def _secret_values(secret: Mapping[str, Any]) -> dict[str, str]:
    """A Secret's keys and values, from `data` (base64) and `stringData` (pure)."""
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update({k: str(v) for k, v in (secret.get("stringData") or {}).items()})
    return values


_SERVICE_ADDRESS = re.compile(r"[a-z0-9][-a-z0-9.]*\.svc(?:\.cluster\.local)?:\d+")


def _addresses(value: str) -> list[str]:
    """host:port substrings of an environment value that name a Service (pure)."""
    return _SERVICE_ADDRESS.findall(value)
