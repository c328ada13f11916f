"""Files through which a node's agent tells its workers why they stop: the one contract between the
agent side (launch.py, rendezvous/) and the worker side, which import nothing else of each other.

The agent writes them; a worker reads them at a step boundary or as its SIGTERM arrives, which is
how it tells a node that leaves (emergency checkpoint) from a group that re-forms (its snapshot
is enough) and from a lost peer (no boundary will come). Files, not signals: a worker blocked in
a collective cannot run a handler, and a file written before the agent acts is there whenever the
worker looks. One signal belongs to the contract as well (`STACKS_SIGNAL`): a request for stacks,
which changes nothing in the worker.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Mapping
from pathlib import Path

PEER_LOST_ENV = "TORCHSPOT_PEER_LOST_FILE"
"""Environment variable naming the file whose existence means: this node's agent stops its
workers because a peer is lost. The launcher sets it before any worker starts; workers inherit it."""

STACKS_SIGNAL = signal.SIGUSR1
"""One signal as well: it asks a worker for every thread's stack on its stderr. faulthandler's C-level
handler (registered by recovery/signals.py's `watch_sigterm`) needs neither the GIL nor a lock, so a
worker stuck on either still answers. An agent sends it to its registered workers still there
`STACKS_AFTER_NOTICE` seconds after its own SIGTERM (launch.py): a hung worker that is killed says
nothing of where it stopped otherwise."""


RESTART_MARKER = "restart"
"""File beside the peer-lost marker whose existence means: this node's agent is stopping its
workers to re-form the group (a node joins, or a peer is lost); the node itself stays."""


LEAVING_MARKER = "leaving"
"""File beside the peer-lost marker whose existence means: this node's agent was told to stop (its
pod is deleted) and takes the node out of the rendezvous. The agent writes it before the other
nodes can see the node gone, so its workers know at their next step boundary that their node
leaves and one of them writes the emergency checkpoint, even when the agent's SIGTERM reaches
them only after the other nodes' agents have restarted their workers (a CI run lost the emergency
checkpoint to that race)."""


def marker_beside(peer_lost_marker: str, name: str) -> str:
    """The path of marker `name` (RESTART_MARKER, LEAVING_MARKER): beside the peer-lost marker,
    so one environment variable names them all."""
    return os.path.join(os.path.dirname(peer_lost_marker), name)


def _agent_marked(name: str, environ: Mapping[str, str]) -> bool:
    path = environ.get(PEER_LOST_ENV, "")
    return path != "" and os.path.exists(marker_beside(path, name))


def agent_restarting(environ: Mapping[str, str] = os.environ) -> bool:
    """True when this node's agent has marked that it restarts its workers for a new round.

    A SIGTERM then is not the node's eviction: the worker's own snapshot carries its state to
    the next round, and no emergency checkpoint to Blob is needed (a node that is really
    leaving gets its SIGTERM without this marker, and then the checkpoint is written).
    """
    return _agent_marked(RESTART_MARKER, environ)


def node_leaving(environ: Mapping[str, str] = os.environ) -> bool:
    """True when this node's agent has marked that the node leaves (LEAVING_MARKER), whether or
    not its SIGTERM has reached this worker yet."""
    return _agent_marked(LEAVING_MARKER, environ)


def peer_lost(environ: Mapping[str, str] = os.environ) -> bool:
    """True when this node's agent has marked the current round as having lost a peer."""
    path = environ.get(PEER_LOST_ENV, "")
    return path != "" and os.path.exists(path)


def peer_lost_grace(environ: Mapping[str, str] = os.environ) -> float | None:
    """The seconds after its last step boundary a worker told of a lost peer still waits, as the
    agent wrote them in the marker (half its liveness timeout, for a peer that fell silent: it is
    not merely slow); None without a marker or a number in it (the worker's own default then)."""
    path = environ.get(PEER_LOST_ENV, "")
    try:
        return float(Path(path).read_text().strip()) if path else None
    except (OSError, ValueError):
        return None


_MARKER_NAMED: list[str] = []
"""The marker this process chose (name_peer_lost_marker), once chosen."""


def name_peer_lost_marker() -> None:
    """Choose this agent's peer-lost marker file (rendezvous/handler.py's module docstring, point 1),
    once per process.

    Workers learn its name from the environment, so it must be set before the first one
    (or the fork server they come from) starts. A name inherited from a parent process is
    replaced: it is the parent's (agents started by one test process shared one, and one
    agent's restart marker made another's leaving worker skip its emergency checkpoint).
    """
    if not _MARKER_NAMED:
        _MARKER_NAMED.append(str(Path(tempfile.mkdtemp(prefix="torchspot-agent-")) / "peer-lost"))
    os.environ[PEER_LOST_ENV] = _MARKER_NAMED[0]


def mark_leaving() -> None:
    """Say to this agent's workers that their node leaves (LEAVING_MARKER), without leaving the
    rendezvous yet: workers that re-form in place (handover.py) agree on the notice with their peers
    at their next step boundary, which needs the peers' group to stand. Left once they have (the
    launcher's `leave_once_agreed`: their emergency checkpoint needs no collective), or stopped."""
    agent_marker(LEAVING_MARKER).touch()


def agent_marker(name: str) -> Path:
    """This agent's marker `name` (RESTART_MARKER, LEAVING_MARKER): beside the peer-lost marker it named."""
    return Path(marker_beside(os.environ[PEER_LOST_ENV], name))
