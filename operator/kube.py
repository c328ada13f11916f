"""The one thin layer that talks to the Kubernetes API (aiohttp, the client kopf itself uses).

It knows URLs, verbs and status codes, nothing about ElasticJobs. Two tolerances are
deliberate: a create that finds the object already there (409) and a delete that finds
it gone (404) both count as done, because reconcile is level-based and may repeat a
step that an earlier pass (or a restarted operator) already took.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
import kopf

log = logging.getLogger(__name__)


def _plural(kind_or_plural: str) -> str:
    """A kind's resource name: lower case plus "s" (Pod -> pods, ElasticJob -> elasticjobs), which
    holds for every kind this project touches; a name already in lower case is taken as the plural.
    A rule rather than a table: a kind missing from a table used to be posted to a wrong path."""
    return kind_or_plural.lower() + "s" if kind_or_plural[:1].isupper() else kind_or_plural


def _field(obj: Mapping[str, Any], path: str) -> str:
    """A dotted field of an object as a field selector sees it ('' when absent)."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


class ApiError(RuntimeError):
    """A Kubernetes API call failed; `status` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def collection(api_version: str, kind_or_plural: str, namespace: str | None) -> str:
    """The URL path of a collection: /api/v1/..., /apis/group/version/..., namespaced or not."""
    plural = _plural(kind_or_plural)
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


@dataclass
class Kube:
    """An API session: server URL, headers (bearer token) and TLS settings from kopf's login."""

    server: str
    headers: dict[str, str]
    ssl_context: ssl.SSLContext | bool
    session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection(cls, info: kopf.ConnectionInfo) -> Self:
        """Use the credentials kopf logged in with (service account in a pod, kubeconfig outside)."""
        headers = {}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        context: ssl.SSLContext | bool = True
        if info.server.startswith("https"):
            context = ssl.create_default_context(cafile=info.ca_path, cadata=_text(info.ca_data))
            if info.insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if info.certificate_path and info.private_key_path:
                context.load_cert_chain(info.certificate_path, info.private_key_path)
        return cls(server=info.server.rstrip("/"), headers=headers, ssl_context=context)

    async def _request(self, method: str, path: str, body: Any = None, content_type: str = "") -> Any:
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession(headers=self.headers)
        headers = {"Content-Type": content_type or "application/json"}
        data = None if body is None else json.dumps(body)
        async with self.session.request(
            method, self.server + path, data=data, headers=headers, ssl=self.ssl_context
        ) as response:
            text = await response.text()
            if response.status >= 400:
                raise ApiError(response.status, _message(text))
            return json.loads(text) if text else {}

    async def close(self) -> None:
        """Close the HTTP session."""
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def renew(self, fresh: Kube) -> None:
        """Take new credentials (kopf logged in again); the next request opens a new session."""
        self.server, self.headers, self.ssl_context = fresh.server, fresh.headers, fresh.ssl_context
        await self.close()

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """One object, or None if it does not exist."""
        try:
            found: dict[str, Any] = await self._request("GET", f"{collection(api_version, kind, namespace)}/{name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return found

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        labels: Mapping[str, str] | None = None,
        *,
        fields: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Objects of a kind, filtered by labels and fields (`spec.nodeName`) here too: some
        API emulators ignore the selectors."""
        path = collection(api_version, kind, namespace)
        query = []
        if labels:
            query.append("labelSelector=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        if fields:
            query.append("fieldSelector=" + ",".join(f"{k}={v}" for k, v in fields.items()))
        if query:
            path += "?" + "&".join(query)
        items: list[dict[str, Any]] = (await self._request("GET", path)).get("items", [])
        if labels:
            items = [
                item
                for item in items
                if all(item.get("metadata", {}).get("labels", {}).get(k) == v for k, v in labels.items())
            ]
        if fields:
            items = [item for item in items if all(_field(item, k) == v for k, v in fields.items())]
        return items

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create an object and return it as stored; None if one of that name existed already (409)."""
        meta = obj["metadata"]
        path = collection(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        try:
            created: dict[str, Any] = await self._request("POST", path, obj)
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
            await self._request("DELETE", f"{collection(api_version, kind, namespace)}/{name}", body)
        except ApiError as exc:
            if exc.status == 404 or (exc.status == 409 and uid is not None):
                return False
            raise
        return True

    async def patch(
        self, api_version: str, kind: str, namespace: str | None, name: str, patch: Any, *, subresource: str = ""
    ) -> None:
        """Merge-patch an object (or one of its subresources, such as `status`)."""
        path = f"{collection(api_version, kind, namespace)}/{name}" + (f"/{subresource}" if subresource else "")
        await self._request("PATCH", path, patch, "application/merge-patch+json")

    async def patch_status(self, api_version: str, plural: str, namespace: str, name: str, status: Any) -> None:
        """Merge-patch an object's status through its status subresource.

        Falls back to patching the object itself where the subresource is not served
        (an API emulator); a real API server with the subresource serves the first.
        """
        try:
            await self.patch(api_version, plural, namespace, name, {"status": status}, subresource="status")
        except ApiError as exc:
            if exc.status not in (404, 405):
                raise
            await self.patch(api_version, plural, namespace, name, {"status": status})


def delete_options(grace: int | None, uid: str | None) -> dict[str, Any]:
    """The DeleteOptions body: dependents go in the background, a grace period and a uid precondition if given."""
    body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
    if grace is not None:
        body["gracePeriodSeconds"] = grace
    if uid is not None:
        body["preconditions"] = {"uid": uid}
    return body


def _text(data: Any) -> str | None:
    if data is None:
        return None
    return data.decode() if isinstance(data, bytes) else str(data)


def _message(text: str) -> str:
    """The API's own error message (a Status object), or the raw body."""
    try:
        return str(json.loads(text).get("message", text))
    except (ValueError, AttributeError):
        return text[:500]
