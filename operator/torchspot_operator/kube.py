"""The one thin layer that talks to the Kubernetes API (aiohttp, the client kopf itself uses).

It knows URLs, verbs and status codes, nothing about ElasticJobs. Two tolerances are
deliberate: a create that finds the object already there (409) and a delete that finds
it gone (404) both count as done, because reconcile is level-based and may repeat a
step that an earlier pass (or a restarted operator) already took.

What a shared cluster's API server does to a client, it survives:
- every request has a deadline (`REQUEST_TIMEOUT_SECONDS`), so a half-open connection
  cannot hang a reconcile;
- 429 (API Priority and Fairness throttling; its Retry-After is honoured), 5xx and
  connection failures are retried with capped exponential backoff, `RETRIES` times;
  a create retried after a lost answer finds its object there (409), which counts as done;
- a 401 (a token rotated or expired) makes it log in again once (`relogin`) and retry;
- resource paths come from the API's discovery (a kind's plural is whatever the server
  says, read once per group version), not a spelling rule.
And what a client owes a shared API server: a client-side token bucket (`API_QPS`, `API_BURST`,
as client-go's rest.Config has), so a takeover that re-reads every job cannot send thousands of
requests in one burst; and a new login that only brings a new token keeps the connection pool
(the token goes with each request), so the 5-minute re-login of a service-account token aborts
nothing in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import os
import random
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, Self
from urllib.parse import quote

import aiohttp
import kopf
import yaml

log = logging.getLogger(__name__)

API_QPS: Final = 100.0
API_BURST: Final = 200
"""Requests per second this process sends the API on average, and how many at once after a quiet
spell (client-go's defaults are 5 and 10, which controllers raise; kube-controller-manager runs at
20 and 30). A job's first reconcile costs about a dozen requests (its etcd's objects, Secret,
workers, status, Events), so 200 new jobs take about 24 s at this rate; a quiet cluster costs
well under one request a second."""
REQUEST_TIMEOUT_SECONDS: Final = 30.0
"""The deadline of one request (connect, send, whole answer). Every call here is a small
object read or write; the API server's own limit for such calls is 60 s."""
CONNECT_TIMEOUT_SECONDS: Final = 10.0
RETRIES: Final = 5
"""Tries after the first, for 429, 5xx and connection failures: with the backoff below about
half a minute in all, which covers an API server's restart or an AKS control-plane upgrade's
failover, after which the caller (a reconcile) fails and kopf retries it later."""
BACKOFF_BASE_SECONDS: Final = 0.5
BACKOFF_CAP_SECONDS: Final = 10.0
RETRY_AFTER_CAP_SECONDS: Final = 30.0
RETRIED_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
SSL_SHUTDOWN_SECONDS: Final = 0.25
"""aiohttp's advice for a clean TLS close ("Graceful Shutdown" in its client docs)."""
SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_SECONDS: Final = 300
"""How long a login is used before logging in again (re-reading a token file, re-running an exec
plugin). The kubelet rewrites a projected service-account token at 80% of its life (48 minutes of
an hour); five minutes keeps the operator well inside that. A re-login that brings only a new
token keeps the connection pool (`Kube.renew`)."""
NODE_PAGE: Final = 25
"""Nodes per page of the node watch's listing: a parsed AKS node is 76 KiB (`LIST_PAGE`'s figures), so a
page of 100 was 7.6 MB held at once beside the pod listing's pages at a start; 25 is 1.9 MB."""
LIST_PAGE: Final = 50
"""Objects per page of a list, sized by bytes rather than client-go's 500: a running AKS GPU pod is
about 15 KiB of JSON (46 KiB parsed) and a node 27 KiB (76 KiB parsed), and a parsed page is held
whole until the next one comes (kopf's listings page the same: `settings.watching.chunk_size`).
At 500, the pages in flight at a start (kopf's listings of several kinds at once and the
operator's own snapshot) held a third of the peak memory at a thousand jobs; at 50, 8,000 pods
are listed in 160 requests instead of 16, and a page is a few MB parsed."""
WATCH_SECONDS: Final = 300
"""How long the API server keeps one watch open (`timeoutSeconds`; kopf's own watches use the same):
then the watch is opened again from the last version seen, which replays nothing."""
UNREACHABLE: Final = 0
"""`ApiError.status` of a request that never got an answer (connection refused, reset, timed out)."""


def _field(obj: Mapping[str, Any], path: str) -> str:
    """A dotted field of an object as a field selector sees it ('' when absent)."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


class ApiError(RuntimeError):
    """A Kubernetes API call failed; `status` is the HTTP status (`UNREACHABLE`: no answer at all)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status != UNREACHABLE else message)
        self.status = status

    @property
    def transient(self) -> bool:
        """The API's trouble, not the request's (no answer, throttled, a server error): worth trying
        again later, not a verdict on the object."""
        return self.status in {UNREACHABLE, 429} or self.status >= 500


def group_version_path(api_version: str) -> str:
    """/api/v1 for the core group, /apis/GROUP/VERSION otherwise."""
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


def collection(api_version: str, plural: str, namespace: str | None) -> str:
    """The URL path of a collection: /api/v1/..., /apis/group/version/..., namespaced or not."""
    root = group_version_path(api_version)
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


def label_selector(labels: Mapping[str, str] | str) -> str:
    """A label selector as the API reads it: `key=value` terms of a mapping, or a selector string as it is."""
    return labels if isinstance(labels, str) else ",".join(f"{k}={v}" for k, v in labels.items())


def backoff_seconds(attempt: int, retry_after: str | None = None) -> float:
    """How long to wait before try `attempt` + 1: the server's Retry-After if it gave one (capped),
    else capped exponential backoff with jitter (many operator replicas must not retry in step)."""
    if retry_after:
        try:
            return min(max(float(retry_after), 0.0), RETRY_AFTER_CAP_SECONDS)
        except ValueError:
            pass  # an HTTP date: rare from an API server; fall back to our own backoff
    return float(min(BACKOFF_BASE_SECONDS * 2**attempt, BACKOFF_CAP_SECONDS) * random.uniform(0.5, 1.0))


class LoginError(RuntimeError):
    """The kubeconfig or service account cannot be used; the message says what and where."""


def login(
    *, trust_env: bool = False, env: Mapping[str, str] | None = None, service_account: Path = SERVICE_ACCOUNT_DIR
) -> kopf.ConnectionInfo | None:
    """Credentials as kubectl finds them, read by the maintained `kubernetes` client's loaders: the pod's
    service account in a pod, else the kubeconfig (`KUBECONFIG`, several files merged, or
    ~/.kube/config; exec plugins such as kubelogin, token files, client certificates, proxies, paths
    relative to the file). None when there is neither.

    Every login is valid for `TOKEN_REREAD_SECONDS`, so kopf logs in again that often and a rotated
    token file or an exec plugin's new token is picked up before the old one lapses (a 401 also
    logs in again at once). What kopf's connection cannot carry is refused here rather than dropped
    silently: `tls-server-name` and impersonation (`as`), which kopf's own watches would not send.
    """
    import kubernetes.client  # noqa: PLC0415 - the client's import costs 0.3 s; the CLI needs it only to evict
    import kubernetes.config  # noqa: PLC0415
    from kubernetes.config.incluster_config import InClusterConfigLoader  # noqa: PLC0415

    env = os.environ if env is None else env
    config = kubernetes.client.Configuration()
    namespace: str | None = None
    user: Mapping[str, Any] = {}
    said: list[str] = []
    try:
        if (service_account / "token").exists() and env.get("KUBERNETES_SERVICE_HOST"):
            token, ca = str(service_account / "token"), str(service_account / "ca.crt")
            loader = InClusterConfigLoader(token, ca, try_refresh_token=False, environ=env)  # type: ignore[no-untyped-call]
            loader.load_and_set(config)  # type: ignore[no-untyped-call]
            where = service_account / "namespace"
            namespace = where.read_text().strip() if where.exists() else None
        else:
            paths = [p for p in (env.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep) if p]
            if not any(Path(p).expanduser().exists() for p in paths):
                return None
            files = os.pathsep.join(str(Path(p).expanduser()) for p in paths)
            # The client's loaders carry no type annotations (hence the ignores).
            load = kubernetes.config.load_kube_config
            with _said_by_client() as said:
                load(config_file=files, client_configuration=config, persist_config=False)  # type: ignore[no-untyped-call]
            _, current = kubernetes.config.list_kube_config_contexts(config_file=files)  # type: ignore[no-untyped-call]
            namespace = (current.get("context") or {}).get("namespace")
            user = _user(files, str((current.get("context") or {}).get("user", "")))
    except (kubernetes.config.ConfigException, OSError, ValueError) as exc:
        raise LoginError(f"kubeconfig: {exc}") from exc
    if getattr(config, "tls_server_name", None):
        raise LoginError("kubeconfig: tls-server-name is not supported by kopf's connection (its watches)")
    if any(key.startswith("as") for key in user):
        raise LoginError("kubeconfig: impersonation (`as`) is not supported by kopf's connection (its watches)")
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").strip().rpartition(" ")  # kubectl trims a token file's newline too
    if user.get("exec") and not token and not config.cert_file:  # the client logs why, and goes on
        why = "; ".join(said) or "it printed neither a token nor a client certificate"
        raise LoginError(f"kubeconfig: exec plugin {user['exec'].get('command', '')!r} gave no credential: {why}")
    return kopf.ConnectionInfo(
        server=str(config.host).rstrip("/"),
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl or None,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
        default_namespace=namespace,
        proxy_url=config.proxy,
        trust_env=trust_env,
        expiration=datetime.now(UTC) + timedelta(seconds=TOKEN_REREAD_SECONDS),
    )


@contextlib.contextmanager
def _said_by_client() -> Iterator[list[str]]:
    """What the `kubernetes` client's kubeconfig loader logs meanwhile: it reports a failed exec plugin
    (exit status, output without a credential) as an error log line and goes on without credentials."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.pathname.endswith(os.path.join("kubernetes", "config", "kube_config.py")):
                said.append(record.getMessage())

    handler = Keep(logging.ERROR)
    logging.getLogger().addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger().removeHandler(handler)


def _user(files: str, name: str) -> Mapping[str, Any]:
    """The kubeconfig's entry for a user, from the first file that has it (kubectl's merge rule)."""
    for path in files.split(os.pathsep):
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except OSError:
            continue
        for entry in loaded.get("users") or []:
            if entry.get("name") == name:
                return dict(entry.get("user") or {})
    return {}


@dataclass
class Kube:
    """An API session: server URL, headers (credentials) and TLS settings from a login."""

    server: str
    headers: dict[str, str]
    ssl_context: ssl.SSLContext | bool
    proxy: str | None = None
    trust_env: bool = False
    relogin: Callable[[], Awaitable[kopf.ConnectionInfo | None]] | None = None
    """Fresh credentials when the API says 401 (a rotated or expired token); None: no second try."""
    session: aiohttp.ClientSession | None = None
    plurals: dict[tuple[str, str], str] = field(default_factory=dict)
    """(apiVersion, kind) -> plural, from discovery."""
    closed: bool = False
    tls: tuple[object, ...] = ()
    """What the connection pool depends on (server, CA, client certificate, proxy): a renewal that
    changes none of it keeps the pool."""
    limiter: TokenBucket = field(default_factory=lambda: TokenBucket(API_QPS, API_BURST))

    @classmethod
    def from_connection(
        cls, info: kopf.ConnectionInfo, relogin: Callable[[], Awaitable[kopf.ConnectionInfo | None]] | None = None
    ) -> Self:
        """Use the credentials of a login (`login`), with kopf's own helpers: its SSL
        context (inline CA and client certificate data decoded) and its Authorization header."""
        context: ssl.SSLContext | bool = info.as_ssl_context() if info.server.startswith("https") else True
        tls = (
            info.server, info.ca_path, info.ca_data, info.insecure, info.certificate_path, info.certificate_data,
            info.private_key_path, info.private_key_data, info.proxy_url, info.trust_env,
        )  # fmt: skip
        return cls(
            server=info.server.rstrip("/"),
            headers=info.as_http_headers(),
            ssl_context=context,
            proxy=info.proxy_url,
            trust_env=info.trust_env,
            relogin=relogin,
            tls=tls,
        )

    async def _request(
        self, method: str, path: str, body: Any = None, content_type: str = "", *, urgent: bool = False
    ) -> Any:
        """One call, retried as the module docstring says; the decoded answer."""
        data = None if body is None else json.dumps(body)
        relogged = False
        attempt = 0
        while True:
            try:
                status, body, retry_after = await self._send(method, path, data, content_type, urgent)
            except aiohttp.ClientSSLError as exc:  # a wrong CA or certificate: trying again changes nothing
                raise ApiError(UNREACHABLE, f"{method} {self.server}{path}: TLS failed: {exc}") from exc
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                if attempt >= RETRIES:
                    raise ApiError(UNREACHABLE, f"{method} {self.server}{path}: no answer: {exc!r}") from exc
                status, body, retry_after = UNREACHABLE, b"", None
            if status == 401 and self.relogin is not None and not relogged:
                relogged = True
                fresh = await self.relogin()
                if fresh is not None:
                    await self.renew(Kube.from_connection(fresh, self.relogin))
                    continue
            if status == UNREACHABLE or (status in RETRIED_STATUSES and attempt < RETRIES):
                delay = backoff_seconds(attempt, retry_after)
                log.info("%s %s: %s; trying again in %.1f s", method, path, status or "no answer", delay)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            if status >= 400:
                raise ApiError(status, _message(body.decode("utf-8", "replace")))
            return json.loads(body) if body else {}  # from the bytes: a decoded copy of a page is 2 MB more

    async def _send(
        self, method: str, path: str, data: str | None, content_type: str, urgent: bool
    ) -> tuple[int, bytes, str | None]:
        session = self._session(f"{method} {path}")
        await self.limiter.take(urgent=urgent)
        headers = {**self.headers, "Content-Type": content_type or "application/json"}  # the current credentials
        async with session.request(
            method, self.server + path, data=data, headers=headers, ssl=self.ssl_context, proxy=self.proxy
        ) as response:
            return response.status, await response.read(), response.headers.get("Retry-After")

    async def close(self) -> None:
        """Close the HTTP session for good: later requests fail instead of opening another."""
        self.closed = True
        await self._drop_session()

    async def _drop_session(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
            if isinstance(self.ssl_context, ssl.SSLContext):
                # aiohttp closes TLS connections without waiting for their shutdown; give the
                # event loop the moment its documentation asks for, or the loop may end first
                # and leave the transports open.
                await asyncio.sleep(SSL_SHUTDOWN_SECONDS)

    async def renew(self, fresh: Kube) -> None:
        """Take new credentials (a new login). A new token alone keeps the connection pool (requests in
        flight finish); a new server, CA, client certificate or proxy opens a new one."""
        same = bool(self.tls) and fresh.tls == self.tls
        self.server, self.headers, self.ssl_context = fresh.server, fresh.headers, fresh.ssl_context
        self.proxy, self.trust_env, self.tls = fresh.proxy, fresh.trust_env, fresh.tls
        if not same:
            await self._drop_session()

    async def plural(self, api_version: str, kind_or_plural: str) -> str:
        """A kind's resource name as the API serves it (discovery, read once per group version);
        a lower-case name is taken as the plural already."""
        if not kind_or_plural[:1].isupper():
            return kind_or_plural
        key = (api_version, kind_or_plural)
        if key not in self.plurals:
            try:
                found = await self._request("GET", group_version_path(api_version))
            except ApiError as exc:
                if exc.status != 404:
                    raise
                found = {}  # the group version is not served at all
            for resource in found.get("resources") or []:
                if "/" not in str(resource.get("name", "")):  # not a subresource
                    self.plurals.setdefault((api_version, str(resource.get("kind"))), str(resource["name"]))
            if key not in self.plurals:
                served = f"the API serves no kind {kind_or_plural!r} in {api_version}"
                raise ApiError(404, f"{served} (is its CRD installed?)")
        return self.plurals[key]

    async def _collection(self, api_version: str, kind: str, namespace: str | None) -> str:
        return collection(api_version, await self.plural(api_version, kind), namespace)

    async def get(
        self, api_version: str, kind: str, namespace: str | None, name: str, *, urgent: bool = False
    ) -> dict[str, Any] | None:
        """One object, or None if it does not exist (`urgent`: see `TokenBucket`)."""
        try:
            path = f"{await self._collection(api_version, kind, namespace)}/{name}"
            found: dict[str, Any] = await self._request("GET", path, urgent=urgent)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return found

    async def pages(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        labels: Mapping[str, str] | str | None = None,
        *,
        fields: Mapping[str, str] | None = None,
        version: list[str] | None = None,
        size: int | None = None,
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """Objects of a kind a page (`LIST_PAGE` objects) at a time, as client-go's pager reads them: the
        caller keeps what it needs of a page before the next comes, never 8,000 whole pods at once.
        Selectors given as a mapping are applied here too (some API emulators ignore them); a selector
        given as a string (`key in (a,b)`, `!key`: the node watch's) is sent as it is.

        :param size: objects per page, `LIST_PAGE` unless given (nodes, four times a pod's size, are
            listed by `NODE_PAGE`).
        :param version: receives the list's resourceVersion (with the first page): where a watch of what
            the list showed starts (`watch`)."""
        path = await self._collection(api_version, kind, namespace)
        query = [f"limit={size or LIST_PAGE}"]
        if labels:
            query.append("labelSelector=" + quote(label_selector(labels)))
        if fields:
            query.append("fieldSelector=" + ",".join(f"{k}={v}" for k, v in fields.items()))
        token = ""
        while True:
            following = [f"continue={quote(token)}"] if token else []
            page = await self._request("GET", path + "?" + "&".join([*query, *following]))
            if version is not None and not token:
                version.append(str((page.get("metadata") or {}).get("resourceVersion") or ""))
            items: list[dict[str, Any]] = page.get("items") or []
            if labels and not isinstance(labels, str):
                items = [
                    item
                    for item in items
                    if all(item.get("metadata", {}).get("labels", {}).get(k) == v for k, v in labels.items())
                ]
            if fields:
                items = [item for item in items if all(_field(item, k) == v for k, v in fields.items())]
            yield items
            token = str((page.get("metadata") or {}).get("continue") or "")
            if not token:
                return

    async def watch(
        self, api_version: str, kind: str, namespace: str | None, labels: Mapping[str, str] | str, since: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The changes of a kind's labelled objects after version `since` (a list's), as (type, object),
        each line parsed as it arrives, until the server ends the watch (`WATCH_SECONDS`): then watch
        again from the last version seen. BOOKMARK events carry only a version. An ERROR event (410:
        `since` is older than the server keeps) raises `ApiError` with its code: list again.

        Not retried here and not rate-limited beyond its start: the caller (informer.py) lists again
        after any failure, with a backoff."""
        path = await self._collection(api_version, kind, namespace)
        query = [
            "watch=true", f"resourceVersion={quote(since)}", "allowWatchBookmarks=true",
            f"timeoutSeconds={WATCH_SECONDS}",
            "labelSelector=" + quote(label_selector(labels)),
        ]  # fmt: skip
        session = self._session(f"watch {path}")
        await self.limiter.take()
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_SECONDS, sock_read=WATCH_SECONDS + 60)
        async with session.get(
            f"{self.server}{path}?{'&'.join(query)}", headers=self.headers, ssl=self.ssl_context, proxy=self.proxy,
            timeout=timeout,
        ) as response:  # fmt: skip
            if response.status >= 400:
                raise ApiError(response.status, _message(await response.text()))
            buffer = b""
            async for chunk in response.content.iter_any():  # lines of any length (an object may pass 64 KiB)
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind_of, obj = str(event.get("type", "")), event.get("object") or {}
                    if kind_of == "ERROR":
                        raise ApiError(int(obj.get("code") or 500), str(obj.get("message") or obj))
                    yield kind_of, obj

    def _session(self, what: str) -> aiohttp.ClientSession:
        """The open session, or a new one; never after `close` (`what` names the call refused). A
        handler still finishing while the operator stops may be in a retry's backoff sleep as `close`
        runs, and its next attempt would open a session nobody closes: a CI run saw aiohttp's
        ResourceWarning for one, in a later test."""
        if self.closed:
            raise ApiError(UNREACHABLE, f"{what}: the API session was closed")
        if self.session is None or self.session.closed:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS, connect=CONNECT_TIMEOUT_SECONDS)
            self.session = aiohttp.ClientSession(timeout=timeout, trust_env=self.trust_env)
        return self.session

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        labels: Mapping[str, str] | None = None,
        *,
        fields: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Objects of a kind, filtered by labels and fields (`spec.nodeName`), every page of them."""
        return [item async for page in self.pages(api_version, kind, namespace, labels, fields=fields) for item in page]

    async def create(self, obj: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any] | None:
        """Create an object and return it as stored; None if one of that name existed already (409).

        :param strict: a field the API does not know is refused (400, naming it) instead of dropped with
            a warning: `fieldValidation=Strict`, what `kubectl apply` sends for a user's manifest.
        """
        meta = obj["metadata"]
        path = await self._collection(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        path += "?fieldValidation=Strict" if strict else ""
        try:
            created: dict[str, Any] = await self._request("POST", path, obj, urgent=True)
        except ApiError as exc:
            if exc.status == 409:
                log.info("%s %s exists already; continuing", obj["kind"], meta["name"])
                return None
            raise
        return created

    async def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        grace: int | None = None,
        *,
        uid: str | None = None,
    ) -> bool:
        """Delete an object (with `grace` seconds, or its own period); False if it was gone (404).

        With `uid`, only that object: the API refuses (409) to delete a same-named object
        that replaced it, and that counts as gone too.
        """
        body = delete_options(grace, uid)
        try:
            path = f"{await self._collection(api_version, kind, namespace)}/{name}"
            await self._request("DELETE", path, body, urgent=True)
        except ApiError as exc:
            if exc.status == 404 or (exc.status == 409 and uid is not None):
                return False
            raise
        return True

    async def patch(
        self, api_version: str, kind: str, namespace: str | None, name: str, patch: Any, *, subresource: str = ""
    ) -> Any:
        """Merge-patch an object (or one of its subresources, such as `status`); the object as stored."""
        path = f"{await self._collection(api_version, kind, namespace)}/{name}"
        path += f"/{subresource}" if subresource else ""
        return await self._request("PATCH", path, patch, "application/merge-patch+json")

    async def apply(self, obj: Mapping[str, Any], manager: str) -> dict[str, Any]:
        """Server-side apply: the fields `obj` sets become `manager`'s, set to its values, taken from any
        other manager that set them (`force`, as a controller applies what it owns); the object as stored."""
        meta = obj["metadata"]
        path = f"{await self._collection(obj['apiVersion'], obj['kind'], meta.get('namespace'))}/{meta['name']}"
        query = f"?fieldManager={quote(manager)}&force=true"
        stored: dict[str, Any] = await self._request("PATCH", path + query, obj, "application/apply-patch+yaml")
        return stored

    async def patch_status(
        self, api_version: str, plural: str, namespace: str, name: str, status: Any, *, resource_version: str = ""
    ) -> Any:
        """Merge-patch an object's status through its status subresource; the object as stored.

        With `resource_version`, only if the object is still at that version (the API server takes a
        resourceVersion in a patch as a precondition): otherwise a 409, so two writers cannot both
        add to a count from the same old status. Falls back to patching the object itself where the
        subresource is not served (an API emulator); a real API server with the subresource serves
        the first.
        """
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            return await self.patch(api_version, plural, namespace, name, body, subresource="status")
        except ApiError as exc:
            if exc.status not in (404, 405):
                raise
            return await self.patch(api_version, plural, namespace, name, body)


def delete_options(grace: int | None, uid: str | None) -> dict[str, Any]:
    """The DeleteOptions body: dependents go in the background, a grace period and a uid precondition if given."""
    body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
    if grace is not None:
        body["gracePeriodSeconds"] = grace
    if uid is not None:
        body["preconditions"] = {"uid": uid}
    return body


def _message(text: str) -> str:
    """The API's own error message (a Status object), or the raw body."""
    try:
        return str(json.loads(text).get("message", text))
    except (ValueError, AttributeError):
        return text[:500]


@dataclass
class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; `take` waits for one (client-go's flowcontrol
    rate limiter). Waiters are served in turn, so a burst of reconciles queues instead of flooding;
    an `urgent` one (a create, a delete, the read of the job a reconcile starts from) goes before
    every waiting ordinary one (status writes, annotations, lists), so 100 evictions at once are
    replaced within the burst while their status writes wait their turn."""

    rate: float
    burst: int
    tokens: float = -1.0
    at: float = 0.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    """How it tells and waits out time (a test passes a clock of its own)."""
    _waiters: list[tuple[int, int, asyncio.Future[None]]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)
    _server: asyncio.Task[None] | None = None

    async def take(self, *, urgent: bool = False) -> None:
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._waiters, (0 if urgent else 1, next(self._order), turn))
        if self._server is None or self._server.done():
            self._server = loop.create_task(self._serve())
        await turn

    async def _serve(self) -> None:
        """Hand out tokens to the waiters, most urgent first, then in the order they came."""
        while self._waiters:
            now = self.clock()
            if self.tokens < 0:  # first use: a full bucket
                self.tokens, self.at = float(self.burst), now
            self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens < 1:
                await self.sleep((1 - self.tokens) / self.rate)
                continue
            _, _, turn = heapq.heappop(self._waiters)
            if not turn.done():  # a cancelled waiter takes no token
                turn.set_result(None)
                self.tokens -= 1
