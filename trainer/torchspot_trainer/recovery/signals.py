"""Eviction notices: SIGTERM and Azure Scheduled Events, turned into one flag.

Two sources warn a worker that it is about to go:

- SIGTERM, from pod deletion (kubelet) or from torchrun's agent restarting workers.
  Python runs signal handlers only on the main thread between bytecodes, so a worker
  blocked in a collective (a peer froze) would never see it, and the agent would
  SIGKILL it only after its 30 s timeout, which every recovery would then pay. A
  watcher thread learns of the signal through the interpreter's wakeup fd, which the
  C-level handler writes at once, and raises the notice (the Python-level handler does
  nothing: `_leave_to_watcher` says why); if the training loop does not reach a step
  boundary within `stuck_exit_after` seconds, the worker is stuck in a collective and
  exits with 128+SIGTERM. When the agent restarts the workers because a peer stopped
  heartbeating, it says so first (a marker file named by `PEER_LOST_ENV`): no step
  boundary can come, since every collective includes the lost peer, so the worker
  waits at most until `PEER_LOST_GRACE` seconds after its last step boundary instead
  of `stuck_exit_after`.
- Azure Scheduled Events: a thread polls the instance metadata service about once a
  second; a `Preempt` or `Terminate` event for this VM raises the notice, and the
  event is approved (`StartRequests`) after the emergency checkpoint, so the
  eviction proceeds without waiting out its notice period.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from torchspot_trainer.markers import STACKS_SIGNAL, agent_restarting, node_leaving, peer_lost, peer_lost_grace

log = logging.getLogger(__name__)

SCHEDULED_EVENTS_URL = "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01"
"""Azure's documented Scheduled Events endpoint (IMDS), reachable from every Azure VM."""
VM_NAME_URL = "http://169.254.169.254/metadata/instance/compute/name?api-version=2021-02-01&format=text"
"""IMDS path that returns this VM's name, which Scheduled Events lists in `Resources`."""
EVICTING_EVENT_TYPES = frozenset({"Preempt", "Terminate"})
STUCK_EXIT_AFTER = 10.0
"""Default seconds after SIGTERM for the loop to reach a step boundary before the worker counts as stuck
in a collective and exits (`watch_sigterm`)."""
NOTICE_HOLD = 120.0
"""Default seconds the group waits, after a notice's emergency checkpoint, for the evicted node to go
before training on (notices.NoticeStop): a notice that comes to nothing costs at most this."""
PEER_LOST_GRACE = 2.0
"""Seconds after its last step boundary that a worker told of a lost peer still waits for the
next, unless its agent wrote another figure in the marker (`markers.peer_lost_grace`: half the
liveness timeout, 0.5 s by default, for a peer that fell silent; a peer that left alive, on notice,
keeps this one): a peer that was only slow lets the step finish. Counted from
the boundary, not from the SIGTERM: a peer is declared lost only after it was silent for a while,
and a worker stuck with it since then has nothing more to wait for."""


@dataclass(frozen=True)
class Notice:
    """Why and when the worker was told to go."""

    source: str
    detail: str
    received: float
    event_id: str | None = None


RESTART_DETAIL = "the agent restarts this node's workers for its next round; the node stays"
"""What a worker logs (at INFO) for a SIGTERM that its agent's restart marker explains: not an eviction,
which every survivor's log called it at every restart of the restart path."""


class EvictionNotice:
    """A thread-safe, set-once flag with the first reason it was set for."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._notice: Notice | None = None
        self._lock = threading.Lock()
        self.acknowledged = threading.Event()
        """Set by the training loop when it has reached a step boundary after the notice."""
        self.boundary = time.monotonic()
        """When the training loop last reached a step boundary (`step_boundary`)."""
        self.parked = False
        """True while the training loop waits at a step boundary for a leaving peer (after an
        emergency checkpoint): a SIGTERM then ends the worker at once, its state being whole."""

    def step_boundary(self) -> None:
        """Record that the training loop is between two steps now."""
        self.boundary = time.monotonic()

    def set(self, source: str, detail: str, event_id: str | None = None, *, restart: bool = False) -> None:
        """Raise the notice (later calls keep the first reason). Logged after the lock is let go: a
        thread that waits on the log's handler or stream then holds nothing another setter needs.
        Never call this from a signal handler (`watch_sigterm`). `restart`: the node stays (its agent
        restarts its workers), which the log says as such rather than as an eviction notice."""
        with self._lock:
            first = self._notice is None
            if first:
                self._notice = Notice(source, detail, time.monotonic(), event_id)
        self._event.set()
        if first and restart:
            log.info("%s: %s", source, detail)
        elif first:
            log.warning("eviction notice from %s: %s", source, detail)

    def clear(self) -> None:
        """Forget a notice that came to nothing (the node was not evicted after all)."""
        with self._lock:
            self._notice = None
        self._event.clear()
        self.acknowledged.clear()

    def is_set(self) -> bool:
        """True once any source raised the notice."""
        return self._event.is_set()

    @property
    def notice(self) -> Notice | None:
        """The first notice, if any."""
        return self._notice


def stuck_wait(
    stuck_exit_after: float, lost: bool, since_boundary: float, *, parked: bool = False, grace: float = PEER_LOST_GRACE
) -> float:
    """Seconds a worker that got SIGTERM waits for a step boundary before it counts as stuck.

    Pure. Nothing when `parked` at a boundary already (its state is whole); else
    `stuck_exit_after` without a lost peer; with one, what is left of `grace` since the last
    boundary (`since_boundary` seconds ago), and nothing once that is spent.
    """
    if parked:
        return 0.0
    if not lost:
        return stuck_exit_after
    return max(0.0, min(stuck_exit_after, grace) - since_boundary)


def _leave_to_watcher(_signum: int, _frame: FrameType | None) -> None:
    """SIGTERM's Python-level handler: nothing. Installed so that the default action (terminate)
    does not fire and CPython's C handler writes the wakeup fd; the watcher thread does the work.

    A handler that did the work would run on the main thread between any two bytecodes, and again,
    nested, if a second SIGTERM came while it ran. A pod's deletion can bring two: the sandbox's
    kubelet signals the pod's whole process tree (as an init such as dumb-init signals its process
    group), then torch's agent signals its workers, milliseconds apart: a worker that took the second
    inside the first's `EvictionNotice.set` would wait there for the lock its own outer call held,
    and its watcher for the same lock, so that neither its emergency checkpoint nor its stuck exit
    came, and torch killed it 30 s later."""


def watch_sigterm(
    notice: EvictionNotice,
    *,
    stuck_exit_after: float,
    exit_now: Callable[[int], None] = os._exit,
    lost: Callable[[], bool] = peer_lost,
    grace: Callable[[], float | None] = peer_lost_grace,
    before_exit: Callable[[], None] = lambda: None,
) -> threading.Thread:
    """Turn SIGTERM into the notice, even while the main thread is blocked in C++ (and STACKS_SIGNAL
    into every thread's stack on stderr).

    Call from the main thread. CPython's C-level handler writes the signal number to
    the wakeup fd from whichever thread received the signal; a watcher thread reads
    it at once, raises the notice, and exits the process if the training loop does
    not acknowledge it at a step boundary within `stuck_exit_after` seconds, or, when
    `lost()` says a peer is gone (no boundary should come then), within what is left of the
    agent's `grace()` (PEER_LOST_GRACE when it wrote none) since the last boundary (`stuck_wait`).

    :param exit_now: how to exit (tests pass a recorder).
    :param before_exit: run before a stuck worker exits (the trainer gives its save in flight a chance).
    """
    with contextlib.suppress(OSError, AttributeError):  # a stderr with no file behind it (a notebook, a capture)
        faulthandler.register(STACKS_SIGNAL, all_threads=True, file=sys.__stderr__ or sys.stderr)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, _leave_to_watcher)

    def watch() -> None:
        while signal.SIGTERM not in os.read(read_fd, 64):
            continue
        restart = agent_restarting() and not node_leaving()  # the agent's markers, written before it signals
        notice.set("SIGTERM", RESTART_DETAIL if restart else "pod deletion or agent restart", restart=restart)
        peer_gone = lost()
        since_boundary = time.monotonic() - notice.boundary
        agents = grace() if peer_gone else None
        wait = stuck_wait(
            stuck_exit_after,
            peer_gone,
            since_boundary,
            parked=notice.parked,
            grace=PEER_LOST_GRACE if agents is None else agents,
        )
        if notice.acknowledged.wait(wait):
            return
        since = time.monotonic() - notice.boundary
        why = f" (a peer was lost; last step boundary {since:.1f} s ago)" if peer_gone else ""
        log.warning("no step boundary %.1f s after SIGTERM%s: stuck in a collective, exiting", wait, why)
        before_exit()
        exit_now(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="sigterm-watch", daemon=True)
    thread.start()
    return thread


def reset_sigterm() -> None:
    """Give a forked data-loader worker the default SIGTERM action and no wakeup fd."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def events_setting_valid(setting: str) -> bool:
    """Whether a Scheduled Events setting is one `events_url` takes: 'auto', 'off' or an http(s) URL. Pure."""
    return setting in ("auto", "off") or setting.startswith(("http://", "https://"))


def events_url(setting: str, environ: Mapping[str, str]) -> str | None:
    """The Scheduled Events endpoint to poll for `setting` ('auto', 'off' or a URL), or None. Pure.

    'auto' polls Azure's endpoint inside a Kubernetes pod (KUBERNETES_SERVICE_HOST is set), where an AKS
    node is an Azure VM; elsewhere (a laptop, CI) no metadata service answers, and polling it would only
    add a thread and a log line."""
    if setting == "off":
        return None
    if setting == "auto":
        return SCHEDULED_EVENTS_URL if environ.get("KUBERNETES_SERVICE_HOST") else None
    return setting


def evicting_events(document: dict[str, Any], vm_name: str | None) -> list[dict[str, Any]]:
    """The Preempt/Terminate events in a Scheduled Events document that concern this VM.

    Pure. An event with no `Resources`, or a VM whose name we could not learn, counts:
    an unneeded emergency checkpoint costs seconds, a missed one costs the work since
    the last checkpoint.
    """
    found = []
    for event in document.get("Events", []):
        if event.get("EventType") not in EVICTING_EVENT_TYPES:
            continue
        resources = event.get("Resources") or []
        if vm_name is None or not resources or vm_name in resources:
            found.append(event)
    return found


class ScheduledEventsWatcher:
    """Polls Azure Scheduled Events and raises the notice for this VM's eviction.

    :param url: the Scheduled Events endpoint (tests point it at a local server).
    :param vm_name: this VM's name as it appears in `Resources` (None: ask IMDS, and
        treat every evicting event as ours if that fails).
    :param interval: seconds between polls; Azure recommends about one second.
    """

    def __init__(
        self,
        notice: EvictionNotice,
        url: str = SCHEDULED_EVENTS_URL,
        *,
        vm_name: str | None = None,
        vm_name_url: str | None = VM_NAME_URL,
        interval: float = 1.0,
        timeout: float = 2.0,
    ) -> None:
        self.notice = notice
        self.url = url
        self.vm_name = vm_name
        self.vm_name_url = vm_name_url
        self.interval = interval
        self.timeout = timeout
        self.polls = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduled-events", daemon=True)

    def start(self) -> ScheduledEventsWatcher:
        """Start polling in the background."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._thread.join(timeout=self.timeout + self.interval + 1)

    def _request(self, url: str, body: bytes | None = None) -> bytes:
        request = urllib.request.Request(url, data=body, headers={"Metadata": "true"})  # noqa: S310
        if body is not None:
            request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
            data: bytes = response.read()
        return data

    def _learn_vm_name(self) -> None:
        if self.vm_name is not None or not self.vm_name_url:
            return
        try:
            self.vm_name = self._request(self.vm_name_url).decode().strip() or None
        except OSError as exc:
            log.info("could not read this VM's name from IMDS (%s); every evicting event counts", exc)

    def _run(self) -> None:
        self._learn_vm_name()
        while not self._stop.is_set():
            try:
                document = json.loads(self._request(self.url))
                self.polls += 1
            except (OSError, ValueError) as exc:
                self.errors += 1
                if self.errors == 1:
                    log.info("scheduled events not reachable at %s (%s); will keep trying", self.url, exc)
            else:
                for event in evicting_events(document, self.vm_name):
                    self.notice.set(
                        "scheduled-events",
                        f"{event.get('EventType')} {event.get('EventId')} not before {event.get('NotBefore')}",
                        event_id=str(event.get("EventId")),
                    )
                    return
            self._stop.wait(self.interval)

    def approve(self, event_id: str) -> bool:
        """Tell Azure to go ahead with the event now (after our emergency checkpoint)."""
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        try:
            self._request(self.url, body)
        except OSError as exc:
            log.warning("could not approve scheduled event %s: %s", event_id, exc)
            return False
        log.info("approved scheduled event %s", event_id)
        return True
