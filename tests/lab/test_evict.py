"""`torchspot evict node` against the Kubernetes API emulator (a real HTTP API, real kubeconfig login)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchspot.cli import main
from torchspot_lab.cluster.cloud import node_object
from torchspot_lab.kubeapi import KubeApi
from torchspot_operator.kube import Kube
from torchspot_operator.kube import login as kube_login


def exec_plugin(folder: Path, token: str) -> dict[str, Any]:
    """A kubeconfig user whose `exec` plugin prints an ExecCredential (as kubelogin does for AKS with Entra ID)."""
    script = folder / "plugin.py"
    folder.mkdir(parents=True, exist_ok=True)
    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {"token": token, "expirationTimestamp": "2099-01-01T00:00:00Z"}}  # fmt: skip
    script.write_text(
        "import json, os, sys\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "assert info['kind'] == 'ExecCredential', info\n"
        f"print(json.dumps({credential!r}))\n"
    )
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable, "args": [str(script)]}}


LOGINS: dict[str, Any] = {
    "http": {},
    "https-inline-ca-client-certificate": {"tls": True, "client_certs": True},
    "https-exec-plugin": {"tls": True, "tokens": {"from-the-plugin"}},
}
"""How `torchspot evict` logs in: a plain lab API; HTTPS whose CA and client certificate are inline in
the kubeconfig (what `az aks get-credentials` writes for local accounts); HTTPS with an exec plugin."""


@pytest.fixture(params=list(LOGINS))
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[KubeApi, Kube]]:
    options = dict(LOGINS[request.param])
    if options.get("tokens"):
        options["user"] = exec_plugin(tmp_path / "plugin", "from-the-plugin")
    with KubeApi(tmp_path / "api", **options) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        info = kube_login()
        assert info is not None
        kube = Kube.from_connection(info)
        for name in ("spot-1", "spot-2"):
            api.run(kube.create(node_object(name, spot=True, gpus=1, cpu=4)))
        pods = [("w-0", "spot-1", None), ("w-1", "spot-1", None), ("w-2", "spot-2", None),
                ("agent-x", "spot-1", "DaemonSet")]  # fmt: skip
        for name, node, owner in pods:
            meta: dict[str, Any] = {"name": name, "namespace": "default"}
            if owner:
                meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner, "name": "agent", "uid": "u"}]
            body = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                    "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]}}  # fmt: skip
            api.run(kube.create(body))
        yield api, kube
        api.run(kube.close())


def _pods(api: KubeApi, kube: Kube) -> list[str]:
    return sorted(p["metadata"]["name"] for p in api.run(kube.list("v1", "Pod", "default")))


def _delete_graces(api: KubeApi) -> list[Any]:
    assert api.emulator is not None
    return [r.data.get("gracePeriodSeconds") for r in api.emulator._requests if r.method == "DELETE" and r.data]


@pytest.mark.parametrize(("hard", "grace"), [(False, None), (True, 0)], ids=["notice", "hard"])
def test_evict_node_cordons_and_deletes_its_pods_but_daemonsets(
    cluster: tuple[KubeApi, Kube], hard: bool, grace: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    api, kube = cluster
    assert api.emulator is not None
    api.emulator.request_log = 1000  # this test reads the DELETE requests back
    assert main(["evict", "node", "spot-1", *(["--hard"] if hard else [])]) == 0
    node = api.run(kube.get("v1", "nodes", None, "spot-1"))
    assert node is not None
    assert node["spec"]["unschedulable"] is True
    other = api.run(kube.get("v1", "nodes", None, "spot-2"))
    assert other is not None
    assert not other["spec"].get("unschedulable")
    assert _pods(api, kube) == ["agent-x", "w-2"]
    assert _delete_graces(api) == [grace, grace]  # their own grace period, or 0 with --hard
    out = capsys.readouterr().out
    assert "node spot-1 cordoned; 2 pod(s) deleted" in out
    assert "kept default/agent-x (DaemonSet)" in out


def test_evicting_an_unknown_node_names_it(cluster: tuple[KubeApi, Kube], capsys: pytest.CaptureFixture[str]) -> None:
    api, kube = cluster
    assert main(["evict", "node", "spot-9"]) == 2
    assert "node 'spot-9' not found" in capsys.readouterr().err
    assert _pods(api, kube) == ["agent-x", "w-0", "w-1", "w-2"]


def test_a_failing_exec_plugin_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
                     "args": ["-c", "raise SystemExit(3)"]}}  # fmt: skip
    with KubeApi(tmp_path / "api", tls=True, tokens={"t"}, user=user) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        assert main(["evict", "node", "spot-1"]) == 2
    said = capsys.readouterr().err
    assert f"exec plugin {sys.executable!r} gave no credential: exec: process returned 3" in said
