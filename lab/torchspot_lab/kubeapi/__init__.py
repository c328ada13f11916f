"""A Kubernetes API for the lab and the tests: kmock's emulator, made good enough for kopf.

No API server installs here (see the design brief), so the operator runs against
kmock, kopf's own test emulator, served over real HTTP on a loopback port from a
background thread. What kmock leaves out, this adds:

- `metadata.uid` and `creationTimestamp` on create, and a new `resourceVersion` on every
  create and patch, as the API server gives: kopf tells its own writes coming back from
  stale events by it (without it, kopf handled one creation several times); a JSON patch
  that cannot apply (kopf's `test` of the resourceVersion, from an older read) is
  refused with a 422, as the API server refuses it, and kopf tries again on its next
  cycle; and a name for objects created with `generateName` (kopf's Events);
- the resources the operator lists and watches, declared up front (kmock serves a
  list only for resources it knows, and learns a CRD's group only if told);
- a kubeconfig file pointing at it, so kopf logs in as it would to a cluster;
- a short request log (see `REQUEST_LOG`), so requests stay cheap however many came before;
- the Namespace collection: kmock reads `/api/v1/namespaces` as the start of a
  namespaced path and fails with a 500, which kept kopf's namespaced mode (it lists
  and watches namespaces) from starting; `_parse_path` reads those paths as the API
  server does;
- admission of custom resources: once a CustomResourceDefinition object is created,
  every create and patch of its resources is defaulted and checked against its schema
  and CEL rules, transition rules included (`admission.py`), and refused with a 422
  naming each problem, as `kubectl apply` against a cluster would be;
- delete preconditions: a DELETE whose `preconditions.uid` (or `resourceVersion`)
  does not match the object is refused with a 409, as the API server refuses it, so
  a controller's "delete only what I own" guard can be tested;
- a count of requests by verb and resource (`Emulator.counts`), for the operator
  benchmark's requests per job;
- HTTPS and credentials, when asked for (`KubeApi(tls=True, tokens=..., client_certs=True)`):
  a CA of its own (inline in the kubeconfig, as AKS writes it), bearer tokens it accepts
  (a set the caller may change mid-run, as a rotation does; anything else gets a 401),
  a TLS handshake that demands a client certificate its CA signed, and a kubeconfig
  `user` entry of the caller's choosing (a token file, an exec plugin);
- Pod Security admission at the `restricted` level (`podsecurity.py`) in namespaces
  labelled `pod-security.kubernetes.io/enforce: restricted`: a pod that breaks it is
  refused with a 403 naming each rule, as the API server refuses it; a Deployment is
  stored, and what its ReplicaSet controller would then report (a `ReplicaFailure`
  condition with the refusal) is written to its status at once.

What it still does not do, the callers must not rely on: label selectors (the operator
filters again), optimistic concurrency beyond JSON patches' tests, graceful pod
deletion (a deleted pod is gone at once), controllers (no scheduler,
kubelet or garbage collector: the lab's node agent plays those).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import itertools
import logging
import ssl
import threading
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp.test_utils
import jsonpatch
import jsonpointer
import kmock
import kmock._internal.dicts as kmock_dicts
import kmock._internal.parsing as kmock_parsing
import yaml

from torchspot_lab.kubeapi.admission import Admission, AdmissionError
from torchspot_lab.kubeapi.podsecurity import ENFORCE_LABEL, restricted_violations
from torchspot_operator import certs
from torchspot_operator.builders import merge_patch

T = TypeVar("T")

REQUEST_LOG = 8
"""Finished requests the emulator remembers (besides those still being served). kmock keeps
every request for assertions, and to match one it walks the whole log, applying each of
its reactions' filters to each logged request until it finds the new one: a request cost
grows with the log (25 ms after 500 requests, over 60 ms after 1,000; still about 20 ms
with 100-200 kept, nine tenths of the emulator's time when 200 jobs start). We assert on
objects, never on the request log."""
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
RESOURCES: dict[str, dict[str, Any]] = {
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": {"status"}},
    "v1/nodes": {"kind": "Node", "namespaced": False, "subresources": {"status"}},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": {"status", "scale"}},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    "events.k8s.io/v1/events": {"kind": "Event", "namespaced": True},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {"kind": "CustomResourceDefinition", "namespaced": False},
    "kopf.dev/v1/clusterkopfpeerings": {"kind": "ClusterKopfPeering", "namespaced": False},
    "torchspot.dev/v1alpha1/elasticjobs": {
        "kind": "ElasticJob",
        "namespaced": True,
        "singular": "elasticjob",
        "shortnames": {"ej"},
        "subresources": {"status", "scale"},
    },
}
"""Everything the operator and the lab touch, declared for discovery, list and watch."""


_kmock_parse_path = kmock_parsing.parse_path


def _parse_path(path: str) -> kmock_parsing.ParsedPath:
    """kmock's path parser, except that `/api/v1/namespaces[/NAME]` is the Namespace resource."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return kmock_parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None, None)
    return _kmock_parse_path(path)


kmock_parsing.parse_path = _parse_path  # kmock's request parsing looks it up in its module on every request


CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus object identity, versions, admission and preconditions (see the module docstring)."""

    request_log = REQUEST_LOG
    """Finished requests kept; a test that asserts on requests raises it for its few."""

    async def _serve_version(self, request: kmock.Request) -> Any:
        """Discovery of one group version, as kubectl reads it: the core group is `v1` (kmock says
        `/v1`, which kubectl cannot map), and subresources carry no short names."""
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and str(payload.get("groupVersion", "")).startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]
        for entry in payload.get("resources", []) if isinstance(payload, dict) else []:
            if "/" in entry.get("name", ""):  # a subresource: its parent's short names would be ambiguous
                entry["shortNames"] = []
        return payload

    async def _serve_list(self, request: kmock.Request) -> Any:
        """A list with its `kind` and `apiVersion`, as kubectl needs to decode it."""
        payload = await super()._serve_list(request)
        resource = request.resource
        if isinstance(payload, dict) and resource is not None:
            version = f"{resource.group}/{resource.version}" if resource.group else str(resource.version)
            info = RESOURCES.get(f"{version}/{resource.plural}")
            if info is not None:
                payload = {"apiVersion": version, "kind": f"{info['kind']}List", **payload}
        return payload

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.tokens: set[str] | None = None
        """Bearer tokens accepted (None: no authentication, as a plain lab API)."""
        self._versions = itertools.count(1)
        self._serving: set[int] = set()
        self.admissions: dict[str, Admission] = {}
        """`group/plural` of each custom resource whose CRD was created, and its admission."""
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        """Requests served, by (method, `group/version/plural[/subresource]`), watches counted when they start."""

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock has just logged the request and matches it by identity against its log: a
        # request being served must stay there (watches for minutes), finished ones may go.
        self._serving.add(id(request))
        if self.tokens is not None:
            said = request.headers.get("Authorization", "")
            if not said.startswith("Bearer ") or said.removeprefix("Bearer ") not in self.tokens:
                self._serving.discard(id(request))
                raise kmock.KubernetesError(status=401, reason="Unauthorized", message="Unauthorized")
        resource = request.resource
        if resource is not None:
            key = f"{resource.group}/{resource.version}/{resource.plural}".lstrip("/")
            key += f"/{request.subresource}" if request.subresource else ""
            self.counts[(str(request.method.value if request.method else ""), key)] += 1
        if resource is not None and request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):  # kopf names its Events so
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:10]}"
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta["resourceVersion"] = str(next(self._versions))
        try:
            if resource is not None:
                self._admit(request)
                self._pod_security(request)
                self._check_preconditions(request)
                self._version(request)
            return await super()._handle(request)
        finally:  # kmock keeps every request and error; its cost per request grows with them
            self._serving.discard(id(request))
            if len(self._requests) > len(self._serving) + self.request_log:
                finished = [r for r in self._requests if id(r) not in self._serving]
                old = {id(r) for r in finished[: len(finished) - self.request_log // 2]}
                self._requests[:] = [r for r in self._requests if id(r) not in old]
            for errors in self._errors:
                del errors[: max(0, len(errors) - self.request_log // 2)]
            for reaction in self._payloads:  # each reaction keeps those it served, too
                del reaction._requests[: max(0, len(reaction._requests) - self.request_log)]

    def _stored(self, request: kmock.Request) -> dict[str, Any] | None:
        """The object a request names, as stored (None if there is none)."""
        if request.resource is None or request.name is None:
            return None
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return dict(self._objects[key].raw)

    def _admit(self, request: kmock.Request) -> None:
        """Register a created CRD; default and check a custom resource's create or update (not its status)."""
        resource = request.resource
        assert resource is not None  # the caller checked; for the type checker
        if request.action == kmock.action.CREATE and f"{resource.group}/{resource.version}/{resource.plural}" == CRDS:
            names = request.data.get("spec", {}).get("names", {})
            self.admissions[f"{request.data['spec']['group']}/{names.get('plural')}"] = Admission(request.data)
            return
        admission = self.admissions.get(f"{resource.group}/{resource.plural}")
        if admission is None or request.subresource is not None:
            return
        try:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                stored = admission.admit(request.data)
                request.data.clear()
                request.data.update(stored)
            elif request.action == kmock.action.UPDATE and request.data is not None:
                old = self._stored(request)
                if old is None:
                    return  # kmock answers 404 itself
                try:
                    new = dict(kmock_dicts.patch_dict(old, request.data))
                except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException):
                    return  # refused as a patch that cannot apply (`_version`)
                stored = admission.admit(new, old)
                if isinstance(request.data, dict):  # store the defaults too, as the API server does
                    patch = merge_patch(old, stored)
                    request.data.clear()
                    request.data.update(patch)
        except AdmissionError as exc:
            raise kmock.KubernetesError(
                status=422, reason="Invalid", message=str(exc), details={"causes": exc.problems}
            ) from exc

    def _enforced(self, namespace: str | None) -> bool:
        """Whether a namespace enforces Pod Security's `restricted` level (its label says so)."""
        for (resource, _, name), obj in self._objects.items():
            if resource.plural == "namespaces" and name == namespace and not obj.deleted:
                return bool(obj.raw.get("metadata", {}).get("labels", {}).get(ENFORCE_LABEL) == "restricted")
        return False

    def _pod_security(self, request: kmock.Request) -> None:
        """Refuse a pod that breaks `restricted` (403); mark a Deployment whose pods would be refused."""
        resource = request.resource
        if request.action != kmock.action.CREATE or resource is None or not isinstance(request.data, dict):
            return
        if resource.plural not in ("pods", "deployments") or not self._enforced(request.namespace):
            return
        pod = request.data if resource.plural == "pods" else request.data.get("spec", {}).get("template", {})
        broken = restricted_violations(pod)
        if not broken:
            return
        name = request.data.get("metadata", {}).get("name", "")
        if resource.plural == "deployments":  # the ReplicaSet's pods are what is refused
            name = f"{name}-{uuid.uuid4().hex[:10]}"
        message = f'pods "{name}" is forbidden: violates PodSecurity "restricted:latest": {", ".join(broken)}'
        if resource.plural == "pods":
            raise kmock.KubernetesError(status=403, reason="Forbidden", message=message)
        condition = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": message}
        request.data["status"] = {"replicas": 0, "conditions": [condition]}

    def _version(self, request: kmock.Request) -> None:
        """A patch gets a new resourceVersion with it; one that cannot apply is refused (422)."""
        if request.action != kmock.action.UPDATE or request.data is None:
            return
        version = str(next(self._versions))
        if isinstance(request.data, dict):
            request.data.setdefault("metadata", {})["resourceVersion"] = version
            return
        old = self._stored(request)
        if old is None:
            return  # kmock answers 404 itself
        try:
            jsonpatch.apply_patch(old, request.data, in_place=False)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=f"the patch cannot apply: {exc}") from exc
        request.data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": version})

    def _check_preconditions(self, request: kmock.Request) -> None:
        """Refuse a DELETE whose preconditions do not match the object (409), as the API server does."""
        if request.action != kmock.action.DELETE or not isinstance(request.data, dict):
            return
        preconditions = request.data.get("preconditions") or {}
        stored = self._stored(request)
        if not preconditions or stored is None:
            return
        meta = stored.get("metadata", {})
        for field, said in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            wanted = preconditions.get(field)
            if wanted is not None and wanted != meta.get(field):
                message = (
                    f"Precondition failed: {said} in precondition: {wanted}, {said} in object meta: {meta.get(field)}"
                )
                raise kmock.KubernetesError(status=409, reason="Conflict", message=message)


class KubeApi:
    """The emulator on a loopback port, run by a background thread's event loop.

    Use it as a context manager. `run(coro)` runs a coroutine on that loop (where an
    aiohttp client may live next to the server) and returns its result.
    """

    def __init__(
        self,
        folder: Path,
        *,
        tls: bool = False,
        client_certs: bool = False,
        tokens: set[str] | None = None,
        user: dict[str, Any] | None = None,
    ) -> None:
        """`tls`: serve HTTPS with a CA of its own; `client_certs`: demand a client certificate
        (the kubeconfig carries one, inline); `tokens`: the bearer tokens accepted; `user`: the
        kubeconfig's user entry (default: the client certificate, if any, else none)."""
        self.folder = folder
        self.kubeconfig = folder / "kubeconfig"
        self.url = ""
        self.ca: certs.KeyPair | None = certs.authority("torchspot-lab-api-ca") if tls or client_certs else None
        self.client: certs.KeyPair | None = None
        if client_certs and self.ca is not None:
            self.client = certs.issue(self.ca, "torchspot-lab-user", client=True)
        self._tokens = tokens
        self._user = user
        self.emulator: Emulator | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-api", daemon=True)
        self._stop: asyncio.Event | None = None
        self._served: concurrent.futures.Future[None] | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        """Serve the API and write the kubeconfig; return once it answers."""
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per request otherwise
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        ready = asyncio.run_coroutine_threadsafe(self._ready(), self._loop)
        self._served = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        try:
            ready.result(timeout)
        except TimeoutError:
            if self._served.done():
                self._served.result()  # the server's own error says more than a timeout
            raise
        self.kubeconfig.write_text(yaml.safe_dump(self.kubeconfig_data()))

    async def _ready(self) -> None:
        while not self.url:
            await asyncio.sleep(0.01)

    def _server_context(self) -> ssl.SSLContext | None:
        """The TLS side: a server certificate for 127.0.0.1 from the emulator's CA; client certificates
        demanded if asked for."""
        if self.ca is None:
            return None
        served = certs.issue(self.ca, "torchspot-lab-api", hosts=["127.0.0.1", "localhost"], server=True)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        files = self.folder / "tls"
        files.mkdir(exist_ok=True)
        (files / "server.crt").write_bytes(served.cert)
        (files / "server.key").write_bytes(served.key)
        context.load_cert_chain(files / "server.crt", files / "server.key")
        if self.client is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=self.ca.cert.decode())
        return context

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        context = self._server_context()

        class _Served(aiohttp.test_utils.RawTestServer):
            async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
                await super().start_server(loop=loop, ssl=context, **kwargs)

        async with Emulator() as emulator, kmock.Server(emulator, server_cls=_Served) as server:
            for key, info in RESOURCES.items():  # kubectl's resource mapper needs each singular name
                emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **{"singular": info["kind"].lower(), **info})
            emulator.tokens = self._tokens
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            await self._stop.wait()

    def kubeconfig_data(self) -> dict[str, Any]:
        """A kubeconfig for kubectl, kopf and the operator: one cluster (its CA inline, as AKS writes it),
        the user entry asked for (by default the client certificate, inline, or no credentials)."""
        cluster: dict[str, Any] = {"server": self.url}
        if self.ca is not None:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca.cert).decode()
        user = self._user
        if user is None:
            user = {}
            if self.client is not None:
                user["client-certificate-data"] = base64.b64encode(self.client.cert).decode()
                user["client-key-data"] = base64.b64encode(self.client.key).decode()
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "torchspot-lab", "cluster": cluster}],
            "users": [{"name": "torchspot-lab", "user": user}],
            "contexts": [
                {
                    "name": "torchspot-lab",
                    "context": {"cluster": "torchspot-lab", "user": "torchspot-lab", "namespace": "default"},
                }
            ],
            "current-context": "torchspot-lab",
        }

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the API's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        """Stop serving and end the thread."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._served is not None:
            self._served.result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
