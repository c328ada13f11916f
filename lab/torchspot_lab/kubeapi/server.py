"""The emulator (emulator.py) served on a loopback port by a background thread's event loop, with a
kubeconfig file pointing at it, so kopf logs in as it would to a cluster.

HTTPS and credentials, when asked for (`KubeApi(tls=True, tokens=..., client_certs=True)`):
a CA of its own (inline in the kubeconfig, as AKS writes it), bearer tokens it accepts
(a set the caller may change mid-run, as a rotation does; anything else gets a 401),
a TLS handshake that demands a client certificate its CA signed, and a kubeconfig
`user` entry of the caller's choosing (a token file, an exec plugin).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import ssl
import threading
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp.test_utils
import kmock
import yaml

from torchspot_lab.kubeapi.emulator import RESOURCES, VERBS, Emulator
from torchspot_operator import certs

T = TypeVar("T")


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
