"""The operator's own watches (informer.py): the listed objects, then each change of the labelled ones
after the list's version, against the emulator; a watch the server ends with 410 lists again (a small
server that answers so: the emulator keeps every version)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from aiohttp import web

from tests.operator.cluster import NS, Cluster
from torchspot_operator import kube
from torchspot_operator.informer import Informer
from torchspot_operator.kube import Kube

LABELS = {"role": "worker"}


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }  # fmt: skip


def _until(what: str, condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_listed_objects_then_each_change_of_the_labelled_ones(api: Cluster) -> None:
    api.create(_pod("listed", LABELS))
    api.create(_pod("other", {"role": "etcd"}))
    seen: list[tuple[str | None, str]] = []
    lock = threading.Lock()

    def on_event(kind_of: str | None, obj: dict[str, Any]) -> None:
        with lock:
            seen.append((kind_of, obj["metadata"]["name"]))

    informer = Informer(lambda: api.kube, "v1", "Pod", LABELS, NS, on_event)

    async def start() -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(informer.run())

    task = api.api.run(start())
    try:
        _until("the listing", lambda: (None, "listed") in seen)
        api.create(_pod("made", LABELS))
        api.patch("pods", "made", {"metadata": {"annotations": {"a": "b"}}})
        api.api.run(api.kube.delete("v1", "Pod", NS, "made"))
        _until("the deletion", lambda: ("DELETED", "made") in seen)
    finally:

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        api.api.run(stop())
    assert seen == [(None, "listed"), ("ADDED", "made"), ("MODIFIED", "made"), ("DELETED", "made")]


def test_a_watch_the_server_ends_with_410_lists_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube, "BACKOFF_BASE_SECONDS", 0.01)
    lists: list[str] = []
    watches: list[str] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.query.get("watch") == "true":
            watches.append(request.query.get("resourceVersion", ""))
            if len(watches) == 1:  # the version is older than the server keeps
                gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
                return web.Response(text=json.dumps(gone) + "\n")
            added = {"type": "ADDED", "object": {**_pod("late", LABELS), "metadata": {"name": "late",
                     "namespace": NS, "resourceVersion": "12"}}}  # fmt: skip
            bookmark = {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "15"}}}
            if len(watches) == 2:
                return web.Response(text=json.dumps(added) + "\n" + json.dumps(bookmark) + "\n")
            await asyncio.sleep(1)  # a watch that stays open (until the test ends)
        lists.append(str(len(lists)))
        version = str(10 * len(lists))
        items = [
            {"metadata": {"name": f"p{len(lists)}", "namespace": NS, "resourceVersion": version, "labels": LABELS}}
        ]
        return web.json_response({"items": items, "metadata": {"resourceVersion": version}})

    seen: list[tuple[str | None, str]] = []
    listings: list[set[str]] = []

    async def scene() -> None:
        runner = web.ServerRunner(web.Server(handler))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = Kube(server=f"http://127.0.0.1:{port}", headers={}, ssl_context=True)
        client.plurals["v1", "Pod"] = "pods"
        informer = Informer(
            lambda: client,
            "v1",
            "Pod",
            LABELS,
            NS,
            lambda t, o: seen.append((t, o["metadata"]["name"])),
            lambda uids, _started: listings.append(uids),
        )
        task = asyncio.get_running_loop().create_task(informer.run())
        try:
            for _ in range(500):
                if len(watches) >= 3:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
            await runner.cleanup()

    asyncio.run(scene())
    assert seen == [(None, "p1"), (None, "p2"), ("ADDED", "late")]  # listed, 410, listed again, the change
    assert watches[:3] == ["10", "20", "15"]  # each watch from the version last seen (a bookmark's too)
    assert listings == [{""}, {""}]  # each complete listing handed on (these items carry no uid)
