"""A sharded rank's shards traded with a rank on another node every few commits, so that a node lost without
notice leaves its shards behind (the restart path's snapshots: reshard.py).

A rank's own snapshot holds only its shards: a node lost without notice takes its ranks' with it, no set of
snapshots is whole, and the next round goes back to the last checkpoint. With peer copies, every `every`
commits each rank packs its shards into one host buffer (reshard.shard_form, wire.pack) and trades them: it
sends them to the same local rank of the next node and receives the previous node's, on a thread of its own
over a gloo group of its own, beside training. As it stops it writes, besides its own snapshot of the live
state, its own copies of the last two trades and its source's copy of the last one it completed (`keep`).
The survivors of one node's loss then hold every shard of one of the last two trades between them.

- **Two own copies**: a loss in the middle of a trade leaves it completed on some ranks and not on others
  (the lost node's successor may hold its copy of the trade before), so each rank keeps its own copy of the
  trade before as well; the trade's set is then whole at one of the two steps (reshard.choose_set takes the
  newest whole one, the live snapshots' where no rank was lost).
- **The sends pair up**: every rank trades at the same commits, and waits for its previous trade first.
- **A trade that fails or hangs** (a partner lost) ends the trades: what was kept stays.
- **Memory**: three host buffers of a rank's shards' size (its two own copies, its source's), four during a
  trade, beside what checkpoints take. It is why peer copies are asked for (`Manager(peer_copy_every=)`).
- **Files**: beside the rank's snapshot (`traded_paths`), read by the next round's resume and removed once
  it has resumed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchspot_trainer.recovery.snapshot import Held, LocalSnapshot
from torchspot_trainer.recovery.wire import pack, unpack

__all__ = ["PeerCopies", "read_traded", "remove_traded", "traded_paths"]

log = logging.getLogger(__name__)

TRADE_WAIT_SECONDS = 60.0
"""How long a commit waits for the previous trade to complete before the trades end (a partner frozen)."""


def traded_paths(snapshot: Path) -> tuple[Path, Path, Path]:
    """Where a rank keeps its trades' copies (pure), beside its snapshot: its own of the last two trades, then
    its source's."""
    return (snapshot.with_name(f"{snapshot.stem}-own0{snapshot.suffix}"),
            snapshot.with_name(f"{snapshot.stem}-own1{snapshot.suffix}"),
            snapshot.with_name(f"{snapshot.stem}-peer{snapshot.suffix}"))  # fmt: skip


def read_traded(snapshot: Path) -> list[tuple[Held, dict[str, Any]]]:
    """The copies a rank kept of its trades, those that load."""
    read = (LocalSnapshot(path).read() for path in traded_paths(snapshot))
    return [copy for copy in read if copy is not None]


def remove_traded(snapshot: Path) -> None:
    """The copies' files gone (read by a resume, or the run over)."""
    for path in traded_paths(snapshot):
        LocalSnapshot(path).remove()


@dataclass(frozen=True)
class _Copy:
    """A copy of a rank's shards: the step and lineage it is of, its sizes and buffer (wire.pack)."""

    base: int
    step: int
    packed: tuple[torch.Tensor, torch.Tensor]

    def write(self, path: Path) -> None:
        took = LocalSnapshot(path).write({"step": self.step, **unpack(*self.packed)}, self.base)
        if took is not None:
            log.info("torchspot: a traded copy of step %d written in %.2f s", self.step, took)


class PeerCopies:
    """One rank's trades (module docstring).

    :param every: commits between trades.
    :param group: a gloo group over every rank, for the trades alone (made by every rank alike).
    :param per_node: ranks a node (the partner is `per_node` ranks on: the next node's same local rank).
    :param snapshot: this rank's snapshot file; the trades' copies go beside it (`traded_paths`).
    """

    def __init__(self, every: int, group: dist.ProcessGroup, per_node: int, snapshot: Path) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.every, self._group = every, group
        self._to, self._from = (rank + per_node) % world, (rank - per_node) % world
        self._paths = traded_paths(snapshot)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._own: deque[_Copy] = deque(maxlen=2)
        """This rank's copies of its last two trades (the newest may be in flight), newest last."""
        self._theirs: _Copy | None = None
        """The source's copy of the last trade completed."""
        self.ended = False
        """The trades ended (one failed or hung): what was kept stays."""

    def after_commit(self, step: int, base: int, state: Callable[[], dict[str, Any]]) -> None:
        """After commit `step` (of lineage `base`): the next trade begun where the schedule says so, the previous
        one waited for first. `state()` is this rank's shards as its snapshot keeps them (reshard.shard_form)."""
        if self.ended or step % self.every:
            return
        if self._thread is not None:
            self._thread.join(TRADE_WAIT_SECONDS)
            if self._thread.is_alive():
                log.warning("torchspot: a trade of the shards' copies did not complete in %.0f s: no more trades",
                            TRADE_WAIT_SECONDS)  # fmt: skip
                self.ended = True
                return
        own = _Copy(base, step, pack(state(), torch.device("cpu")))
        with self._lock:
            self._own.append(own)
        self._thread = threading.Thread(target=self._trade, args=(own,), name="torchspot-peer-copy", daemon=True)
        self._thread.start()

    def _trade(self, own: _Copy) -> None:
        """Send this rank's copy to its partner and receive its source's: the sizes, then the buffers."""
        sizes = torch.zeros(2, dtype=torch.long)
        try:
            self._exchange(own.packed[0], sizes)
            buffer = torch.empty(int(sizes[1]), dtype=torch.uint8)
            self._exchange(own.packed[1], buffer)
        except Exception as exc:  # (gloo's error where the partner or source is gone)
            log.warning("torchspot: a trade of the shards' copies failed (%s): no more trades", exc)
            self.ended = True
            return
        with self._lock:
            self._theirs = _Copy(own.base, own.step, (sizes, buffer))

    def _exchange(self, sent: torch.Tensor, received: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, sent, group=self._group, group_peer=self._to),
               dist.P2POp(dist.irecv, received, group=self._group, group_peer=self._from)]  # fmt: skip
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    def keep(self) -> None:
        """Write the copies kept (module docstring) beside the rank's snapshot (a worker that stops)."""
        with self._lock:
            owns, theirs = list(reversed(self._own)), self._theirs
        for copy, path in zip(owns, self._paths[:2], strict=False):
            copy.write(path)
        if theirs is not None:
            theirs.write(self._paths[2])
