"""The trainer at a step boundary and as it leaves (train.py's loop calls it at those points): eviction
notices and the emergency checkpoint, the checkpoint schedule, the operator's reports, rank 0's duties as
ranks change, the host copy and the node's snapshot, and the exit from a broken group.

- **A notice** stops the group at the boundary where it is shared (recovery/notices.py): the lowest
  rank whose node leaves writes the emergency checkpoint, from the boundary's host copy where it holds
  one, and the others hold until the node is gone.
- **Checkpoints** are rank 0's, asynchronous every `--checkpoint-every` steps, written from the host
  copy where it holds the step (no second copy of the state); the last one, synchronously, at the end.
- **A worker that leaves a broken group** keeps its node's snapshot (written from the host copy: a hung
  device cannot stop it), gives the save in flight its moment unless the snapshot is as new, aborts
  its communicator and exits, all under a deadline armed first.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from torchspot_trainer.checkpoint.manager import SAVER_PROCESS, CheckpointManager, SaveReport, step_dir
from torchspot_trainer.config import TrainConfig
from torchspot_trainer.elastic.leaving import LEAVE_SAVE_WAIT, Kept, Leaving
from torchspot_trainer.recovery.group import Group, abort_group, arm_exit_deadline
from torchspot_trainer.recovery.hostcopy import HostCopy, with_frozen
from torchspot_trainer.recovery.notices import EXIT_FAILED, NOTICE_LEAVING, leave, waits_for_save
from torchspot_trainer.recovery.snapshot import LocalSnapshot, default_path
from torchspot_trainer.rendezvous.milestones import CheckpointReporter
from torchspot_trainer.run import open_checkpoints, reopen_storage

__all__ = ["Boundary"]

log = logging.getLogger("torchspot_trainer.train")
T = TypeVar("T")


class Boundary:
    """One worker's boundaries and exit (module docstring).

    :param config: the trainer's flags.
    :param device: where the state lives (the host copy's source).
    :param emit: the trainer's record output.
    :param state: the whole state of the run now (train.py's), once there is a run.
    """

    def __init__(
        self,
        config: TrainConfig,
        device: torch.device,
        *,
        emit: Callable[..., None],
        state: Callable[[], dict[str, Any]],
    ) -> None:
        self.config = config
        self._emit, self._state = emit, state
        self.base: int | None = None
        """The step this round (or generation) resumed from, once the state is whole: a snapshot's lineage
        (recovery/snapshot.py); None before, when there is nothing of the run to keep."""
        self.host = HostCopy(device, every=config.snapshot_every)
        """The state in host memory at the last step boundary, which the snapshot and the checkpoints are
        written from (hostcopy.py): a hung device cannot stop the snapshot's write."""
        self.leaving = Leaving(
            hold=config.notice_hold, events_at=config.scheduled_events_url(), emit=emit, kept=self._kept,
            before_exit=self._before_stuck_exit,
            snapshot=LocalSnapshot(default_path(os.environ), round_started=time.time()),
            step_of=lambda state: int(state["step"]), stuck_exit_after=config.stuck_exit_after,
            vm_name=config.vm_name or None, write_wait=None,
        )  # fmt: skip
        """Eviction notices (SIGTERM; Scheduled Events, polled by one rank per node) and this node's copy of
        the state as its workers stop (snapshot.py: one file per node, by the local rank that gets there
        first)."""
        self.notice, self.stop = self.leaving.notice, self.leaving.stop
        self.checkpoints: CheckpointManager | None = None
        self._reporter: CheckpointReporter | None = None

    def open(self, rank: int) -> CheckpointManager | None:
        """Before the resume: the operator's milestones (rank 0's) and the checkpoints, if any."""
        if rank == 0:  # round, checkpoint and step milestones for the operator's status
            self._reporter = CheckpointReporter.from_environment()
        if self.config.checkpoint_uri:
            self.checkpoints = open_checkpoints(self.config, rank=rank, on_report=self._on_checkpoint)
        return self.checkpoints

    def resumed(self, step: int) -> None:
        """The state is whole, as of `step` (a resume, a re-form's heal, a receiver's state)."""
        self.base = step

    def capture(self, step: int, model: nn.Module) -> None:
        """The host copy of this boundary's state (hostcopy.py), the model's buffers (BatchNorm's
        statistics) copied now; nothing built when no copy is due."""
        if self.host.keeps(step):
            self.host.capture(step, with_frozen(list(model.buffers()), self._state))

    def after_step(self, step: int, rank: int, meta: dict[str, Any], group: Callable[[], Group]) -> None:
        """Agree on eviction notices, report the step (the operator's stall check), and checkpoint on
        schedule."""
        if self.agree_on_notices(step, meta, group()):
            return
        if self._reporter is not None:
            self._reporter.report_step(step)
        every = self.config.checkpoint_every
        checkpoints = self.checkpoints
        if checkpoints is not None and rank == 0 and every and step % every == 0:
            self._from_copy(step, lambda state: checkpoints.save_async(step, state, meta, give_up=self.notice.is_set))

    def agree_on_notices(self, step: int, meta: dict[str, Any], group: Group) -> bool:
        """NoticeStop.at_boundary with this boundary's emergency checkpoint; True after a notice."""
        checkpoints = self.checkpoints
        save = (
            None
            if checkpoints is None
            else lambda: self._from_copy(step, lambda state: checkpoints.save_sync(step, state, meta))
        )
        return self.stop.at_boundary(group, step=step, save=save)

    def _from_copy(self, step: int, save: Callable[[dict[str, Any]], T]) -> T:
        """`save(state)` with this boundary's host copy when the ring holds it (hostcopy.with_copy_of),
        else with the live state."""
        return self.host.with_copy_of(step, lambda held: save(self._state() if held is None else held))

    def ranks_changed(self, rank: int) -> None:
        """Rank 0's duties (milestones for the operator, checkpoints saved in a saver process) follow rank 0
        from generation to generation. A rank 0 whose predecessor was lost saved on a thread of its
        training process before, for the rest of the run: every later checkpoint then slowed its steps
        (saver.py says why). One that becomes another rank (torch ranks a round's nodes by address: a
        joiner's may sort first) stops its saver, which would sit idle with a buffer the size of the state."""
        config = self.config
        if self.checkpoints is not None and config.checkpoint_saver == SAVER_PROCESS:
            if rank == 0:
                self.checkpoints.save_in_child(reopen_storage(config.checkpoint_uri))
            else:
                self.checkpoints.save_on_thread()
        if rank == 0 and self._reporter is None:
            self._reporter = CheckpointReporter.from_environment()
        elif rank != 0 and self._reporter is not None:
            self._reporter.close()
            self._reporter = None

    def finish(self, step: int, rank: int, meta: dict[str, Any]) -> None:
        """The run is over: rank 0 waits for its save in flight and writes the last step's checkpoint
        unless it has it; every rank closes its checkpoints (in place, a rank 0 that a re-form made
        another rank still holds its save thread and saver process); no snapshot to carry to a next
        round."""
        checkpoints = self.checkpoints
        if checkpoints is not None:
            if rank == 0:
                checkpoints.wait()
                if checkpoints.last_committed != step:
                    checkpoints.save_sync(step, self._state(), meta)
            checkpoints.close()
        self.leaving.close()

    def leave_broken_group(self) -> NoReturn:
        """The group is broken (a collective failed or hung): keep the snapshot, give the save in flight
        its chance, abort the communicator and exit; the agents re-form the group. Under a deadline armed
        first: whatever hangs on the way, the worker is gone by then."""
        arm_exit_deadline()
        self.leaving.keep_snapshot()
        self._finish_save_in_flight()
        abort_group()
        leave(EXIT_FAILED)

    def _kept(self) -> Kept | None:
        """What the node's snapshot keeps now (elastic/leaving.py): this round's lineage and the host copy of
        the last completed step (or the last copy, with --snapshot-every), once the state is whole."""
        return None if self.base is None else (self.base, self.host.write_from)

    def _before_stuck_exit(self) -> None:
        """A worker stuck in a collective with a lost (frozen) peer is about to be ended by its SIGTERM
        watcher, its snapshot kept (`Leaving`): the save in flight's moment, then the abort."""
        self._finish_save_in_flight()
        abort_group()

    def _finish_save_in_flight(self) -> None:
        """Give the checkpoint save in flight up to LEAVE_SAVE_WAIT seconds before leaving, unless the
        node stays with a snapshot as new (notices.waits_for_save)."""
        checkpoints = self.checkpoints
        if checkpoints is None:
            return
        in_flight = checkpoints.in_flight
        kept = self.leaving.kept_step
        if not waits_for_save(in_flight, kept, leaving=self.stop.level() == NOTICE_LEAVING):
            if in_flight is not None:
                log.info("not waiting for the save of step %d: this node's snapshot holds step %s", in_flight, kept)
            return
        checkpoints.wait(LEAVE_SAVE_WAIT)
        if checkpoints.in_flight is not None:
            log.warning("leaving with the save of step %d unfinished", checkpoints.in_flight)

    def _on_checkpoint(self, report: SaveReport) -> None:
        self._emit({"event": "checkpoint", **asdict(report)})
        checkpoints = self.checkpoints
        if report.ok and self._reporter is not None and checkpoints is not None:
            self._reporter.report(report.step, f"{checkpoints.storage.describe().rstrip('/')}/{step_dir(report.step)}")

    def close(self) -> None:
        """The operator's milestones stop."""
        if self._reporter is not None:
            self._reporter.close()
