"""kmock's Kubernetes emulator, made good enough for kopf and the operator.

No API server installs here (see the design brief), so the operator runs against
kmock, kopf's own test emulator, served over real HTTP by server.py. What kmock
leaves out, this adds:

- `metadata.uid` and `creationTimestamp` on create, and a new `resourceVersion` on every
  create and patch, as the API server gives: kopf tells its own writes coming back from
  stale events by it (without it, kopf handled one creation several times); a JSON patch
  that cannot apply (kopf's `test` of the resourceVersion, from an older read) is
  refused with a 422, as the API server refuses it, and kopf tries again on its next
  cycle; and a name for objects created with `generateName` (kopf's Events);
- the resources the operator lists and watches, declared up front (kmock serves a
  list only for resources it knows, and learns a CRD's group only if told);
- a short request log (see `REQUEST_LOG`), so requests stay cheap however many came before;
- the Namespace collection: kmock reads `/api/v1/namespaces` as the start of a
  namespaced path and fails with a 500, which kept kopf's namespaced mode (it lists
  and watches namespaces) from starting; `_parse_path` reads those paths as the API
  server does;
- admission of custom resources: once a CustomResourceDefinition object is created,
  every create and patch of its resources is pruned of undeclared fields, defaulted and
  checked against its schema and CEL rules, transition rules included (`admission.py`),
  and refused with a 422 naming each problem, as `kubectl apply` against a cluster would
  be; with `fieldValidation=Strict` (kubectl's default) an undeclared field is refused
  with a 400 naming it instead of pruned;
- delete preconditions: a DELETE whose `preconditions.uid` (or `resourceVersion`)
  does not match the object is refused with a 409, as the API server refuses it, so
  a controller's "delete only what I own" guard can be tested;
- a count of requests by verb and resource (`Emulator.counts`), for the operator
  benchmark's requests per job;
- Pod Security admission at the `restricted` level (`podsecurity.py`) in namespaces
  labelled `pod-security.kubernetes.io/enforce: restricted`: a pod that breaks it is
  refused with a 403 naming each rule, as the API server refuses it; a Deployment is
  stored, and what its ReplicaSet controller would then report (a `ReplicaFailure`
  condition with the refusal) is written to its status at once;
- ResourceQuota: a create that would take a namespace's object counts (`count/<resource>[.<group>]`,
  e.g. `count/deployments.apps`, and the older `pods`, `secrets`, `services`, `configmaps`) or a pod's
  requests (`requests.<resource>`, e.g. `requests.nvidia.com/gpu`) past a ResourceQuota's
  `spec.hard` is refused with the API server's 403 "exceeded quota" message;
- lists a page at a time (`limit`, `continue`), as the API server serves them to pagers, and lists
  and watches filtered by their `labelSelector` (kmock ignores it);
- server-side apply's request (`application/apply-patch+yaml`, `fieldManager`, `force`) taken as a
  merge patch of the applied object: the values land, field ownership is not kept;
- `metadata.generation`: 1 at create, one more at each merge patch that changes the spec (not
  the status subresource), as controllers read it;
- optimistic concurrency: a merge patch that names a `metadata.resourceVersion` other than the
  stored one is refused with the API server's 409 Conflict;
- graceful deletion of pods, when `graceful` is set: a DELETE with a grace period marks the
  pod Terminating (`deletionTimestamp`, a MODIFIED event) and removes it when the period
  (at most `graceful` seconds here) ends, as the kubelet's confirmation would;
- a watch cut with a 410 (`cut_watches`): the open watches of a resource end with "too old
  resource version", and new lists and watches of it wait until `resume_watches`, so an
  object deleted in between is never seen deleted by a watcher (only missing from its relist);
- the node controller (`nodes_unknown`): nodes marked Ready Unknown with the unreachable
  taint, as after missed leases (one node, or all of them in a control-plane blip);
- evictions the cluster makes (`evict`: the eviction API, the taint manager, the kubelet
  under node pressure): Failed, reason Evicted, and the `DisruptionTarget` condition naming
  who; the kubelet's evictions for the pod's own limits (`limit_evict`): Failed, reason
  Evicted, no DisruptionTarget.

What it still does not do is listed in the package's docstring (kubeapi/__init__.py).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
import kmock
import kmock._internal.dicts as kmock_dicts
import kmock._internal.dsl as kmock_dsl
import kmock._internal.parsing as kmock_parsing
import kmock._internal.rendering as kmock_rendering

from torchspot_lab.kubeapi.admission import Admission, AdmissionError
from torchspot_lab.kubeapi.podsecurity import ENFORCE_LABEL, restricted_violations
from torchspot_operator import conditions, constants, nodes
from torchspot_operator.builders import merge_patch

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
    "v1/resourcequotas": {"kind": "ResourceQuota", "namespaced": True},
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

_kmock_filter_contains = kmock_dsl.Filter.__contains__


def _filter_contains(self: kmock_dsl.Filter, item: Any) -> bool:
    """Whether a request is among a filter's: among its source's and passing its criteria. kmock asks
    this of each reaction for each request, and its own answer walks the source's whole log applying
    the criteria to every request in it, those still being served included: with a hundred requests
    in flight (a wave of evictions) that was four tenths of the emulator's time. The same answer, for
    one request."""
    if isinstance(item, kmock_rendering.Request):
        return item in self._source and bool(self.criteria(item))
    return bool(_kmock_filter_contains(self, item))


def _priority_contains(self: kmock_dsl.Priority, item: Any) -> bool:
    """A priority passes its source's requests through: the same question, asked of the source."""
    if isinstance(item, kmock_rendering.Request):
        return item in self._source
    return bool(kmock_dsl.View.__contains__(self, item))


kmock_dsl.Filter.__contains__ = _filter_contains  # type: ignore[method-assign,assignment]
kmock_dsl.Priority.__contains__ = _priority_contains  # type: ignore[method-assign,assignment]


@dataclass(frozen=True)
class Arrival:
    """One accepted create: when it reached the emulator, what was made."""

    at: float
    plural: str
    namespace: str
    name: str
    labels: dict[str, str]


def _list_key(item: Mapping[str, Any]) -> str:
    """Where an object sorts in a list: namespace, then name (etcd's key order, as the API server lists)."""
    meta = item.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
QUOTA_LEGACY_COUNTS = frozenset({"pods", "services", "secrets", "configmaps", "persistentvolumeclaims"})
"""Core resources a ResourceQuota also counts under their bare name (`secrets: 10`), besides `count/<name>`."""


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
        """A list with its `kind` and `apiVersion`, as kubectl needs to decode it; with `limit`, one page
        in the API server's order (namespace, then name), and a `continue` token for the next when there
        is more: the last key given, so a page goes on after it whatever was created or deleted
        meanwhile. (An offset, as it was, skipped as many objects as had been deleted before it between
        two pages: kopf's paged listing of 200 jobs missed 11 of them while a benchmark deleted others.)"""
        payload = await super()._serve_list(request)
        resource = request.resource
        if isinstance(payload, dict) and resource is not None:
            version = f"{resource.group}/{resource.version}" if resource.group else str(resource.version)
            info = RESOURCES.get(f"{version}/{resource.plural}")
            if info is not None:
                payload = {"apiVersion": version, "kind": f"{info['kind']}List", **payload}
            # The version the list is at (kmock says "..."): a watch from it replays nothing older.
            payload["metadata"] = {**(payload.get("metadata") or {}), "resourceVersion": str(self._version_now)}
            selector = str(request.params.get("labelSelector") or "")
            if selector:
                items = [i for i in payload.get("items") or [] if nodes.selected(_labels(i), selector)]
                payload = {**payload, "items": items}
            limit = int(request.params.get("limit") or 0)
            if limit > 0:
                after = str(request.params.get("continue") or "")
                items = sorted(payload.get("items") or [], key=_list_key)
                rest = [item for item in items if _list_key(item) > after] if after else items
                page = rest[:limit]
                following = _list_key(page[-1]) if len(rest) > limit else ""
                payload = {**payload, "items": page}
                payload["metadata"] = {**(payload.get("metadata") or {}), "continue": following}
        return payload

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.tokens: set[str] | None = None
        """Bearer tokens accepted (None: no authentication, as a plain lab API)."""
        self._version_now = 0
        """The newest resourceVersion given out (`_next_version`)."""
        self._serving: set[int] = set()
        self.admissions: dict[str, Admission] = {}
        """`group/plural` of each custom resource whose CRD was created, and its admission."""
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        """Requests served, by (method, `group/version/plural[/subresource]`), watches counted when they start."""
        self.arrived: list[Arrival] = []
        """Each create the emulator accepted, in order, timed when it reached the emulator
        (`time.perf_counter`): a benchmark's clock for "the replacement exists", finer than
        creationTimestamp's second, and read from another thread by its length (appends only) without
        a pass over the objects in the emulator's loop."""
        self.graceful: float | None = None
        """Seconds a deleted pod stays Terminating at most (its grace period, capped); None: gone at once."""
        self._keys: dict[str, list[Any]] = collections.defaultdict(list)
        """kmock's object keys by plural (`_keys_of`), as far as `_keyed` of them have been filed."""
        self._keyed = 0
        self._cut: dict[str, asyncio.Event] = {}
        """Resources (plural) whose watches are cut: lists and watches wait for the event."""
        self._tasks: set[asyncio.Task[None]] = set()
        """Graceful deletions under way (kept referenced until they end)."""

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
            meta.setdefault("creationTimestamp", conditions.timestamp(datetime.now(UTC)))
            meta["generation"] = 1
            meta["resourceVersion"] = self._next_version()
        reached = time.perf_counter()
        try:
            if resource is not None:
                gate = self._cut.get(str(resource.plural))
                if gate is not None and request.action in (kmock.action.LIST, kmock.action.WATCH):
                    await gate.wait()
                self._admit(request)
                self._pod_security(request)
                self._quota(request)
                self._check_preconditions(request)
                self._version(request)
                if await self._graceful_delete(request):
                    return await self._serve_fetch_raw(request)
            served = await super()._handle(request)
            self._arrived(request, reached)
            return served
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

    def _KubernetesEmulator__get_objs(self, request: kmock.Request, strict: bool) -> list[Any]:
        """kmock's lookup of the objects a request names, which scans every object it holds: with 20,000
        objects (a thousand jobs' pods and etcds) each GET, PATCH and DELETE cost milliseconds of the one
        thread that serves every request. A request that names one object is looked up by its key;
        anything else (lists, watches, a key that misses) is kmock's own scan."""
        if strict and request.name is not None and request.resource is not None:
            found = self._objects._objects.get((request.resource, request.namespace, request.name))
            if found is not None:
                return [found]
        scan = kmock.KubernetesEmulator._KubernetesEmulator__get_objs  # type: ignore[attr-defined]
        return list(scan(self, request, strict))

    def _stored(self, request: kmock.Request) -> dict[str, Any] | None:
        """The object a request names, as stored (None if there is none)."""
        if request.resource is None or request.name is None:
            return None
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return dict(self._objects[key].raw)

    def _arrived(self, request: kmock.Request, reached: float) -> None:
        """Note an accepted create in `arrived`."""
        resource = request.resource
        if resource is None or request.action != kmock.action.CREATE or not isinstance(request.data, dict):
            return
        meta = request.data["metadata"]
        labels = dict(meta.get("labels") or {})
        self.arrived.append(
            Arrival(reached, str(resource.plural), str(request.namespace or ""), str(meta["name"]), labels)
        )

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
        strict = request.params.get("fieldValidation") == "Strict"  # what kubectl sends
        try:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                stored = admission.admit(request.data, strict=strict)
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
                stored = admission.admit(new, old, strict=strict)
                if isinstance(request.data, dict):  # store the defaults (and the pruning) too, as the API server does
                    patch = merge_patch(old, stored)
                    request.data.clear()
                    request.data.update(patch)
        except AdmissionError as exc:
            raise kmock.KubernetesError(
                status=exc.status,
                reason="Invalid" if exc.status == 422 else "BadRequest",
                message=str(exc),
                details={"causes": exc.problems},
            ) from exc

    def _enforced(self, namespace: str | None) -> bool:
        """Whether a namespace enforces Pod Security's `restricted` level (its label says so)."""
        for found in self._objects_of("namespaces"):
            if found.get("metadata", {}).get("name") == namespace:
                return bool(found.get("metadata", {}).get("labels", {}).get(ENFORCE_LABEL) == "restricted")
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
        version = self._next_version()
        if isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            stored = self._stored(request) if "spec" in request.data and not request.subresource else None
            if stored is not None and dict(kmock_dicts.patch_dict(stored, request.data)).get("spec") != stored.get(
                "spec"
            ):
                meta["generation"] = int(stored.get("metadata", {}).get("generation") or 1) + 1  # a spec change
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
        """Refuse a DELETE whose preconditions, or a merge patch whose `metadata.resourceVersion`, do not
        match the object (409), as the API server does."""
        if request.action == kmock.action.UPDATE and isinstance(request.data, dict):
            wanted = (request.data.get("metadata") or {}).get("resourceVersion")
            stored = self._stored(request)
            if wanted and stored is not None and wanted != stored.get("metadata", {}).get("resourceVersion"):
                plural = request.resource.plural if request.resource is not None else "objects"
                message = (
                    f'Operation cannot be fulfilled on {plural} "{request.name}": the object has been modified; '
                    "please apply your changes to the latest version and try again"
                )
                raise kmock.KubernetesError(status=409, reason="Conflict", message=message)
            return
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

    # -- what a cluster's other parts do (see the module docstring) ---------------------------

    def _keys_of(self, plural: str) -> list[Any]:
        """kmock's keys of one resource's objects. kmock keeps every object it ever held in one dict, in
        order, and never removes a key (a deletion is a flag), so the keys added since the last call are
        the dict's last ones: filing them costs their number, where a scan of 20,000 objects for the
        namespace and quota checks of each pod create cost the emulator about 10 ms a create."""
        store = self._objects._objects
        if len(store) < self._keyed:  # not kmock's way; start again rather than lie
            self._keys.clear()
            self._keyed = 0
        for key in itertools.islice(store, self._keyed, None):
            self._keys[str(key[0].plural)].append(key)
        self._keyed = len(store)
        return self._keys.get(plural, [])

    def _objects_of(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """The live objects of a resource (in a namespace, if given)."""
        store = self._objects._objects
        found = []
        for key in self._keys_of(plural):
            obj = store[key]
            if not obj.deleted and (namespace is None or key[1] == namespace):
                found.append(dict(obj.raw))
        return found

    def _quota(self, request: kmock.Request) -> None:
        """Refuse a create that would exceed a ResourceQuota of its namespace (403), as the API server does."""
        resource = request.resource
        if request.action != kmock.action.CREATE or resource is None or not isinstance(request.data, dict):
            return
        namespace = request.namespace or request.data.get("metadata", {}).get("namespace")
        plural = str(resource.plural)
        counted = {f"count/{plural}.{resource.group}" if resource.group else f"count/{plural}"}
        if not resource.group and plural in QUOTA_LEGACY_COUNTS:
            counted.add(plural)
        quotas = self._objects_of("resourcequotas", namespace)
        if not quotas:
            return
        existing = self._objects_of(plural, namespace)
        if plural == "pods":  # a finished pod no longer counts
            existing = [p for p in existing if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
        for quota in quotas:
            for key, hard in (quota.get("spec", {}).get("hard") or {}).items():
                if key in counted:
                    used, wanted = float(len(existing)), 1.0
                elif plural == "pods":
                    used, wanted = sum(_usage(pod, key) for pod in existing), _usage(request.data, key)
                else:
                    continue
                if wanted and used + wanted > _quantity(hard):
                    name = request.data.get("metadata", {}).get("name", "")
                    message = (
                        f'{plural} "{name}" is forbidden: exceeded quota: {quota["metadata"]["name"]}, '
                        f"requested: {key}={wanted:g}, used: {key}={used:g}, limited: {key}={hard}"
                    )
                    raise kmock.KubernetesError(status=403, reason="Forbidden", message=message)

    async def _graceful_delete(self, request: kmock.Request) -> bool:
        """With `graceful` set, a pod DELETE with a grace period marks the pod Terminating and removes it
        when the period ends (at most `graceful` s); True if it did (the caller answers with the pod)."""
        resource = request.resource
        if self.graceful is None or request.action != kmock.action.DELETE or resource is None:
            return False
        if resource.plural != "pods" or request.name is None:
            return False
        key = (resource, request.namespace, request.name)
        if key not in self._objects:
            return False
        stored = self._objects[key]
        if stored.deleted or stored.get("metadata", {}).get("deletionTimestamp"):
            return False
        said = request.data.get("gracePeriodSeconds") if isinstance(request.data, dict) else None
        grace = said if said is not None else stored.get("spec", {}).get("terminationGracePeriodSeconds", 30)
        if not grace:
            return False
        uid = stored.get("metadata", {}).get("uid")
        now = conditions.timestamp(datetime.now(UTC))
        meta = {
            "deletionTimestamp": now,
            "deletionGracePeriodSeconds": grace,
            "resourceVersion": self._next_version(),
        }
        async with self._lock:
            stored.patch({"metadata": meta})
            await self._buses[resource].put({"type": "MODIFIED", "object": stored.raw})

        async def remove() -> None:
            await asyncio.sleep(min(float(grace), self.graceful or 0.0))
            async with self._lock:
                current = self._objects[key] if key in self._objects else None  # noqa: SIM401 - no .get()
                if current is not None and not current.deleted and current.get("metadata", {}).get("uid") == uid:
                    raw = current.raw
                    current.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})

        self._tasks.add(task := asyncio.get_running_loop().create_task(remove()))
        task.add_done_callback(self._tasks.discard)
        return True

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """kmock's watch, filtered by its `labelSelector` as the API server filters it (lists too), and from
        its `resourceVersion`: kmock replays every object as ADDED when a watch starts, so each of kopf's
        watch reconnects (every `server_timeout`) sent 8,000 pods again; an object at or below the
        version the watcher asked from is not sent (deletions in between are not kept, as kmock keeps
        no history: a watcher that needs them relists, as after a 410)."""
        selector = str(request.params.get("labelSelector") or "")
        since = str(request.params.get("resourceVersion") or "")
        async for event in super()._serve_watch(request):
            said: dict[str, Any] = event if isinstance(event, dict) else {}
            found: dict[str, Any] = said.get("object") or {}
            if found.get("kind", "Status") == "Status":
                yield event
                continue
            version = str((found.get("metadata") or {}).get("resourceVersion") or "")
            old = since.isdigit() and version.isdigit() and int(version) <= int(since) and said.get("type") == "ADDED"
            if not old and (not selector or nodes.selected(_labels(found), selector)):
                yield event

    def _next_version(self) -> str:
        self._version_now += 1
        return str(self._version_now)

    async def _serve_fetch_raw(self, request: kmock.Request) -> Any:
        stored = self._stored(request)
        return aiohttp.web.json_response(stored or {})

    async def cut_watches(self, plural: str) -> None:
        """End the open watches of a resource with a 410 Gone ("too old resource version", as after an API
        server restart) and hold new lists and watches of it until `resume_watches`."""
        self._cut[plural] = asyncio.Event()
        # kmock sends a watch only the events of its namespace: one 410 for each namespace with objects of
        # the resource (a namespaced watch), and one with none (a cluster-wide watch, which ends at the first).
        namespaces = sorted({str(key[1]) for key in self._keys_of(plural) if key[1]})
        for resource in list(self._buses):
            if resource.plural == plural:
                for namespace in [None, *namespaces]:
                    status: dict[str, Any] = {"kind": "Status", "code": 410, "reason": "Expired",
                                              "message": "too old resource version"}  # fmt: skip
                    if namespace is not None:
                        status["metadata"] = {"namespace": namespace}
                    await self._buses[resource].put({"type": "ERROR", "object": status})

    def resume_watches(self, plural: str) -> None:
        """Let the watchers of a cut resource list and watch again."""
        gate = self._cut.pop(plural, None)
        if gate is not None:
            gate.set()

    async def nodes_unknown(self, names: list[str] | None = None) -> None:
        """The node lifecycle controller after missed leases: Ready Unknown and the unreachable taint on
        the named nodes (all of them if None)."""
        await self._mark_nodes(names, "Unknown", "NodeStatusUnknown", tainted=True)

    async def nodes_ready(self, names: list[str] | None = None) -> None:
        """The kubelets report again: Ready True, the unreachable taint gone."""
        await self._mark_nodes(names, "True", "KubeletReady", tainted=False)

    async def _mark_nodes(self, names: list[str] | None, status: str, reason: str, *, tainted: bool) -> None:
        """Set the Ready condition of the named nodes (all if None), with the unreachable taint or without."""
        now = conditions.timestamp(datetime.now(UTC))
        for node in self._objects_of("nodes"):
            name = node["metadata"]["name"]
            if names is not None and name not in names:
                continue
            key = constants.UNREACHABLE_TAINT
            taints = [t for t in node.get("spec", {}).get("taints") or [] if t.get("key") != key]
            if tainted:
                taints.append({"key": key, "effect": "NoExecute", "timeAdded": now})
            ready = {"type": "Ready", "status": status, "reason": reason, "lastTransitionTime": now}
            await self._patch_object(
                "nodes", None, name, {"spec": {"taints": taints}, "status": {"conditions": [ready]}}
            )

    async def evict(self, namespace: str, name: str, reason: str = "EvictionByEvictionAPI") -> None:
        """An eviction the cluster makes (the eviction API in a drain, the taint manager, the kubelet under node
        pressure): the pod Failed, reason Evicted, with the DisruptionTarget condition naming who did it."""
        disrupted = {"type": "DisruptionTarget", "status": "True", "reason": reason}
        status = {"phase": "Failed", "reason": "Evicted", "conditions": [disrupted]}
        await self._patch_object("pods", namespace, name, {"status": status})

    async def limit_evict(self, namespace: str, name: str, message: str) -> None:
        """The kubelet's eviction of a pod over its own limit (emptyDir sizeLimit, ephemeral storage): Failed,
        reason Evicted, and no DisruptionTarget (Kubernetes counts it as the pod's fault)."""
        await self._patch_object(
            "pods", namespace, name, {"status": {"phase": "Failed", "reason": "Evicted", "message": message}}
        )

    async def _patch_object(self, plural: str, namespace: str | None, name: str, patch: dict[str, Any]) -> None:
        for (resource, ns, found), obj in self._objects.items():
            if resource.plural == plural and ns == namespace and found == name and not obj.deleted:
                async with self._lock:
                    obj.patch({**patch, "metadata": {"resourceVersion": self._next_version()}})
                    await self._buses[resource].put({"type": "MODIFIED", "object": obj.raw})
                return


def _quantity(text: Any) -> float:
    """A Kubernetes quantity as a number (the suffixes quotas on pods and GPUs use)."""
    value = str(text)
    for suffix, factor in (
        ("Ki", 2**10),
        ("Mi", 2**20),
        ("Gi", 2**30),
        ("Ti", 2**40),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
    ):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def _usage(pod: dict[str, Any], key: str) -> float:
    """What one pod counts against a requests or limits quota key: the sum of its containers'."""
    kind, _, name = key.partition(".")
    field = {"requests": "requests", "limits": "limits"}.get(kind)
    if field is None:
        field, name = "requests", key
    return sum(
        _quantity(((c.get("resources") or {}).get(field) or {}).get(name, 0))
        for c in pod.get("spec", {}).get("containers") or []
    )


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})
