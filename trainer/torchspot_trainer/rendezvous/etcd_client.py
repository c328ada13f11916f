"""The one module that talks to etcd (v3 API, through `pyetcd` from etcd-sdk-python).

Everything above this layer sees typed results and two exception types, so the
rendezvous logic never handles gRPC errors directly.

Why not the stock client defaults: pyetcd marks a single endpoint "failed" for
300 s after one UNAVAILABLE error and then refuses every call, and gRPC backs
off reconnects for up to two minutes. An etcd restart would then stall the
rendezvous for minutes. We build the client with no failure quarantine and a
reconnect backoff capped at one second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from pyetcd import exceptions as etcd_exceptions
from pyetcd import transactions, utils
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
from pyetcd.events import PutEvent

_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class EtcdError(Exception):
    """An etcd call failed (server unreachable, timeout, or server error)."""


class EtcdLeaseNotFoundError(EtcdError):
    """A write named a lease that etcd no longer knows (it expired or etcd lost its data)."""


@dataclass(frozen=True)
class KeyValue:
    """A value with the revision that last modified it (the fencing token)."""

    value: bytes
    mod_revision: int


@dataclass(frozen=True)
class CasResult:
    """Outcome of a compare-and-swap: whether it applied and what the key holds now."""

    succeeded: bool
    current: KeyValue | None


def _translate(exc: Exception, endpoint: str) -> EtcdError:
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND and "lease" in str(exc.details()):
            return EtcdLeaseNotFoundError(f"etcd at {endpoint}: {exc.details()}")
        return EtcdError(f"etcd at {endpoint}: {code.name}: {exc.details()}")
    return EtcdError(f"etcd at {endpoint}: {exc}")


_ERRORS = (grpc.RpcError, etcd_exceptions.Etcd3Exception, ValueError)


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd: the CA that signed its server certificate, and this client's certificate and key
    (PEM bytes; both or neither). The operator's managed etcd demands a client certificate signed by
    the job's own CA (`--client-cert-auth`), so only the job's pods and the operator reach it."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_files(cls, cacert: str, cert: str = "", key: str = "") -> EtcdTls:
        """Read the PEM files `--rdzv-conf cacert=,cert=,key=` name; an unreadable one is named."""

        def read(flag: str, path: str) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"--rdzv-conf {flag}={path}: cannot be read: {exc.strerror}") from exc

        ca = read("cacert", cacert)
        if ca is None:
            raise ValueError("--rdzv-conf cert and key need cacert (the CA that signed etcd's certificate)")
        return cls(ca, read("cert", cert), read("key", key))

    @classmethod
    def from_conf(cls, conf: Mapping[str, object]) -> EtcdTls | None:
        """From `--rdzv-conf` keys `cacert`, `cert` and `key` (None without cacert: plain gRPC)."""
        if not conf.get("cacert"):
            return None
        return cls.from_files(str(conf["cacert"]), str(conf.get("cert") or ""), str(conf.get("key") or ""))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


class EtcdClient:
    """A small typed client for one etcd endpoint.

    :param host: etcd host name or address.
    :param port: etcd client port.
    :param request_timeout: seconds each request may take; bounds every call,
        so a hung server cannot hang the agent's monitor loop.
    :param tls: TLS settings (None: plain gRPC, as a local etcd speaks).
    """

    def __init__(self, host: str, port: int, *, request_timeout: float, tls: EtcdTls | None = None) -> None:
        self.endpoint = f"{host}:{port}"
        secure = tls is not None
        creds = tls.credentials() if tls is not None else None
        self._client: Any = MultiEndpointEtcd3Client(
            endpoints=[
                Endpoint(host, port, secure=secure, creds=creds, time_retry=0.0, opts=_GRPC_OPTIONS),
            ],
            timeout=request_timeout,
        )
        self._tx: Any = self._client.transactions

    def close(self) -> None:
        """Close the gRPC channel."""
        self._client.close()

    def wait_reachable(self, timeout: float, *, max_delay: float = 1.0) -> None:
        """Block until etcd answers a status request, or raise after `timeout` seconds.

        The error names the endpoint, so a typo in `--rdzv-endpoint` is obvious. Tries again after
        0.05 s, doubling up to `max_delay` (a server started on this machine: keep it short).
        """
        deadline = time.monotonic() + timeout
        delay = min(0.05, max_delay)
        last: Exception | None = None
        while True:
            try:
                self._client.status()
            except _ERRORS as exc:
                last = exc
            else:
                return
            if time.monotonic() + delay > deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, max_delay)
        raise EtcdError(
            f"etcd at {self.endpoint} is unreachable: no answer within {timeout:g} s "
            f"(last error: {_translate(last, self.endpoint) if last else 'none'})"
        )

    def get(self, key: str) -> KeyValue | None:
        """Return the key's value and revision, or None if it does not exist."""
        try:
            value, meta = self._client.get(key)
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc
        if value is None:
            return None
        return KeyValue(bytes(value), int(meta.mod_revision))

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Return every key under `prefix` with its value."""
        try:
            items = list(self._client.get_prefix(prefix))
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc
        return {meta.key.decode(): bytes(value) for value, meta in items}

    def compare_and_swap(
        self, key: str, value: bytes, *, expected_revision: int | None, lease: int | None
    ) -> CasResult:
        """Write `value` only if the key's mod revision still equals `expected_revision`.

        `expected_revision=None` means "only if the key does not exist". On failure
        the key's current value comes back in the same round trip.
        """
        compare = self._tx.version(key) == 0 if expected_revision is None else self._tx.mod(key) == expected_revision
        try:
            ok, responses = self._client.transaction(
                compare=[compare],
                success=[self._tx.put(key, value, lease=lease)],
                failure=[self._tx.get(key)],
            )
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc
        if ok:
            revision = int(responses[0].response_put.header.revision)
            return CasResult(True, KeyValue(value, revision))
        kvs = responses[0] if responses else []
        if not kvs:
            return CasResult(False, None)
        current_value, meta = kvs[0]
        return CasResult(False, KeyValue(bytes(current_value), int(meta.mod_revision)))

    def put(self, key: str, value: bytes, *, lease: int | None) -> None:
        """Write unconditionally."""
        try:
            self._client.put(key, value, lease=lease)
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc

    def watch(self, key: str, on_change: Callable[[list[str] | EtcdError], None], *, prefix: bool = False) -> int:
        """Watch `key` (every key under it with `prefix`) and return the watch's id (for `cancel_watch`).

        `on_change` runs on the client's watch thread with the keys each response put (deletions
        are left out), or once with an EtcdError when the stream ends (etcd restarted or went
        away): the watch is then gone and the caller watches again. It must return quickly: every
        watch of this client waits behind it.
        """

        def deliver(response: Any) -> None:
            if isinstance(response, Exception):
                on_change(_translate(response, self.endpoint))
                return
            on_change([bytes(event.key).decode() for event in response.events if isinstance(event, PutEvent)])

        try:
            if prefix:
                return int(self._client.add_watch_prefix_callback(key, deliver))
            return int(self._client.add_watch_callback(key, deliver))
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc

    def cancel_watch(self, watch_id: int) -> None:
        """Stop a watch `watch_prefix` started (nothing if it already ended)."""
        try:
            self._client.cancel_watch(watch_id)
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc

    def compact(self, revision: int) -> None:
        """Drop the history before `revision` (what `--auto-compaction-*` does on etcd's own clock; a
        caller with a simulated clock calls it itself)."""
        try:
            self._client.compact(revision)
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc

    def delete(self, key: str) -> bool:
        """Delete one key; True if it existed."""
        try:
            return bool(self._client.delete(key))
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc

    def delete_prefix(self, prefix: str, *, keep: str = "") -> None:
        """Delete every key under `prefix`; with `keep` (a prefix under it), every key but those under
        `keep`, in one transaction (the two ranges either side of it)."""
        if keep and not keep.startswith(prefix):
            raise ValueError(f"{keep!r} is not under {prefix!r}")
        try:
            if not keep:
                self._client.delete_prefix(prefix)
                return
            end, kept_end = utils.prefix_range_end(prefix.encode()), utils.prefix_range_end(keep.encode())
            self._client.transaction(
                compare=[],
                success=[transactions.Delete(prefix, range_end=keep), transactions.Delete(kept_end, range_end=end)],
                failure=[],
            )
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc

    def grant_lease(self, ttl: int) -> int:
        """Create a lease of `ttl` seconds and return its id."""
        try:
            return int(self._client.lease(ttl).id)
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc

    def refresh_lease(self, lease_id: int) -> bool:
        """Renew a lease; False if etcd no longer has it (expired or data lost)."""
        try:
            responses: Iterator[Any] = self._client.refresh_lease(lease_id)
            ttl = int(next(iter(responses)).TTL)
        except _ERRORS as exc:
            raise _translate(exc, self.endpoint) from exc
        return ttl > 0
