"""The emulated Kubernetes API as the operator's tests use it: synchronous helpers that play kubelet and user."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import prometheus_client
import pytest

from torchspot_lab.kubeapi import KubeApi
from torchspot_operator import constants
from torchspot_operator.controller import Controller
from torchspot_operator.kube import Kube
from torchspot_operator.reconcile import ETCD_KINDS

T = TypeVar("T")
NS = "default"
JOBS = f"{constants.GROUP}/{constants.VERSION}/{constants.PLURAL}"


class Cluster:
    """The emulated API plus synchronous helpers that play kubelet and user."""

    def __init__(self, api: KubeApi, kube: Kube | None = None) -> None:
        self.api = api
        self.kube = kube or Kube(server=api.url, headers={}, ssl_context=True)

    def job(self, name: str) -> dict[str, Any]:
        found = self.api.run(self.kube.get(constants.API_VERSION, constants.PLURAL, NS, name))
        assert found is not None
        return found

    def pods(self, job: str) -> list[dict[str, Any]]:
        labels = {constants.LABEL_JOB: job, constants.LABEL_ROLE: constants.ROLE_WORKER}
        return sorted(self.api.run(self.kube.list("v1", "Pod", NS, labels)), key=lambda p: p["metadata"]["name"])

    def names(self, job: str) -> list[str]:
        return [p["metadata"]["name"] for p in self.pods(job)]

    def create(self, body: dict[str, Any]) -> None:
        self.api.run(self.kube.create(body))

    def patch(self, plural: str, name: str, patch: dict[str, Any], namespace: str | None = NS) -> None:
        api_version = constants.API_VERSION if plural == constants.PLURAL else "v1"
        self.api.run(self.kube.patch(api_version, plural, namespace, name, patch))

    def run_pod(self, name: str, node: str) -> None:
        """What the scheduler and kubelet report for a started, ready pod."""
        status = {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
        self.patch("pods", name, {"spec": {"nodeName": node}, "status": status})

    def add_node(self, name: str) -> None:
        self.create({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {constants.SPOT_LABEL: constants.SPOT_VALUE}},
            "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        })  # fmt: skip

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.api.run(self.kube.list("v1", "Event", NS)) if e.get("reason") == reason]

    def etcd_kinds(self, job: str) -> set[str]:
        return set(self.etcd(job))

    def etcd(self, job: str) -> dict[str, dict[str, Any]]:
        """The objects named `<job>-etcd` by kind, whoever owns them."""
        found = {}
        for api_version, kind in ETCD_KINDS:
            obj = self.api.run(self.kube.get(api_version, kind, NS, f"{job}-etcd"))
            if obj is not None:
                found[kind] = obj
        return found

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = NS) -> None:
        self.api.run(self.kube.delete(api_version, kind, namespace, name))

    def requests(self, method: str = "", resource: str = "") -> int:
        """Requests the API served so far, of one method and resource (`group/version/plural`) if given."""
        assert self.api.emulator is not None
        return sum(
            n for (m, r), n in self.api.emulator.counts.items()
            if (not method or m == method) and (not resource or r == resource)
        )  # fmt: skip

    def evict(self, pod: str, reason: str = "EvictionByEvictionAPI") -> None:
        """What a spot eviction leaves on a pod: Failed, reason Evicted, and the DisruptionTarget condition
        the API server's eviction (or the taint manager, or the kubelet under node pressure) adds."""
        assert self.api.emulator is not None
        self.api.run(self.api.emulator.evict(NS, pod, reason))

    def live(self, job: str) -> list[str]:
        """The names of the job's worker pods that have not failed (failed ones are kept for their logs)."""
        return [p["metadata"]["name"] for p in self.pods(job) if p.get("status", {}).get("phase") != "Failed"]

    def exit(self, pod: str, code: int, reason: str = "Error") -> None:
        """What the kubelet reports when the pod's container ended."""
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else reason}
        status = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}],
        }
        self.patch("pods", pod, {"status": status})


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 30.0) -> T:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def reconciles() -> float:
    """Reconciles the operator running in this process has finished (its own histogram's count): the
    sign that it has acted on a change, where the absence of a change has no condition to poll."""
    return prometheus_client.REGISTRY.get_sample_value("torchspot_reconcile_seconds_count") or 0.0


def count_ticks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Each job's timer ticks (`Controller.tick`, by job name) from now on, of the operator running in
    this process: the real tick runs, and is counted as it ends. The sign that every job's timer has
    run, where what it left alone has no condition to poll."""
    ticks: Counter[str] = Counter()
    tick = Controller.tick

    async def counted(self: Controller, namespace: str, name: str) -> Any:
        try:
            return await tick(self, namespace, name)
        finally:
            ticks[name] += 1

    monkeypatch.setattr(Controller, "tick", counted)
    return ticks
