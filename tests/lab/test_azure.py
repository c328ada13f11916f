"""The Azure calls of `torchspot evict aks` and `torchspot aks spot-pool`, through the real SDK clients.

STAND-IN: the Azure Resource Manager cannot run here, so a local HTTPS server plays it
(the one kind of test double our standards allow: the Azure management plane). It
answers with the documented response shapes and records every request, and the tests
assert the exact requests: method, path, api-version and body. The credential is a
stand-in too (a fixed bearer token).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from azure.core.credentials import AccessToken
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from torchspot.cli import main
from torchspot_lab.azure import (
    AKS_API_VERSION,
    COMPUTE_API_VERSION,
    AzureInputError,
    SpotPool,
    clients,
    create_spot_pool,
    parse_provider_id,
    scale_spot_pool,
    simulate_eviction,
)

SUB = "00000000-1111-2222-3333-444444444444"
RG, CLUSTER, NODE_RG = "ml-rg", "torchspot", "MC_ml-rg_torchspot_eastus"
PROVIDER_ID = (
    f"azure:///subscriptions/{SUB}/resourceGroups/{NODE_RG}/providers/Microsoft.Compute/"
    "virtualMachineScaleSets/aks-gpuspot-12345678-vmss/virtualMachines/3"
)
AKS = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.ContainerService/managedClusters/{CLUSTER}"


@dataclass
class Arm:
    """What the stand-in received, and the agent pools it holds."""

    url: str
    ca: Path
    """The stand-in's self-signed certificate, which the clients trust (TLS is verified as with Azure)."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)


class _Handler(BaseHTTPRequestHandler):
    arm: Arm

    def log_message(self, format: str, *args: Any) -> None:  # the stdlib's signature; keep the test output clean
        pass

    def _answer(self, status: int, body: dict[str, Any] | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.arm.requests.append({"method": self.command, "path": url.path,
                                  "api-version": parse_qs(url.query).get("api-version", [""])[0],
                                  "body": body, "auth": self.headers.get("Authorization")})  # fmt: skip
        if self.command == "GET" and url.path == AKS:
            self._answer(200, {"id": AKS, "name": CLUSTER, "location": "eastus",
                               "properties": {"nodeResourceGroup": NODE_RG}})  # fmt: skip
        elif self.command == "POST" and url.path.endswith("/simulateEviction"):
            self._answer(204)
        elif url.path.startswith(AKS + "/agentPools/"):
            name = url.path.rsplit("/", 1)[1]
            if self.command == "PUT":
                assert body is not None
                stored = {"id": url.path, "name": name,
                          "properties": {**body["properties"], "provisioningState": "Succeeded"}}  # fmt: skip
                self.arm.pools[name] = stored
                self._answer(200, stored)
            elif name in self.arm.pools:
                self._answer(200, self.arm.pools[name])
            else:
                self._answer(404, {"error": {"code": "NotFound", "message": f"agent pool {name} not found"}})
        else:
            self._answer(404, {"error": {"code": "NotFound", "message": url.path}})

    do_GET = do_POST = do_PUT = _handle  # http.server's names


def _certificate(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "arm-stand-in")])
    now = datetime.datetime.now(datetime.UTC)
    loopback = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    builder = x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
    builder = builder.serial_number(x509.random_serial_number()).not_valid_before(now)
    builder = builder.not_valid_after(now + datetime.timedelta(days=1)).add_extension(loopback, critical=False)
    builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)  # its own CA
    cert = builder.sign(key, hashes.SHA256())
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return cert_path, key_path


@pytest.fixture
def arm(tmp_path: Path) -> Iterator[Arm]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert, key = _certificate(tmp_path)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    state = Arm(url=f"https://127.0.0.1:{server.server_address[1]}", ca=cert)
    _Handler.arm = state
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()
    thread.join(10)


class _Token:
    """Stand-in credential: a fixed bearer token (no Azure AD here)."""

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        return AccessToken("stand-in-token", 4_102_444_800)


@pytest.fixture
def sdk(arm: Arm) -> Iterator[tuple[Any, Any]]:
    """The real compute and AKS clients, pointed at the stand-in (closed after the test)."""
    compute, aks = clients(_Token(), SUB, arm.url, connection_verify=str(arm.ca))
    yield compute, aks
    compute.close()
    aks.close()


def test_simulate_eviction_checks_the_cluster_then_evicts_the_nodes_instance(arm: Arm, sdk: tuple[Any, Any]) -> None:
    compute, aks = sdk
    instance = simulate_eviction(compute, aks, resource_group=RG, cluster=CLUSTER, provider_id=PROVIDER_ID)
    assert (instance.scale_set, instance.instance_id) == ("aks-gpuspot-12345678-vmss", "3")
    assert [(r["method"], r["path"], r["api-version"], r["body"]) for r in arm.requests] == [
        ("GET", AKS, AKS_API_VERSION, None),
        ("POST", f"/subscriptions/{SUB}/resourceGroups/{NODE_RG}/providers/Microsoft.Compute/virtualMachineScaleSets/"
                 "aks-gpuspot-12345678-vmss/virtualMachines/3/simulateEviction", COMPUTE_API_VERSION, None),
    ]  # fmt: skip
    assert all(r["auth"] == "Bearer stand-in-token" for r in arm.requests)


def test_a_node_of_another_cluster_is_not_evicted(arm: Arm, sdk: tuple[Any, Any]) -> None:
    compute, aks = sdk
    elsewhere = PROVIDER_ID.replace(NODE_RG, "MC_other_cluster_westus")
    with pytest.raises(AzureInputError, match="but cluster torchspot's nodes are in MC_ml-rg_torchspot_eastus"):
        simulate_eviction(compute, aks, resource_group=RG, cluster=CLUSTER, provider_id=elsewhere)
    assert [r["method"] for r in arm.requests] == ["GET"]  # nothing was evicted


def test_create_then_scale_a_spot_pool_sends_the_documented_bodies(arm: Arm, sdk: tuple[Any, Any]) -> None:
    _, aks = sdk
    pool = SpotPool("gpuspot", "Standard_NC4as_T4_v3", min_count=0, max_count=3,
                    labels={"team": "vision"}, taints=("dedicated=training:NoSchedule",))  # fmt: skip
    created = create_spot_pool(aks, resource_group=RG, cluster=CLUSTER, pool=pool)
    assert created["properties"]["provisioningState"] == "Succeeded"
    put = arm.requests[-1]
    assert (put["method"], put["path"], put["api-version"]) == ("PUT", f"{AKS}/agentPools/gpuspot", AKS_API_VERSION)
    assert put["body"] == {"properties": {
        "type": "VirtualMachineScaleSets", "mode": "User", "osType": "Linux", "vmSize": "Standard_NC4as_T4_v3",
        "scaleSetPriority": "Spot", "scaleSetEvictionPolicy": "Delete", "spotMaxPrice": -1.0,
        "enableAutoScaling": True, "minCount": 0, "maxCount": 3, "count": 1,
        "nodeLabels": {"team": "vision"}, "nodeTaints": ["dedicated=training:NoSchedule"],
    }}  # fmt: skip

    scale_spot_pool(aks, resource_group=RG, cluster=CLUSTER, name="gpuspot", min_count=1, max_count=8, count=None)
    get, put = arm.requests[-2:]
    assert (get["method"], get["path"]) == ("GET", f"{AKS}/agentPools/gpuspot")
    assert put["method"] == "PUT"
    properties = put["body"]["properties"]
    assert (properties["minCount"], properties["maxCount"], properties["count"]) == (1, 8, 1)
    assert properties["scaleSetPriority"] == "Spot"
    assert "provisioningState" not in properties  # read-only fields are not sent back


@pytest.mark.parametrize(
    ("pool", "said"),
    [
        (SpotPool("GPU_Spot", "Standard_NC4as_T4_v3", 0, 3), "--name 'GPU_Spot'"),
        (SpotPool("gpuspot", "Standard_NC4as_T4_v3", 4, 3), "--min 4 / --max 3"),
        (SpotPool("gpuspot", "Standard_NC4as_T4_v3", 0, 3, max_price=0.123456), "--max-price 0.123456"),
        (SpotPool("gpuspot", "Standard_NC4as_T4_v3", 0, 3, eviction_policy="Stop"), "--eviction-policy 'Stop'"),
        (SpotPool("gpuspot", "Standard_NC4as_T4_v3", 0, 3, taints=("gpu:NoSchedule",)), "--taint 'gpu:NoSchedule'"),
        (SpotPool("gpuspot", "Standard_NC4as_T4_v3", 1, 3, count=5), "--count 5"),
    ],
    ids=["name", "min-max", "price", "policy", "taint", "count"],
)
def test_bad_pool_settings_are_refused_before_any_call(
    pool: SpotPool, said: str, arm: Arm, sdk: tuple[Any, Any]
) -> None:
    _, aks = sdk
    with pytest.raises(AzureInputError, match=said.replace("(", r"\(")):
        create_spot_pool(aks, resource_group=RG, cluster=CLUSTER, pool=pool)
    assert arm.requests == []


def test_provider_ids_that_are_not_scale_set_instances_are_named() -> None:
    assert parse_provider_id(PROVIDER_ID).subscription == SUB
    with pytest.raises(AzureInputError, match="is not a VM scale set instance"):
        parse_provider_id("kind://docker/kind/kind-worker")


def test_the_cli_refuses_bad_pool_flags_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    target = ["--resource-group", RG, "--cluster", CLUSTER, "--subscription", SUB]
    pool = ["--name", "gpuspot", "--vm-size", "Standard_NC4as_T4_v3", "--min", "0", "--max", "3", "--taint", "bad"]
    argv = ["aks", "spot-pool", "create", *target, *pool]
    assert main(argv) == 2
    assert "--taint 'bad': expected KEY=VALUE:EFFECT" in capsys.readouterr().err
