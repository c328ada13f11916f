"""Where a (re)started group takes its state from: a node's own copy, Blob, or nothing.

Resume from the newest node-local snapshot any rank holds (snapshot.py: the survivors of
a lost peer hold the last completed step), else from the newest committed checkpoint.
Rank 0 chooses and tells the others, so every rank loads the same state:

- a snapshot is sent over the process group only when some rank lacks it (a joining
  node), from the lowest rank that holds it;
- a checkpoint is read from Blob once, by rank 0, and sent to all the others (a Blob read
  per rank would fetch the same bytes once per GPU).

Both are sent as tensors (wire.py), not as pickled objects.
"""

from __future__ import annotations

from typing import Any

import torch

from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.recovery.group import Group
from torchspot_trainer.recovery.snapshot import Held, choose_source
from torchspot_trainer.recovery.wire import broadcast_state


def find_state(
    group: Group, manager: CheckpointManager | None, mine: tuple[Held, dict[str, Any]] | None
) -> tuple[str, dict[str, Any] | None]:
    """(`snapshot`, state), (`checkpoint`, state) or (`start`, None); the same on every rank.

    `mine` is this rank's node's snapshot (every local rank reads the node's one file). Sets the
    manager's last committed step from what rank 0 found, so the first save after the resume
    knows it. Without a manager (a run with no --checkpoint-uri) the nodes' snapshots are all there
    is: a group re-formed after a loss resumes from the survivors' newest, not from step 0.
    """
    held = gather_held(group, None if mine is None else mine[0])
    choice = torch.tensor([-1, -1], dtype=torch.long, device=group.device)  # [snapshot source, step]
    loaded = None
    if group.rank == 0:
        committed = manager.latest_step() if manager is not None and any(held) else None
        picked = choose_source(held, committed)
        if picked is not None:
            choice[0], choice[1] = picked[0], picked[1].step
            if manager is not None:
                manager.last_committed = committed
        else:
            loaded = None if manager is None else manager.load_latest()
            choice[1] = -1 if loaded is None else loaded.step
    group.broadcast(choice, 0)
    source, step = int(choice[0]), int(choice[1])
    if source >= 0:
        return "snapshot", _state_from(group, source, held, mine)
    if step < 0 or manager is None:
        return "start", None
    manager.last_committed = step
    state = broadcast_state(None if loaded is None else loaded.state, 0, group.rank, group.device, group.broadcast)
    return "checkpoint", state


def gather_held(group: Group, mine: Held | None) -> list[Held | None]:
    """Every rank's snapshot (base and step), by rank."""
    rows = group.gather_ints([0, 0, 0] if mine is None else [1, mine.base, mine.step])
    return [Held(base, step) if has else None for has, base, step in rows]


def _state_from(
    group: Group, source: int, held: list[Held | None], mine: tuple[Held, dict[str, Any]] | None
) -> dict[str, Any]:
    """The chosen snapshot's state: this rank's own copy when it holds the same one, else the
    source's, sent over the process group (only when some rank lacks it: a joining node;
    every rank knows from `held` whether one does)."""
    chosen = held[source]
    state = mine[1] if mine is not None and mine[0] == chosen else None
    if any(h != chosen for h in held):
        state = broadcast_state(
            state if group.rank == source else None, source, group.rank, group.device, group.broadcast
        )
    assert state is not None
    return state


def newest(rows: list[list[float]]) -> tuple[int, int]:
    """(the newest committed step, the lowest rank that holds it) from `agree` rows whose first value
    is each rank's committed step. Pure. A rank that committed a step the others did not (its
    all-reduce completed, a peer's failed) is the one the others heal from."""
    step = max(int(row[0]) for row in rows)
    return step, next(rank for rank, row in enumerate(rows) if int(row[0]) == step)
