"""The sandbox's kubelet: each bound pod's first container run as local processes.

What a kubelet does, as far as the sandbox needs it:
- the pod's environment: `env` (with `$(VAR)` expansion and `valueFrom` fields), `envFrom`
  Secrets, and Service addresses (`<svc>.<ns>.svc:<port>`) rewritten to the loopback port of the
  pod behind them;
- volumes: emptyDir mount paths mapped to a folder of the pod, Secret volumes projected there;
- status: Running once started, then the exit code (a node shut down for an eviction reports
  `Terminated` with the DisruptionTarget condition, as a kubelet's graceful node shutdown does);
- stopping: SIGTERM, the pod's grace period, SIGKILL; a hung node's processes are killed at once.

Images are not pulled: `IMAGES` maps an image to what runs locally (the trainer image to
`torchspot-run`; an etcd image to a real etcd on a free loopback port).
"""

from __future__ import annotations

import base64
import logging
import os
import re
import shutil
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

from torchspot_lab.cluster.cloud import SimNode
from torchspot_lab.etcd import EtcdServer
from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.local import SHARED_CORES_ENV, kill_tree, node_tmp, signal_tree
from torchspot_operator import certs, conditions, constants
from torchspot_operator.kube import Kube
from torchspot_trainer import SNAPSHOT_DIR_ENV

log = logging.getLogger(__name__)

LAUNCHER = [sys.executable, "-m", "torchspot_trainer.launch"]
IMAGES: dict[str, list[str]] = {"torchspot-trainer": LAUNCHER, "torchspot/trainer": LAUNCHER}
"""Image name fragments and the local command standing in for their entry point."""
ETCD_IMAGE = re.compile(r"(^|/)etcd:")
POD_IP = "127.0.0.1"
DEVICE_ENV = f"{constants.TRAINER_ENV_PREFIX}DEVICE"
"""The trainer's `--device` from the environment (what the operator sets for GPU jobs)."""
DISRUPTED = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_SERVICE_ADDRESS = re.compile(r"[a-z0-9][-a-z0-9.]*\.svc(?:\.cluster\.local)?:\d+")


def _now() -> str:
    return conditions.timestamp(datetime.now(UTC))


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known variables are replaced, unknown ones left as written (pure)."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def secret_values(secret: Mapping[str, Any]) -> dict[str, str]:
    """A Secret's keys and values, from `data` (base64) and `stringData` (pure)."""
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update({k: str(v) for k, v in (secret.get("stringData") or {}).items()})
    return values


def service_addresses(value: str) -> list[str]:
    """host:port substrings of an environment value that name a Service (pure)."""
    return _SERVICE_ADDRESS.findall(value)


def empty_dir_mounts(spec: Mapping[str, Any], container: Mapping[str, Any], folder: Path) -> dict[str, Path]:
    """emptyDir mount paths -> a folder of the pod (other volume kinds are left alone)."""
    empty = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in empty:
            local = folder / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"].rstrip("/")] = local
    return mounts


def rewrite_path(arg: str, mounts: Mapping[str, Path]) -> str:
    """An argument (or the value of a `--flag=value`) under a mount path, moved to the pod's local folder."""
    flag, eq, value = arg.partition("=")
    target = value if eq else arg
    for path, local in mounts.items():
        if target == path or target.startswith(path + "/"):
            target = str(local) + target[len(path) :]
            break
    return f"{flag}={target}" if eq else target


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
    tmp: Path | None = None
    """Its container's /tmp (its TMPDIR: `node_tmp`), removed as its processes are killed or at the end."""
    labels: dict[str, str] = field(default_factory=dict)
    stopping: bool = False
    evicted: bool = False
    """Its node is being taken away: its end is reported as the kubelet's node shutdown, never as the app's."""
    reported_exit: bool = False


class Kubelet:
    """Runs the pods bound to the sandbox's nodes, one kubelet for all of them.

    :param api: the emulated API (its event loop runs our API calls).
    :param kube: the API client the node agent shares.
    :param workdir: where pods get their folders and logs.
    :param services: the Service addresses pods name (`host:port`) -> the loopback address behind them.
    """

    def __init__(self, api: KubeApi, kube: Kube, workdir: Path, services: Callable[[], Mapping[str, str]]) -> None:
        self.api = api
        self.kube = kube
        self.workdir = workdir
        self.services = services
        self.pods: dict[str, RunningPod] = {}
        """Running pods by uid."""

    # -- what the agent's loop asks each round ---------------------------------------

    def run_bound(self, pods: list[dict[str, Any]], nodes: Mapping[str, SimNode]) -> None:
        """Start every Pending pod bound to a ready node, and report it Running."""
        for pod in pods:
            meta, spec = pod["metadata"], pod.get("spec", {})
            uid = meta.get("uid", "")
            node = nodes.get(spec.get("nodeName") or "")
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
                self.patch_status(started, status)

    def report_exits(self) -> None:
        """Each pod whose process ended: Succeeded or Failed with its exit code (a signal n: 128 + n)."""
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
            self.patch_status(pod, status)

    def stop_deleted(self, pods: list[dict[str, Any]], nodes: Mapping[str, SimNode]) -> None:
        """Stop the pods no longer in the API: gracefully, in the background; at once on a hung node."""
        present = {p["metadata"].get("uid") for p in pods}
        for uid, pod in list(self.pods.items()):
            if uid in present:
                continue
            del self.pods[uid]
            node = nodes.get(pod.node)
            if node is not None and node.state == "frozen":
                self.kill(pod)  # the node is hung: nothing there runs a graceful stop
            elif not pod.stopping:
                pod.stopping = True
                threading.Thread(target=self.stop_gracefully, args=([pod],), daemon=True).start()

    # -- what the spot market does to a node's pods ----------------------------------

    def on_node(self, name: str) -> list[RunningPod]:
        """The pods running on node `name`."""
        return [p for p in self.pods.values() if p.node == name]

    def shut_down(self, victims: list[RunningPod], *, notice: bool) -> None:
        """A node taken away. With notice, the graceful node shutdown: each pod marked disrupted and not
        Ready, then SIGTERM and its grace period. Without: the VM vanishes with its kubelet, and nobody
        reports how the pods ended."""
        if notice:
            for pod in victims:
                pod.evicted = True
                self.patch_status(pod, {"conditions": [DISRUPTED, {"type": "Ready", "status": "False"}]})
            self.stop_gracefully(victims)
        else:
            for pod in victims:
                pod.reported_exit = True
                self.kill(pod)

    def signal(self, pod: RunningPod, sig: signal.Signals) -> None:
        """Send `sig` to the pod's whole process tree, if it still runs."""
        if self._alive(pod) and pod.process is not None:
            signal_tree(pod.process.pid, sig)

    def kill(self, pod: RunningPod) -> None:
        """SIGKILL the pod's processes (a frozen node's as they are: `kill_tree`) and stop its etcd."""
        if self._alive(pod) and pod.process is not None:
            kill_tree(pod.process.pid)
            pod.process.wait(10)
        if pod.tmp is not None:
            shutil.rmtree(pod.tmp, ignore_errors=True)
            pod.tmp = None
        if pod.etcd is not None:
            pod.etcd.stop()
            pod.etcd = None

    def stop_gracefully(self, pods: list[RunningPod]) -> None:
        """What the kubelet does to pods it stops: SIGTERM, their grace period, SIGKILL."""
        for pod in pods:
            self.signal(pod, signal.SIGTERM)
        deadline = time.monotonic() + max((p.grace for p in pods), default=0.0)
        while time.monotonic() < deadline and any(self._alive(p) for p in pods):
            time.sleep(0.1)
        for pod in pods:
            self.kill(pod)

    def kill_all(self) -> None:
        """SIGKILL every pod: the run is over."""
        for pod in list(self.pods.values()):
            self.kill(pod)
        self.pods.clear()

    def patch_status(self, pod: RunningPod, status: dict[str, Any]) -> None:
        """Write the pod's status; a pod deleted meanwhile is not an error."""
        try:
            self.api.run(self.kube.patch("v1", "pods", pod.namespace, pod.name, {"status": status}))
        except Exception as exc:  # the pod may have been deleted meanwhile
            log.debug("status of %s/%s not written: %s", pod.namespace, pod.name, exc)

    # -- a pod as processes ----------------------------------------------------------

    @staticmethod
    def _alive(pod: RunningPod) -> bool:
        return pod.process is not None and pod.process.poll() is None

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
        mounts = empty_dir_mounts(spec, container, folder)
        secrets = self._secret_mounts(pod["metadata"]["namespace"], spec, container, folder)
        env = self._environment(pod, container, node)
        if env is None or secrets is None:
            return None  # a Secret or Service it needs is not there yet: try again next round
        mounts.update(secrets)
        env = {key: ",".join(rewrite_path(part, mounts) for part in value.split(",")) for key, value in env.items()}
        # A container's /tmp is its own and goes with the pod; here the trainer's node snapshot (100 MB for
        # a ResNet-18, left behind by every killed node) would pile up in this machine's /tmp instead.
        env.setdefault(SNAPSHOT_DIR_ENV, str(folder / "snapshots"))
        running.tmp = node_tmp()  # the rest of what it leaves in /tmp (pymp-*, torchelastic_*, the agent's folder)
        env.setdefault("TMPDIR", str(running.tmp))
        args = [rewrite_path(expand(str(a), env), mounts) for a in command]
        with running.log_path.open("ab") as out:
            running.process = subprocess.Popen(
                args, env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return running

    @staticmethod
    def _command(container: Mapping[str, Any], image: str) -> list[str]:
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
        env.update(SHARED_CORES_ENV)  # the pods share this machine's cores; the pod's env may override
        for source in container.get("envFrom", []):
            ref = source.get("secretRef")
            if ref is None:
                continue
            secret = self.api.run(self.kube.get("v1", "secrets", namespace, ref["name"]))
            if secret is None:
                return None
            env.update(secret_values(secret))
        fields = {"status.podIP": POD_IP, "spec.nodeName": node.name, "metadata.name": pod["metadata"]["name"],
                  "metadata.namespace": namespace}  # fmt: skip
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(str(item["value"]), env)
            elif "fieldRef" in (item.get("valueFrom") or {}):
                env[item["name"]] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
        if env.get(DEVICE_ENV) == "cuda":
            # The sandbox's nvidia.com/gpu is a count the scheduler places by, not a device: its workers
            # train on this machine's CPU, where the operator's `--device cuda` for GPU jobs would stop them.
            env[DEVICE_ENV] = "cpu"
        services = self.services()
        for key, value in env.items():
            for address in service_addresses(value):
                if address.endswith(f":{constants.ETCD_PORT}") and address not in services:
                    return None  # its rendezvous Service has no backend yet (DNS would not answer either)
                env[key] = value.replace(address, services.get(address, address))
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
