"""A manager's checkpoints, of one of two kinds, behind one set of calls.

- **Replicated** (the default: DDP, where every rank holds the whole state): rank 0 alone saves, one
  `torch.save` serialised and uploaded beside training (checkpoint/manager.py), and any rank may load
  the whole state back.
- **Sharded** (`sharded=True`: FSDP2, where each rank holds its own shards): every rank saves its shards
  through DCP at the same step, beside training (checkpoint/sharded.py), and a resume at any world size
  loads the newest committed checkpoint as that world shards the state. At a notice every rank writes
  its shards of the emergency checkpoint at once, where the shared rows hold a node that leaves (a
  collective needs every rank's same answer: a node that learns it leaves only after sharing its level is
  not saved for, and the resume takes the last periodic checkpoint). Where no node leaves (the agents'
  restart of the workers for a node that joins), each rank's snapshot of its shards carries the step to
  the next round (recovery/reshard.py), as a replicated state's node snapshots do.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchspot_trainer.checkpoint.manager import (
    CHECKPOINT_RETRIES,
    SAVER_PROCESS,
    SAVER_THREAD,
    CheckpointConfig,
    CheckpointManager,
    SaveReport,
)
from torchspot_trainer.checkpoint.storage import open_storage
from torchspot_trainer.recovery.notices import emergency_saver, node_levels, saves_emergency

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
    :param saver: where rank 0 writes a replicated checkpoint: SAVER_THREAD, or SAVER_PROCESS (a child
        process, which follows rank 0 from group to group: `ranks_changed`).
    :param retries: attempts per save of a replicated checkpoint before it is reported failed.
    :param one_copy: a sharded state in place, where each node (or replica group of nodes) holds a whole
        copy, sharded over its own workers (sharding.py): one copy's workers, those of rank 0 in their columns,
        write each checkpoint (DCP over the copy's group), and at a notice the copy the replicated rule picks.
    """

    def __init__(
        self,
        uri: str,
        *,
        every: int,
        keep: int,
        sharded: bool,
        on_report: Callable[[SaveReport], None],
        saver: str = SAVER_THREAD,
        retries: int = CHECKPOINT_RETRIES,
        one_copy: bool = False,
    ) -> None:
        if saver not in (SAVER_THREAD, SAVER_PROCESS):
            raise ValueError(f"checkpoint_saver={saver!r}: choose {SAVER_THREAD!r} or {SAVER_PROCESS!r}")
        self.every = every
        self.one_copy = one_copy
        self._reopen = partial(open_storage, uri, retries=1, timeout=5.0) if saver == SAVER_PROCESS else None
        """How a saver process opens the storage (picklable), where rank 0 saves in one."""
        self._group: dist.ProcessGroup | None = None
        """A sharded state's checkpoints' own gloo group (`load_sharded`), destroyed at `finish`."""
        self.replicated: CheckpointManager | None = None
        self.sharded: ShardedCheckpoints | None = None
        if sharded:  # torch's distributed checkpoint takes about a second to import: only where it is used
            from torchspot_trainer.checkpoint.sharded import ShardedCheckpoints  # noqa: PLC0415

            self.sharded = ShardedCheckpoints(uri, keep=keep, on_report=on_report)
        else:
            self.replicated = CheckpointManager(
                open_storage(uri), CheckpointConfig(keep=keep, retries=retries), on_report=on_report
            )

    def ranks_changed(self, rank: int) -> None:
        """The saver process follows rank 0 from group to group: a new rank 0 starts one at its next save (it
        saved on a thread until then: every save would slow its steps), and a rank 0 that became another
        rank stops its own, which would sit idle with a buffer the size of the state."""
        if self.replicated is None or self._reopen is None:
            return
        if rank == 0:
            self.replicated.save_in_child(self._reopen)
        else:
            self.replicated.save_on_thread()

    def _writes(self, rank: int) -> bool:
        """Whether `rank` saves: rank 0 of a replicated state, every rank of a sharded one (in place, each
        column's rank 0: one copy's workers)."""
        return (self.sharded is not None and not self.one_copy) or rank == 0

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
            if self._group is not None:  # every rank's last save done: nothing of DCP's is in flight on it
                dist.destroy_process_group(self._group)
                self._group = None
        elif self.replicated is not None:
            self.replicated.wait()
            if self.replicated.last_committed != step:
                self.replicated.save_sync(step, state(), {"world_size": world})
            self.replicated.close()

    def sharded_group(self) -> dist.ProcessGroup:
        """The gloo group a sharded state's checkpoints coordinate over, made at the first call (every rank, once
        the default group is formed): an asynchronous save's collectives run on DCP's thread, and on the loop's
        group they could interleave with the loop's own in a different order on different ranks. The resume
        from the shards' snapshots trades over it too (CPU tensors)."""
        assert self.sharded is not None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
            self.sharded.use_group(self._group)
        return self._group

    def load_sharded(self, state: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """A sharded resume: the newest committed checkpoint's state, loaded into the one `state()` builds (every
        rank; ShardedCheckpoints.load_latest), if any."""
        assert self.sharded is not None
        self.sharded_group()
        found = self.sharded.load_latest(state)
        return None if found is None else found[1]

    def saves_emergency(self, rank: int, rows: list[list[int]], *, leaving_now: bool) -> bool:
        """Whether `rank` writes (its part of) the emergency checkpoint at a notice's boundary, from the
        ranks' shared [level, node] rows: one rank of a replicated state (notices.saves_emergency), every
        rank of a sharded one where a node leaves (module docstring)."""
        if self.sharded is not None and self.one_copy:  # (a rank a copy: its workers all alike, no late learner)
            return rank == emergency_saver(node_levels(rows))
        if self.sharded is not None:
            return emergency_saver(node_levels(rows)) is not None
        return saves_emergency(rank, rows, leaving_now=leaving_now)

    def emergency(self, step: int, state: dict[str, Any], world: int) -> SaveReport:
        """The notice's checkpoint of `step`, written now: by the rank that saves it, or every rank's shards."""
        if self.sharded is not None:
            return self.sharded.save_sync(step, state)
        assert self.replicated is not None
        return self.replicated.save_sync(step, state, {"world_size": world})

    def give_a_moment(self, seconds: float) -> None:
        """A worker about to exit: its save in flight, if any, gets `seconds`."""
        if self.replicated is not None and self.replicated.in_flight is not None:
            self.replicated.wait(seconds)
        elif self.sharded is not None and self.sharded.in_flight is not None:
            self.sharded.wait(seconds)
