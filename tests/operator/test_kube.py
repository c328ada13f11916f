"""The API layer and logins: discovery against the emulator; retries, deadlines and re-logins against a
small aiohttp server that answers as a throttled, failing or hung API server would (the emulator cannot
be made to misbehave on cue); kubeconfigs as kubectl reads them."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from aiohttp import web

from tests.operator.cluster import Cluster
from torchspot_lab.kubeapi import KubeApi
from torchspot_operator import constants, kube
from torchspot_operator.kube import (
    UNREACHABLE,
    ApiError,
    Kube,
    LoginError,
    TokenBucket,
    backoff_seconds,
    collection,
    login,
)

Answer = Callable[[web.BaseRequest], web.StreamResponse]


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backoff and deadlines in tenths of seconds, so the tests take no longer than they must."""
    monkeypatch.setattr(kube, "BACKOFF_BASE_SECONDS", 0.01)
    monkeypatch.setattr(kube, "REQUEST_TIMEOUT_SECONDS", 0.5)


class Script:
    """An HTTP server that answers the n-th request with the n-th answer (the last one repeats)."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.seen: list[tuple[float, str]] = []

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.seen.append((time.monotonic(), request.headers.get("Authorization", "")))
        answer = self.answers[min(len(self.seen), len(self.answers)) - 1]
        return answer(request)


def _json(status: int, body: Any = None, **headers: str) -> Answer:
    return lambda _: web.json_response(body if body is not None else {"message": f"said {status}"}, status=status,
                                       headers=headers)  # fmt: skip


def _reset(request: web.BaseRequest) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.abort()  # the connection drops before any answer
    return web.Response()


def _hang(_: web.BaseRequest) -> web.StreamResponse:
    raise _Hang


class _Hang(Exception):
    pass


async def _serve(script: Script) -> AsyncIterator[str]:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await script.handle(request)
        except _Hang:
            await asyncio.sleep(30)
            raise

    server = web.Server(handler)
    runner = web.ServerRunner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _get(script: Script, **options: Any) -> dict[str, Any] | None:
    async for url in _serve(script):
        api = Kube(server=url, headers={"Authorization": "Bearer old"}, ssl_context=True, **options)
        try:
            return await api.get("v1", "pods", "default", "p")
        finally:
            await api.close()
    raise AssertionError("not served")


def test_throttling_errors_and_resets_are_retried_honouring_retry_after() -> None:
    script = Script(_json(429, **{"Retry-After": "0.3"}), _json(503), _reset, _json(200, {"metadata": {"name": "p"}}))
    found = asyncio.run(_get(script))
    assert found == {"metadata": {"name": "p"}}
    assert len(script.seen) == 4
    assert script.seen[1][0] - script.seen[0][0] >= 0.3  # the server said when to come back


def test_a_client_error_is_not_retried_and_a_lasting_failure_gives_up() -> None:
    bad = Script(_json(400))
    with pytest.raises(ApiError) as refused:
        asyncio.run(_get(bad))
    assert (refused.value.status, len(bad.seen)) == (400, 1)
    down = Script(_json(503))
    with pytest.raises(ApiError) as failed:
        asyncio.run(_get(down))
    assert failed.value.status == 503
    assert failed.value.transient
    assert len(down.seen) == 1 + kube.RETRIES


def test_every_request_has_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepts and never answers (a half-open connection) costs a bounded time."""
    monkeypatch.setattr(kube, "RETRIES", 1)
    hung = Script(_hang)
    started = time.monotonic()
    with pytest.raises(ApiError) as failed:
        asyncio.run(_get(hung))
    assert failed.value.status == UNREACHABLE
    assert "no answer" in str(failed.value)
    assert len(hung.seen) == 2
    assert time.monotonic() - started < 5


def test_a_request_retrying_when_the_client_closes_opens_no_new_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """`close` while a request sleeps before its next attempt (the operator stopping under a
    throttled API): the request fails as unreachable and leaves no session open behind it."""
    monkeypatch.setattr(kube, "BACKOFF_BASE_SECONDS", 0.3)
    throttled = Script(_json(503))

    async def close_during_backoff() -> tuple[ApiError, Kube]:
        async for url in _serve(throttled):
            api = Kube(server=url, headers={}, ssl_context=True)
            request = asyncio.create_task(api.get("v1", "pods", "default", "p"))
            while not throttled.seen:  # the first attempt was answered 503: its backoff begins
                await asyncio.sleep(0.01)
            await api.close()
            with pytest.raises(ApiError) as refused:
                await request
            return refused.value, api
        raise AssertionError("not served")

    error, api = asyncio.run(close_during_backoff())
    assert error.status == UNREACHABLE
    assert "the API session was closed" in str(error)
    assert api.session is None
    assert len(throttled.seen) == 1


def test_a_401_logs_in_again_once_and_retries_with_the_fresh_credentials() -> None:
    script = Script(lambda r: web.json_response({}, status=200 if r.headers["Authorization"] == "Bearer new" else 401))

    async def relogin() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url[0], token="new")

    url: list[str] = []

    async def run() -> dict[str, Any] | None:
        async for served in _serve(script):
            url.append(served)
            api = Kube(server=served, headers={"Authorization": "Bearer old"}, ssl_context=True, relogin=relogin)
            try:
                return await api.get("v1", "pods", "default", "p")
            finally:
                await api.close()
        return None

    assert asyncio.run(run()) == {}
    assert [auth for _, auth in script.seen] == ["Bearer old", "Bearer new"]


def test_backoff_is_capped_and_retry_after_wins() -> None:
    assert backoff_seconds(0, "2") == 2.0
    assert backoff_seconds(0, "9999") == kube.RETRY_AFTER_CAP_SECONDS
    assert all(backoff_seconds(n) <= kube.BACKOFF_CAP_SECONDS for n in range(20))
    assert backoff_seconds(30, "Wed, 21 Oct 2015 07:28:00 GMT") <= kube.BACKOFF_CAP_SECONDS


@pytest.mark.parametrize(
    ("api_version", "kind", "namespace", "want"),
    [
        ("v1", "Pod", "ml", "/api/v1/namespaces/ml/pods"),
        ("v1", "Node", None, "/api/v1/nodes"),
        ("v1", "Secret", "ml", "/api/v1/namespaces/ml/secrets"),
        ("apps/v1", "Deployment", "ml", "/apis/apps/v1/namespaces/ml/deployments"),
        ("policy/v1", "PodDisruptionBudget", "ml", "/apis/policy/v1/namespaces/ml/poddisruptionbudgets"),
        ("networking.k8s.io/v1", "NetworkPolicy", "ml", "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies"),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition", None,
         "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"),
        (constants.API_VERSION, constants.KIND, "ml",
         f"/apis/{constants.API_VERSION}/namespaces/ml/{constants.PLURAL}"),
        ("v1", "nodes", None, "/api/v1/nodes"),  # a plural passes unchanged
    ],
)  # fmt: skip
def test_paths_come_from_discovery(api: Cluster, api_version: str, kind: str, namespace: str | None, want: str) -> None:
    """NetworkPolicy -> networkpolicies: the old "lower case + s" rule would have said networkpolicys."""
    plural = api.api.run(api.kube.plural(api_version, kind))
    assert collection(api_version, plural, namespace) == want


def test_an_unknown_kind_is_named_and_discovery_is_read_once_per_group_version(api: Cluster) -> None:
    with pytest.raises(ApiError) as unknown:
        api.api.run(api.kube.plural("v1", "Podd"))
    assert "the API serves no kind 'Podd' in v1" in str(unknown.value)
    before = api.requests("GET", "")
    for kind in ("Pod", "Node", "Secret", "Service"):
        api.api.run(api.kube.plural("v1", kind))
    assert api.requests("GET", "") == before  # v1 was read already


def test_the_token_bucket_paces_requests_and_serves_urgent_ones_first() -> None:
    """A burst of two, then 20 a second; a create (urgent) that comes last goes first, and a waiter that
    gives up takes no token. The burst is served in the bucket's first pass, before it waits at all;
    each later one after a wait of its own (counted, not timed: the speed is the clock's business)."""
    waits: list[float] = []

    async def wait(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(seconds)

    async def run() -> list[tuple[str, int, float]]:
        bucket = TokenBucket(rate=20.0, burst=2, sleep=wait)
        served: list[tuple[str, int, float]] = []
        start = time.monotonic()

        async def take(name: str, urgent: bool = False) -> None:
            await bucket.take(urgent=urgent)
            served.append((name, len(waits), time.monotonic() - start))

        quitter = asyncio.ensure_future(take("quitter"))
        await asyncio.sleep(0)
        quitter.cancel()
        await asyncio.gather(take("a"), take("b"), take("c"), take("d"), take("create", urgent=True))
        return served

    served = asyncio.run(run())
    assert [name for name, _, _ in served] == ["create", "a", "b", "c", "d"]
    # A waiter resumes once the bucket has begun its next wait (or ended): the burst's two as the first
    # wait begins, b and c each a wait later, d after the last. Three waits: one for each beyond the burst.
    assert [waited for _, waited, _ in served] == [1, 1, 2, 3, 3]
    assert len(waits) == 3
    assert served[-1][2] >= 0.14  # three more at 20 a second: 150 ms at least


def test_a_list_is_read_a_page_at_a_time(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five objects, pages of two: three requests, each page whole and in order, the selector applied."""
    monkeypatch.setattr(kube, "LIST_PAGE", 2)
    for n in range(5):
        labels = {constants.LABEL_ROLE: constants.ROLE_ETCD}
        api.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"s{n}", "namespace": "default",
                                                                        "labels": labels}, "spec": {}})  # fmt: skip
    api.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "other", "namespace": "default"}})
    before = api.requests("GET", "v1/services")

    async def read() -> list[list[str]]:
        pages = api.kube.pages("v1", "Service", "default", {constants.LABEL_ROLE: constants.ROLE_ETCD})
        return [[item["metadata"]["name"] for item in page] async for page in pages]

    assert api.api.run(read()) == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert api.requests("GET", "v1/services") - before == 3

    async def read_deleting() -> list[str]:
        """The first page's objects deleted before the next page is asked for (as a job list while a
        benchmark deleted other jobs): the next page goes on after the last name given, skipping nothing."""
        seen = []
        async for page in api.kube.pages("v1", "Service", "default", {constants.LABEL_ROLE: constants.ROLE_ETCD}):
            seen += [item["metadata"]["name"] for item in page]
            for item in page:
                await api.kube.delete("v1", "Service", "default", item["metadata"]["name"])
        return seen

    assert api.api.run(read_deleting()) == ["s0", "s1", "s2", "s3", "s4"]  # an offset token gave s0, s1, s4


def _kubeconfig(folder: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path = folder / "config"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "ml"}}],
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}],
    }))  # fmt: skip
    return path


def test_a_kubeconfig_is_read_as_kubectl_reads_it(tmp_path: Path) -> None:
    """Paths relative to the file, a token file, a proxy, two files merged; an unknown context is an error
    that names it; what kopf's connection cannot carry (impersonation) is refused, not dropped."""
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "token").write_text("from-file\n")
    (tmp_path / "k" / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    path = _kubeconfig(tmp_path / "k", {"server": "https://aks:443/", "certificate-authority": "ca.crt",
                                        "proxy-url": "http://proxy:3128"}, {"tokenFile": "token"})  # fmt: skip
    empty = tmp_path / "empty"
    empty.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config"}))
    info = login(env={"KUBECONFIG": f"{empty}:{path}"}, service_account=tmp_path / "no-pod")
    assert info is not None
    assert (info.server, info.token, info.proxy_url) == ("https://aks:443", "from-file", "http://proxy:3128")
    assert info.ca_path == str(tmp_path / "k" / "ca.crt")
    assert info.default_namespace == "ml"
    assert info.expiration is not None  # the file is read again at the next login
    assert login(env={"KUBECONFIG": str(tmp_path / "none")}, service_account=tmp_path / "no-pod") is None
    broken = tmp_path / "broken"
    broken.write_text(yaml.safe_dump({"current-context": "nowhere", "contexts": []}))
    with pytest.raises(LoginError, match="nowhere"):
        login(env={"KUBECONFIG": str(broken)}, service_account=tmp_path / "no-pod")
    disguised = _kubeconfig(tmp_path / "as", {"server": "https://aks"}, {"token": "t", "as": "someone-else"})
    with pytest.raises(LoginError, match="impersonation"):
        login(env={"KUBECONFIG": str(disguised)}, service_account=tmp_path / "no-pod")


def test_an_exec_plugin_is_run_and_one_that_prints_no_credential_is_refused(tmp_path: Path) -> None:
    def plugin(printed: str) -> dict[str, Any]:
        return {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
                         "args": ["-c", f"print({printed!r})"], "interactiveMode": "Never"}}  # fmt: skip

    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {"token": "from-plugin"}}  # fmt: skip
    good = _kubeconfig(tmp_path / "good", {"server": "https://aks"}, plugin(json.dumps(credential)))
    info = login(env={"KUBECONFIG": str(good)}, service_account=tmp_path / "no-pod")
    assert info is not None
    assert info.token == "from-plugin"
    empty = {**credential, "status": {}}
    bad = _kubeconfig(tmp_path / "bad", {"server": "https://aks"}, plugin(json.dumps(empty)))
    with pytest.raises(LoginError, match="gave no credential: exec: missing token or clientCertificateData"):
        login(env={"KUBECONFIG": str(bad)}, service_account=tmp_path / "no-pod")


def test_the_service_account_is_read_afresh_at_every_login(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    (tmp_path / "token").write_text("first")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "namespace").write_text("torchspot")
    first = login(env=env, service_account=tmp_path)
    (tmp_path / "token").write_text("rotated")
    second = login(env=env, service_account=tmp_path)
    assert first is not None
    assert second is not None
    assert (first.token, second.token) == ("first", "rotated")
    assert second.server == "https://10.0.0.1:443"
    assert second.ca_path == str(tmp_path / "ca.crt")
    assert second.default_namespace == "torchspot"
    assert second.expiration is not None  # so kopf logs in again and reads the rotated token
    nothing = {"KUBECONFIG": str(tmp_path / "none")}
    assert login(env=nothing, service_account=tmp_path / "absent") is None  # no pod, no kubeconfig


def test_inline_ca_data_reaches_tls_decoded(tmp_path: Path) -> None:
    """The bug this replaced: `certificate-authority-data` reached ssl still base64-encoded."""
    with KubeApi(tmp_path / "api", tls=True) as server:
        data = yaml.safe_load(server.kubeconfig.read_text())
        assert base64.b64decode(data["clusters"][0]["cluster"]["certificate-authority-data"]).startswith(b"-----BEGIN")
        info = login(env={"KUBECONFIG": str(server.kubeconfig)}, service_account=tmp_path / "no-pod")
        assert info is not None
        api = Kube.from_connection(info)
        assert server.run(api.list("v1", "Node", None)) == []
        untrusting = Kube(server=server.url, headers={}, ssl_context=True)  # the system CAs only
        with pytest.raises(ApiError) as refused:
            server.run(untrusting.list("v1", "Node", None))
        assert "certificate verify failed" in str(refused.value)
        # Not retried: only the TLS branch says so (retries end with "no answer", and the file's quick
        # backoff made them too fast for a clock to tell).
        assert "TLS failed" in str(refused.value)
        assert "no answer" not in str(refused.value)
        server.run(api.close())
        server.run(untrusting.close())


def test_the_emulator_refuses_a_wrong_token(tmp_path: Path) -> None:
    with KubeApi(tmp_path / "api", tokens={"good"}) as server:
        good = Kube(server=server.url, headers={"Authorization": "Bearer good"}, ssl_context=True)
        bad = Kube(server=server.url, headers={"Authorization": "Bearer bad"}, ssl_context=True)
        assert server.run(good.list("v1", "Node", None)) == []
        with pytest.raises(ApiError) as refused:
            server.run(bad.list("v1", "Node", None))
        assert refused.value.status == 401
        server.run(good.close())
        server.run(bad.close())
