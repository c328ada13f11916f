"""The training state on the node's own disk, written as a worker stops, to resume the next round from.

Every rank of a DDP job holds the whole model and optimizer state. When a peer is lost
without notice (a hard eviction, a frozen node), the survivors' collective fails in the
middle of a step, their state still at the last completed step; torchrun then restarts
them, and the new round would go back to the last Blob checkpoint: up to
`checkpoint_every` steps earlier, read back from Blob by every rank. Instead, each node
writes its state here as its workers stop (a local `torch.save`, a fraction of a second,
from the host copy of hostcopy.py, so a hung device cannot stop it), and the next round
resumes from the newest such copy that any surviving node holds, sent to the ranks that
have none (a joining node) over the process group.

One copy per node, written by whichever of its local ranks gets there first: the ranks of
a node hold the same state, and all of them may be stopping (or one may be dead). A write
takes the file's lock; a rank that then finds the file written since its round began
leaves it as it is. Every local rank of the next round reads the same file.

Which copy wins (`choose_source`): a copy records the step its round started from
(`base`) besides its own step, and the newest base wins before the newest step, so a
node that was cut off from its group and comes back cannot pull the run back onto its
stale line. A copy older than the newest committed Blob checkpoint is not used. A copy
that does not load is reported as absent, so nothing waits for it.

Where: `$TORCHSPOT_SNAPSHOT_DIR` or the system's temporary folder, one file per node
agent (its process id, stable across its workers' restarts, and the parent of every local
rank) and run id; a new pod starts with none. The file goes when the run finishes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchspot_trainer import RUN_ID_ENV, SNAPSHOT_DIR_ENV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """What one rank's snapshot holds: the step its round resumed from, and its own step."""

    base: int
    step: int


def choose_source(held: list[Held | None], committed: int | None) -> tuple[int, Held] | None:
    """The rank whose snapshot the group resumes from, and what it holds; None: resume from Blob.

    `held[r]` is rank r's snapshot (None: it has none); `committed` is the newest committed
    Blob checkpoint's step. The newest base wins, then the newest step, then the lowest rank;
    it must not be older than `committed`.
    """
    candidates = [(h.base, h.step, -rank) for rank, h in enumerate(held) if h is not None]
    if not candidates:
        return None
    base, step, negative_rank = max(candidates)
    if committed is not None and step < committed:
        return None
    return -negative_rank, Held(base, step)


def snapshot_path(folder: Path, run_id: str, agent_pid: int) -> Path:
    """One file per node agent and run (a job's nodes may share a machine in the lab)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id) or "run"
    return folder / f"torchspot-{safe}-{agent_pid}.pt"


def default_path(environ: dict[str, str] | os._Environ[str]) -> Path:
    """This node's snapshot file, from torchrun's environment (the agent is every worker's parent)."""
    folder = Path(environ.get(SNAPSHOT_DIR_ENV) or tempfile.gettempdir())
    return snapshot_path(folder, environ.get(RUN_ID_ENV, "run"), os.getppid())


class LocalSnapshot:
    """Write and read a node's snapshot file; a failure is logged and reported, never raised.

    :param round_started: when this worker's round began (`time.time()`): a file written since
        was written by another local rank of this round, and is not written again.
    """

    def __init__(self, path: Path, round_started: float = 0.0) -> None:
        self.path = path
        self.round_started = round_started

    def write(self, state: dict[str, Any], base: int) -> float | None:
        """Save `state` (its "step" is the snapshot's step) unless another local rank of this round
        has; the seconds it took, None when not written (a failure, or written already)."""
        started = time.perf_counter()
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its holder dies
                if self.path.exists() and self.path.stat().st_mtime >= self.round_started:
                    log.info("the node's snapshot was written by another local rank of this round")
                    return None
                torch.save({"base": base, "step": int(state["step"]), "state": state}, partial)
                os.replace(partial, self.path)  # a reader sees the whole file or the previous one
        except (OSError, RuntimeError) as exc:  # torch reports a full disk as a RuntimeError
            log.warning("no local snapshot (%s): the next round resumes from the last checkpoint", exc)
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            return None
        return time.perf_counter() - started

    def written_this_round(self) -> bool:
        """Whether this round's snapshot is on disk (by this rank or another local rank of the round,
        each stopped at the same boundary)."""
        try:
            return self.path.stat().st_mtime >= self.round_started
        except OSError:
            return False

    def read(self) -> tuple[Held, dict[str, Any]] | None:
        """The snapshot and its state, or None when there is none or it does not load."""
        if not self.path.exists():
            return None
        try:
            loaded = torch.load(self.path, map_location="cpu", weights_only=True)
            held = Held(int(loaded["base"]), int(loaded["step"]))
            state: dict[str, Any] = loaded["state"]
        except Exception as exc:  # corrupt or foreign: skipped, never half-loaded
            log.warning("skipping local snapshot %s: %s", self.path, exc)
            return None
        return held, state

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self.path.with_name(self.path.name + ".lock").unlink(missing_ok=True)
