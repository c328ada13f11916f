"""The run's state as the manager holds it: the loop's own, through its two callables, and the manager's
(the step committed, the samplers' positions), with the model's buffers and the host copy that a node's
snapshot is written from.

A heal sends `full()`, a checkpoint keeps it, and `load` takes one over whatever its origin; the step a
state came from is its lineage (`base`): a node's snapshot records it, so that a newer copy wins
(recovery/snapshot.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.data.sampler import ElasticSampler as Position
from torchspot_trainer.elastic.leaving import Kept
from torchspot_trainer.elastic.saving import Saving
from torchspot_trainer.recovery.group import Group
from torchspot_trainer.recovery.hostcopy import BoundaryBuffers, HostCopy, with_frozen
from torchspot_trainer.recovery.resume import find_state
from torchspot_trainer.recovery.snapshot import Held, choose_source

__all__ = ["RunState"]

log = logging.getLogger("torchspot.elastic")


class RunState:
    """The whole state of one worker's run (module docstring).

    :param state_dict: the loop's state (the manager adds its own beside it).
    :param load_state_dict: takes the loop's part of such a state over.
    :param device: where the model lives (the host copy's source).
    :param snapshot_every: on a GPU, steps between host copies (recovery/hostcopy.py).
    """

    def __init__(
        self,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], object],
        device: torch.device,
        *,
        snapshot_every: int,
    ) -> None:
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.step = 0
        """Steps committed by this run's lineage."""
        self.version = 0
        """The loop's changes to its state since that step (`Manager.state_changed`)."""
        self.base = 0
        """The step this worker's state last came from (a snapshot's lineage)."""
        self.positions: list[Position] = []
        self.buffers: list[torch.Tensor] = []
        """The floating-point buffers of the model under DDP (BatchNorm's statistics), rank 0's after each step."""
        self._boundary: list[torch.Tensor] = []  # every buffer (BatchNorm's counts too): `capture` freezes them
        self._host = HostCopy(device, every=snapshot_every)
        self._kept = BoundaryBuffers()
        self.form: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        """How the host copy (a snapshot's source) holds the state: a sharded one's as each rank's shards with
        their places (recovery/reshard.py's `shard_form`); None: as `full()` builds it."""

    def watch_buffers(self, buffers: list[torch.Tensor]) -> None:
        """The model's buffers: kept as they are at each commit (`capture`); the floating-point ones travel."""
        self._boundary = buffers
        self.buffers = [buffer for buffer in buffers if buffer.is_floating_point()]

    def full(self) -> dict[str, Any]:
        """The whole state now: what a heal sends and a checkpoint keeps."""
        return {
            "user": self._state_dict(),
            "torchspot": {
                "step": self.step,
                "version": self.version,
                "positions": [p.state_dict() for p in self.positions],
            },
        }

    def load(self, state: dict[str, Any]) -> None:
        """Take a whole state over; it is this worker's lineage from now on (`base`). The manager's part
        first: the loop's `load_state_dict` may read the step and the samplers' positions (a learning rate
        scheduled by the samples trained)."""
        ours = state["torchspot"]
        self.step, self.version = int(ours["step"]), int(ours.get("version", 0))
        for position, saved in zip(self.positions, ours["positions"], strict=True):
            position.load_state_dict(saved)
        self.base = self.step
        self._load_state_dict(state["user"])

    def advance(self, world: int) -> None:
        """A step committed at `world` ranks: the samplers move on, and the loop's changes count from it."""
        for position in self.positions:
            position.advance(world)
        self.step += 1
        self.version = 0

    def keep_buffers(self) -> None:
        """As a step begins: the model's buffers as they are, put back if the step is not applied (its
        forward passes moved BatchNorm's statistics: `restore_buffers`)."""
        self._kept.keep(self._boundary, self.step)

    def restore_buffers(self) -> None:
        """A step that was not applied: the model's buffers as the step found them (hostcopy.BoundaryBuffers)."""
        self._kept.restore(self._boundary, self.step)

    def at_boundary(self) -> dict[str, Any]:
        """The whole state as at the step boundary, built now: a heal's, sent beside the next step's forward
        passes, which change the model's buffers (`with_frozen`)."""
        return with_frozen(self._boundary, self.full)()

    def capture(self) -> None:
        """At a commit: the state of the step just committed, to the host (on a GPU a copy on a side stream,
        every `snapshot_every` steps; on the CPU its builder), with the model's buffers as they are now: the
        next step's forward changes them before its update."""
        if self._host.keeps(self.step):
            self._host.capture(self.step, with_frozen(self._boundary, self.kept_state))

    def keep_shards(self, form: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """A sharded state on the restart path: its snapshots keep each rank's shards (`form`), written from the
        live state, with no host copies. A ring of them (hostcopy.py, on a GPU) would hold up to three copies of
        the shards in host memory beside the checkpoint's one, where a rank keeps at most one; a device hung in
        a collective then stops the snapshot's write instead (the writer's wait ends it), and the next round
        resumes from the checkpoint."""
        self.form = form
        self._host = HostCopy(torch.device("cpu"), every=1)

    def kept_state(self) -> dict[str, Any]:
        """The whole state as a snapshot keeps it (`form`), built now."""
        state = self.full()
        return state if self.form is None else self.form(state)

    def before_update(self) -> None:
        """The optimizer is about to change the parameters: on a GPU the update waits, on the device, for the
        host copy to have read them; on the CPU no snapshot is written from the live state until the commit."""
        self._host.before_update()

    def kept(self) -> Kept:
        """What a node's snapshot would keep now: the lineage and the host copy of the last committed step."""
        return self.base, self._host.write_from

    def resume(
        self, group: Group, checkpoints: CheckpointManager | None, mine: tuple[Held, dict[str, Any]] | None
    ) -> str:
        """The restart path's resume of a replicated state, every rank alike: from the newest of the nodes'
        snapshots and the checkpoints (recovery/resume.py's `find_state`, over `group`; `mine` is this node's
        snapshot). Returns where the state came from (`snapshot`, `checkpoint`, or `start` for nothing)."""
        found, state = find_state(group, checkpoints, mine)
        if state is not None:
            self.load(state)
            log.info("torchspot: resumed from the %s of step %d", found, self.step)
        return found

    def resume_sharded(self, saving: Saving | None, mine: list[tuple[Held, dict[str, Any]]] | None = None) -> str:
        """A sharded state's resume, over torch's default group (every rank's on the restart path, the node's
        in place), each rank its shards as this group shards the model: given `mine` (the restart path: this
        rank's snapshots, recovery/reshard.py), from the newest whole set of the ranks' snapshots where it is
        not older than the newest committed checkpoint, else from that checkpoint (DCP reshards). Returns
        `snapshot`, `checkpoint`, or `start` for neither."""
        if mine is not None and self._from_snapshots(saving, mine):
            return "snapshot"
        state = None if saving is None else saving.load_sharded(self.full)
        if state is None:
            return "start"
        self.load(state)
        log.info("torchspot: resumed from the checkpoint of step %d", self.step)
        return "checkpoint"

    def _from_snapshots(self, saving: Saving | None, mine: list[tuple[Held, dict[str, Any]]]) -> bool:
        """Load the shards' snapshots where they make the state (`resume_sharded`), over the checkpoints' gloo
        group (one of the resume's own without checkpoints); whether they did."""
        from torchspot_trainer.recovery.reshard import resume_from  # noqa: PLC0415 - (DTensor's import, where used)

        if saving is not None and saving.sharded is not None:
            state = resume_from(saving.sharded_group(), mine, self.full, saving.sharded.latest_step)
        else:
            group = dist.new_group(backend="gloo")
            try:
                state = resume_from(group, mine, self.full, lambda: None)
            finally:
                dist.destroy_process_group(group)
        if state is None:
            return False
        self.load(state)
        return True

    def resume_from_copies(
        self, mine: tuple[Held, dict[str, Any]] | None, checkpoints: CheckpointManager | None
    ) -> str:
        """Before the first group in place: load the node's snapshot where it is not older than the newest
        committed checkpoint, else that checkpoint, if any. Returns where the state came from (`snapshot`,
        `checkpoint`, or `start` for nothing); the group's heal then takes the newest step any rank
        holds, a live one's before a copy's."""
        committed = checkpoints.latest_step() if mine is not None and checkpoints is not None else None
        if mine is not None and choose_source([mine[0]], committed) is not None:
            self.load(mine[1])
            found = "snapshot"
        elif (loaded := checkpoints.load_latest() if checkpoints is not None else None) is not None:
            self.load(loaded.state)
            found = "checkpoint"
        else:
            return "start"
        log.info("torchspot: resumed from the %s of step %d", found, self.step)
        return found
