"""A local stand-in for Azure's instance metadata service (IMDS), for the sandbox and tests.

IMDS exists only inside Azure VMs, so it cannot run here. This server answers the two
paths torchspot's trainer uses, with the response shapes Azure documents:
`GET /metadata/scheduledevents` (a document of events that a scenario script fills)
and `GET /metadata/instance/compute/name`; it records approvals (`POST` with
`StartRequests`). It is the one stand-in the project uses for Azure's data plane.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
VM_NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"


def scheduled_event(kind: str, resources: list[str], event_id: str = "E1") -> dict[str, Any]:
    """One event in Azure's documented shape (EventStatus Scheduled)."""
    return {
        "EventId": event_id, "EventType": kind, "ResourceType": "VirtualMachine", "Resources": resources,
        "EventStatus": "Scheduled", "NotBefore": "Mon, 23 Nov 2026 08:00:00 GMT",
        "Description": "", "EventSource": "Platform", "DurationInSeconds": -1,
    }  # fmt: skip


class FakeImds:
    """Serves Scheduled Events and the VM name on 127.0.0.1; records approvals.

    :param vm_name: what `/metadata/instance/compute/name` returns.
    """

    def __init__(self, vm_name: str = "aks-spot-vmss_3") -> None:
        self.vm_name = vm_name
        self.document: dict[str, Any] = {"DocumentIncarnation": 1, "Events": []}
        self.posts: list[dict[str, Any]] = []
        self.polls: list[float] = []
        """When each Scheduled Events request came (time.monotonic())."""
        self.headers_ok = True
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                return

            def _reply(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                outer.headers_ok &= self.headers.get("Metadata") == "true"
                if self.path.startswith("/metadata/instance/compute/name"):
                    self._reply(outer.vm_name.encode())
                else:
                    outer.polls.append(time.monotonic())
                    self._reply(json.dumps(outer.document).encode())

            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                outer.posts.append(json.loads(self.rfile.read(length)))
                self._reply(b"")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def events_url(self) -> str:
        """What the trainer's --scheduled-events takes."""
        return self.base + SCHEDULED_EVENTS_PATH

    @property
    def name_url(self) -> str:
        """The VM-name path."""
        return self.base + VM_NAME_PATH

    def preempt(self, event_id: str, resources: list[str] | None = None) -> None:
        """Announce a Preempt of this VM (or of `resources`)."""
        self.document["DocumentIncarnation"] += 1
        self.document["Events"] = [scheduled_event("Preempt", resources or [self.vm_name], event_id)]

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()
