"""A manager's checkpoints, of one of two kinds, behind one set of calls.

- **Replicated** (the default: DDP, where every rank holds the whole state): rank 0 alone saves, one
  `torch.save` serialised and uploaded beside training (checkpoint/manager.py), and any rank may load
  the whole state back.
- **Sharded** (`sharded=True`: FSDP2, where each rank holds its own shards): every rank saves its shards
  through DCP at the same step, beside training (checkpoint/sharded.py), and a resume at any world size
  loads the newest committed checkpoint as that world shards the state. Its emergency checkpoint at a
  notice and its node snapshots are not built yet: a notice still stops the group at a step boundary, and
  the resume takes the last periodic checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchspot_trainer.checkpoint.manager import CheckpointConfig, CheckpointManager, SaveReport
from torchspot_trainer.checkpoint.storage import open_storage

if TYPE_CHECKING:  # (imported where a sharded state needs it: `Saving`)
    from torchspot_trainer.checkpoint.sharded import ShardedCheckpoints

__all__ = ["Saving"]


class Saving:
    """The checkpoints of one manager (module docstring).

    :param uri: `az://container/prefix` or a local folder.
    :param every: steps between checkpoints (0: only the final one).
    :param keep: committed checkpoints kept.
    :param sharded: each rank saves its own shards (module docstring).
    :param on_report: told each save's outcome.
    """

    def __init__(
        self, uri: str, *, every: int, keep: int, sharded: bool, on_report: Callable[[SaveReport], None]
    ) -> None:
        self.uri, self.every = uri, every
        self.replicated: CheckpointManager | None = None
        self.sharded: ShardedCheckpoints | None = None
        if sharded:  # torch's distributed checkpoint takes about a second to import: only where it is used
            from torchspot_trainer.checkpoint.sharded import ShardedCheckpoints  # noqa: PLC0415

            self.sharded = ShardedCheckpoints(uri, keep=keep, on_report=on_report)
        else:
            self.replicated = CheckpointManager(open_storage(uri), CheckpointConfig(keep=keep), on_report=on_report)

    def _writes(self, rank: int) -> bool:
        """Whether `rank` saves: rank 0 of a replicated state, every rank of a sharded one."""
        return self.sharded is not None or rank == 0

    def after_commit(self, step: int, rank: int, state: Callable[[], dict[str, Any]], world: int) -> None:
        """After `step` committed: its checkpoint begun where the schedule says so."""
        if not (self.every and step % self.every == 0 and self._writes(rank)):
            return
        if self.sharded is not None:
            self.sharded.save_async(step, state())
        elif self.replicated is not None:
            self.replicated.save_async(step, state(), {"world_size": world})

    def before_update(self) -> None:
        """The state is about to change: a sharded save in flight has its copy first."""
        if self.sharded is not None:
            self.sharded.staged()

    def finish(self, step: int, rank: int, state: Callable[[], dict[str, Any]], world: int) -> None:
        """The loop is over: the final checkpoint (unless the last one is of `step`), waited for."""
        if not self._writes(rank):
            return
        if self.sharded is not None:
            self.sharded.wait()
            if self.sharded.last_committed != step:
                self.sharded.save_sync(step, state())
            self.sharded.close()
        elif self.replicated is not None:
            self.replicated.wait()
            if self.replicated.last_committed != step:
                self.replicated.save_sync(step, state(), {"world_size": world})
            self.replicated.close()

    def load_sharded(self, state: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """A sharded resume, once the default group is formed: the newest committed checkpoint's state,
        loaded into the one `state()` builds (every rank; ShardedCheckpoints.load_latest), if any. From
        here on DCP coordinates over a gloo group of its own: an asynchronous save's collectives run on
        DCP's thread, and on the loop's group they could interleave with the loop's own in a different
        order on different ranks."""
        assert self.sharded is not None
        self.sharded.use_group(dist.new_group(backend="gloo"))
        found = self.sharded.load_latest(state)
        return None if found is None else found[1]

    def emergency(self, step: int, state: dict[str, Any], world: int) -> SaveReport:
        """The notice's checkpoint of `step`, written now by the rank that saves it (replicated only)."""
        assert self.replicated is not None
        return self.replicated.save_sync(step, state, {"world_size": world})

    def give_a_moment(self, seconds: float) -> None:
        """A worker about to exit: its save in flight, if any, gets `seconds`."""
        if self.replicated is not None and self.replicated.in_flight is not None:
            self.replicated.wait(seconds)
        elif self.sharded is not None and self.sharded.in_flight is not None:
            self.sharded.wait(seconds)
