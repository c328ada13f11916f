"""Eviction notices: Azure Scheduled Events and SIGTERM.

The Azure instance metadata service cannot run here: `torchspot_lab.imds.FakeImds`, a
local HTTP server, stands in for it, returning the documented response shapes and
recording the approval POST. It is the one stand-in the project uses for Azure's data plane.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchspot_lab.imds import FakeImds, scheduled_event
from torchspot_lab.local import wait_for
from torchspot_trainer.markers import (
    LEAVING_MARKER,
    PEER_LOST_ENV,
    RESTART_MARKER,
    agent_restarting,
    node_leaving,
    peer_lost,
    peer_lost_grace,
)
from torchspot_trainer.recovery.signals import (
    PEER_LOST_GRACE,
    RESTART_DETAIL,
    EvictionNotice,
    ScheduledEventsWatcher,
    evicting_events,
    stuck_wait,
)

_event = scheduled_event


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    server = FakeImds()
    yield server
    server.close()


@pytest.mark.parametrize(
    ("events", "vm", "want"),
    [
        ([_event("Preempt", ["vm_3"])], "vm_3", ["E1"]),
        ([_event("Terminate", ["vm_3"])], "vm_3", ["E1"]),
        ([_event("Preempt", ["vm_4"])], "vm_3", []),
        ([_event("Freeze", ["vm_3"]), _event("Reboot", ["vm_3"], "E2")], "vm_3", []),
        ([_event("Preempt", [])], "vm_3", ["E1"]),
        ([_event("Preempt", ["vm_4"])], None, ["E1"]),
    ],
    ids=[
        "preempt-mine",
        "terminate-mine",
        "other-vm",
        "not-evicting",
        "no-resources",
        "unknown-name",
    ],
)
def test_evicting_events(events: list[dict[str, Any]], vm: str | None, want: list[str]) -> None:
    got = evicting_events({"DocumentIncarnation": 2, "Events": events}, vm)
    assert [e["EventId"] for e in got] == want


def test_watcher_raises_notice_for_this_vm_and_approves(imds: FakeImds) -> None:
    notice = EvictionNotice()
    watcher = ScheduledEventsWatcher(notice, imds.events_url, vm_name_url=imds.name_url, interval=0.05).start()
    try:
        wait_for(lambda: watcher.polls >= 2, 5, "two polls")
        assert watcher.vm_name == "aks-spot-vmss_3"
        imds.document["Events"] = [_event("Preempt", ["some-other-vm"], "X")]
        wait_for(lambda: watcher.polls >= 5, 5, "more polls")
        assert not notice.is_set()
        imds.document["Events"] = [_event("Preempt", ["aks-spot-vmss_3"], "E42")]
        wait_for(notice.is_set, 5, "the notice")
    finally:
        watcher.stop()
    assert notice.notice is not None
    assert notice.notice.source == "scheduled-events"
    assert notice.notice.event_id == "E42"
    assert imds.headers_ok
    assert watcher.approve("E42")
    assert imds.posts == [{"StartRequests": [{"EventId": "E42"}]}]


def test_unreachable_endpoint_does_not_raise_notice() -> None:
    notice = EvictionNotice()
    watcher = ScheduledEventsWatcher(notice, "http://127.0.0.1:9/none", vm_name_url=None, interval=0.05, timeout=0.2)
    watcher.start()
    wait_for(lambda: watcher.errors >= 3, 5, "three failed polls")
    watcher.stop()
    assert not notice.is_set()


def _blocked_worker(stuck_exit_after: float, *, parked: bool = False) -> str:
    """A worker that watches SIGTERM (its before_exit prints "before exit") and then blocks
    in C, like a collective waiting for a lost peer; `parked`: at a step boundary, in a barrier."""
    return textwrap.dedent(
        f"""
        import os
        from torchspot_trainer.recovery.signals import EvictionNotice, watch_sigterm
        notice = EvictionNotice()
        watch_sigterm(notice, stuck_exit_after={stuck_exit_after}, before_exit=lambda: print("before exit", flush=True))
        notice.parked = {parked}
        read_fd, _ = os.pipe()
        print("ready", flush=True)
        os.read(read_fd, 1)
        """
    )


def _terminate_blocked(script: str, env: dict[str, str] | None = None) -> tuple[int, float, str, str]:
    """Run `script` until it is ready, SIGTERM it: (exit code, seconds to exit, stdout, stderr)."""
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        sent = time.monotonic()
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    return proc.returncode, time.monotonic() - sent, out, err


def test_sigterm_while_blocked_in_c_exits_promptly() -> None:
    code, took, out, err = _terminate_blocked(_blocked_worker(1.0))
    assert code == 143
    assert took < 10
    assert "before exit" in out
    assert "stuck in a collective" in err


def test_sigterm_after_a_peer_was_lost_exits_without_waiting_for_a_step_boundary(tmp_path: Path) -> None:
    """The agent's marker (written by the rendezvous handler) turns a 60 s stuck wait into an immediate exit."""
    marker = tmp_path / "peer-lost"
    marker.touch()
    code, took, out, err = _terminate_blocked(_blocked_worker(60.0), {**os.environ, PEER_LOST_ENV: str(marker)})
    assert code == 143
    assert took < 5  # not the 60 s stuck_exit_after
    assert "before exit" in out  # the save in flight is given its chance
    assert "(a peer was lost; last step boundary" in err


@pytest.mark.parametrize(
    ("lost", "since_boundary", "wait"),
    [(False, 5.0, 60.0), (True, 0.0, PEER_LOST_GRACE), (True, 0.5, PEER_LOST_GRACE - 0.5), (True, 3.0, 0.0)],
    ids=["no-peer-lost", "peer-lost-at-a-boundary", "peer-lost-mid-step", "stuck-since-before-the-loss"],
)
def test_stuck_wait_counts_the_grace_from_the_last_boundary(lost: bool, since_boundary: float, wait: float) -> None:
    assert stuck_wait(60.0, lost, since_boundary) == pytest.approx(wait)
    assert stuck_wait(60.0, lost, since_boundary, parked=True) == 0.0  # parked at a boundary: nothing to wait for


def test_the_agents_grace_in_the_marker_replaces_the_default(tmp_path: Path) -> None:
    """The agent writes half its liveness timeout in the marker: a worker stuck with a peer silent
    for a second waits what is left of 0.5 s, not of 2 s; an empty or unreadable marker: the default."""
    marker = tmp_path / "peer-lost"
    environ = {PEER_LOST_ENV: str(marker)}
    assert peer_lost_grace(environ) is None  # no marker
    marker.write_text("")
    assert peer_lost_grace(environ) is None  # liveness off: the worker's own PEER_LOST_GRACE
    marker.write_text("0.5")
    assert peer_lost_grace(environ) == 0.5
    assert stuck_wait(60.0, True, 0.2, grace=0.5) == pytest.approx(0.3)
    assert stuck_wait(60.0, True, 0.7, grace=0.5) == 0.0


def test_sigterm_while_parked_at_a_boundary_exits_at_once() -> None:
    """No peer-lost marker, stuck_exit_after 60 s: parked at a boundary, the worker still leaves at once."""
    code, took, out, err = _terminate_blocked(_blocked_worker(60.0, parked=True))
    assert code == 143
    assert took < 5
    assert "before exit" in out  # its snapshot is written
    assert "no step boundary 0.0 s after SIGTERM" in err


def test_peer_lost_reads_the_marker_named_by_the_environment(tmp_path: Path) -> None:
    marker = tmp_path / "peer-lost"
    assert not peer_lost({})
    assert not peer_lost({PEER_LOST_ENV: str(marker)})
    marker.touch()
    assert peer_lost({PEER_LOST_ENV: str(marker)})


def test_agent_restarting_reads_the_restart_marker_beside_the_peer_lost_one(tmp_path: Path) -> None:
    environ = {PEER_LOST_ENV: str(tmp_path / "peer-lost")}
    assert not agent_restarting({})
    assert not agent_restarting(environ)
    (tmp_path / "peer-lost").touch()
    assert not agent_restarting(environ)  # a lost peer alone does not say the agent restarts us
    (tmp_path / RESTART_MARKER).touch()
    assert agent_restarting(environ)


def test_node_leaving_reads_the_leaving_marker_beside_the_peer_lost_one(tmp_path: Path) -> None:
    environ = {PEER_LOST_ENV: str(tmp_path / "peer-lost")}
    assert not node_leaving({})
    assert not node_leaving(environ)
    (tmp_path / RESTART_MARKER).touch()
    assert not node_leaving(environ)  # a restart is not a departure
    (tmp_path / LEAVING_MARKER).touch()
    assert node_leaving(environ)


_SAID = textwrap.dedent(
    """
    import logging, sys, time
    from torchspot_trainer.recovery.signals import EvictionNotice, watch_sigterm
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    notice = EvictionNotice()
    watch_sigterm(notice, stuck_exit_after=2.0)
    print("ready", flush=True)
    while not notice.is_set():
        time.sleep(0.01)  # a training step
    notice.acknowledged.set()
    """
)
_ACKED = _SAID + textwrap.dedent(
    """
    print("checkpoint at step boundary", notice.notice.source, flush=True)
    time.sleep(3)
    print("exited cleanly", flush=True)
    """
)


@pytest.mark.parametrize(
    ("markers", "said"),
    [
        ((RESTART_MARKER,), f"INFO SIGTERM: {RESTART_DETAIL}"),
        ((RESTART_MARKER, LEAVING_MARKER), "WARNING eviction notice from SIGTERM"),  # the node goes too
        ((), "WARNING eviction notice from SIGTERM"),
    ],
    ids=["restart", "restart-while-leaving", "no-marker"],
)
def test_a_sigterm_its_agents_restart_explains_is_not_logged_as_an_eviction(
    tmp_path: Path, markers: tuple[str, ...], said: str
) -> None:
    """The restart path's survivors logged every restart as an eviction notice; the agent's markers,
    written before it signals, tell a restart (the node stays) from a departure."""
    for name in markers:
        (tmp_path / name).touch()
    env = {**os.environ, PEER_LOST_ENV: str(tmp_path / "peer-lost")}
    with subprocess.Popen([sys.executable, "-c", _SAID], stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert said in out, out
    assert ("eviction notice" in out) is (said != f"INFO SIGTERM: {RESTART_DETAIL}"), out


def test_sigterm_at_a_step_boundary_lets_the_loop_finish() -> None:
    with subprocess.Popen([sys.executable, "-c", _ACKED], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "checkpoint at step boundary SIGTERM" in out
    assert "exited cleanly" in out


_TWO_SIGTERMS = textwrap.dedent(
    """
    import logging, os, signal, threading, time
    from torchspot_trainer.recovery.signals import EvictionNotice, watch_sigterm

    class SecondSigterm(logging.Handler):
        def emit(self, record):
            if "eviction notice" in record.getMessage():
                os.kill(os.getpid(), signal.SIGTERM)  # the agent's, while the kubelet's is being logged
                end = time.monotonic() + 0.2
                while time.monotonic() < end:  # bytecodes: where a pending Python handler runs
                    pass
            print("logged", record.getMessage(), flush=True)

    logging.getLogger("torchspot_trainer").addHandler(SecondSigterm())
    notice = EvictionNotice()
    watch_sigterm(notice, stuck_exit_after=2.0)
    print("ready", flush=True)
    while not notice.is_set():
        pass  # a step in Python: the main thread holds the interpreter when the signal comes
    notice.acknowledged.set()
    print("boundary", notice.notice.source, flush=True)
    """
)


def test_a_second_sigterm_while_the_notice_is_logged_does_not_hang_the_worker() -> None:
    """Goodput run 36: the kubelet's SIGTERM and the agent's came 3 ms apart. When the Python-level
    handler raised the notice, the second ran nested inside the first's `EvictionNotice.set` and waited
    for the lock the outer call held, and the watcher waited for it too: the worker reached neither its
    boundary nor its stuck exit (hung 3 of 3 times here). Now the watcher alone raises it."""
    with subprocess.Popen([sys.executable, "-c", _TWO_SIGTERMS], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the worker hung after two SIGTERMs")
    assert proc.returncode == 0
    assert "boundary SIGTERM" in out
    assert out.count("logged eviction notice from SIGTERM") == 1
