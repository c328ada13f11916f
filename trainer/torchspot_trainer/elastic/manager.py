"""The Manager: what a training loop calls so that a membership change costs it no restart.

A step, as the wrappers (ddp.py) drive it: `start_step()` (`optimizer.zero_grad()`) passes the boundary
after the last step (its eviction notices, then its checkpoint on schedule) and begins one, in the next
group where one is due; each DDP bucket's all-reduce goes over the current group (`reduce_bucket`,
groups.py); `should_commit()` (`optimizer.step()`, before the update) allows the update only where every
all-reduce completed, and otherwise re-forms at once; `commit()` counts the step. The order, and why, are
the guide's ("A step, in order", docs/own-script.md).

In place under torchspot-run with the etcd-v3 rendezvous (its agent hands the live workers each round:
handover.py); otherwise the restart path (torch's default group and DDP; a restart resumes from the newest
checkpoint or node snapshot). The choice is said once, with its reason, where the manager made it
(`in_place=None`): a caller that chose, as the built-in trainer does from its flags, says its own. A
step that has not committed within `commit_seconds` of its start ends the worker with one line naming the
cause (its agent restarts it); a call out of the step's order raises ApiOrderError (order.py).
The worker's place in the groups (its rank there, its resume, the next group and its heal) is its
Member's (member.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # what torch.distributed re-exports

from torchspot_trainer.checkpoint.manager import CHECKPOINT_RETRIES, SAVER_THREAD
from torchspot_trainer.data.sampler import ElasticSampler as _Position
from torchspot_trainer.elastic.leaving import LEAVE_SAVE_WAIT, Kept, Leaving, node_snapshot
from torchspot_trainer.elastic.member import Member
from torchspot_trainer.elastic.metrics import served_metrics
from torchspot_trainer.elastic.order import BEGUN, StepOrder
from torchspot_trainer.elastic.records import Records
from torchspot_trainer.elastic.saving import Saving
from torchspot_trainer.elastic.settings import (
    COMMIT_SECONDS,
    EVENTS_FILE_ENV,
    ApiOrderError,
    Refused,
    checkpoint_settings,
    choose_path,
    default_device,
    notice_settings,
)
from torchspot_trainer.elastic.state import RunState
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome

if TYPE_CHECKING:  # (imported where a sharded run re-forms in place: `Manager`)
    from torch.distributed.device_mesh import DeviceMesh

    from torchspot_trainer.elastic.sharding import Columns
    from torchspot_trainer.recovery.peer_copy import PeerCopies

log = logging.getLogger("torchspot.elastic")


class Manager:
    """A training loop's recovery: groups, heals, the commit rule, checkpoints and reports (module
    docstring). One per worker process.

    :param state_dict: returns the loop's whole state (model, optimizer, scheduler...): what a heal sends
        and a checkpoint keeps. The manager adds its own (the step, the samplers' positions).
    :param load_state_dict: takes such a state (from a live peer or a checkpoint), in host memory.
    :param checkpoint_uri: `az://container/prefix` or a local folder: periodic checkpoints (asynchronous,
        atomic: a partial one is never loaded) and the resume of a restart. Empty: none. None (the
        default): TORCHSPOT_CHECKPOINT_URI, which the operator sets from the job's `spec.checkpoint`.
    :param checkpoint_every: steps between checkpoints (0: only the final one); None: TORCHSPOT_CHECKPOINT_EVERY.
    :param keep_checkpoints: committed checkpoints kept, older ones deleted; None: TORCHSPOT_KEEP_CHECKPOINTS, else 3.
    :param in_place: None re-forms in place wherever the launcher allows it (`choose_path`).
    :param device: where the gradients travel (default: this worker's GPU, else the CPU).
    :param commit_seconds: a step's limit from its start to its commit (module docstring).
    :param events_file: appends the manager's records (JSON lines) here; default TORCHSPOT_EVENTS_FILE.
    :param notice_hold: after a notice's emergency checkpoint, seconds the staying ranks wait for the
        leaving node to go; None: TORCHSPOT_NOTICE_HOLD, else 120.
    :param scheduled_events: Azure Scheduled Events: 'auto' (polled inside a Kubernetes pod), 'off' or an
        endpoint URL; None: TORCHSPOT_SCHEDULED_EVENTS, else 'auto'.
    :param snapshot_every: on a GPU, steps between the host copies a node's snapshot is written from (a
        copy on a side stream beside the next step; a snapshot then holds the last copy's step). On the
        CPU the live state is written, and no copy made.
    :param sharded: the state is sharded over the ranks (FSDP2's DTensors, over `shard_mesh()`): checkpoints
        of every rank's shards (DCP) and a restart's resume at any world size. In place, each node, or each of
        the job's replica groups of several nodes, holds one copy of the state sharded over its own workers
        (sharding.py); where the script made torch's default group itself, by the restart path (`choose_path`).
    :param checkpoint_saver: where rank 0 serialises and uploads a replicated checkpoint: 'thread' (of
        the training process) or 'process' (a child process, which holds none of the loop's GIL: its
        steps do not slow down during a save of a large state).
    :param checkpoint_retries: attempts per save before it is reported failed (training goes on).
    :param peer_copy_every: a sharded state on the restart path: commits between trades of each rank's shards
        with the same local rank of the next node (recovery/peer_copy.py; 0: none), so that a node lost without
        notice leaves its shards behind and the next round resumes from the snapshots rather than the last
        checkpoint. Each rank holds three more host buffers of its shards' size. Not used in place.
    :param progress_records: False where the loop writes its own progress records (the built-in
        trainer's carry its loss and accuracy): the manager then writes none of its own.
    """

    def __init__(
        self,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], object],
        *,
        checkpoint_uri: str | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int | None = None,
        in_place: bool | None = None,
        device: torch.device | None = None,
        commit_seconds: float = COMMIT_SECONDS,
        events_file: str | Path | None = None,
        notice_hold: float | None = None,
        scheduled_events: str | None = None,
        snapshot_every: int = 1,
        sharded: bool = False,
        checkpoint_saver: str = SAVER_THREAD,
        checkpoint_retries: int = CHECKPOINT_RETRIES,
        progress_records: bool = True,
        peer_copy_every: int = 0,
    ) -> None:
        checkpoint_uri, checkpoint_every, keep_checkpoints = checkpoint_settings(
            checkpoint_uri, checkpoint_every, keep_checkpoints, os.environ
        )
        if commit_seconds <= 0 or snapshot_every < 1:
            raise Refused(
                f"commit_seconds={commit_seconds}: must be more than 0"
                if commit_seconds <= 0
                else f"snapshot_every={snapshot_every}: must be at least 1"
            )
        if peer_copy_every < 0 or (peer_copy_every and not sharded):
            why_not = "must be 0 (none) or more" if peer_copy_every < 0 else "peer copies are of shards: sharded=True"
            raise Refused(f"peer_copy_every={peer_copy_every}: {why_not}")
        hold, events_at = notice_settings(notice_hold, scheduled_events, os.environ)
        self.in_place, why = choose_path(in_place, os.environ, sharded=sharded, own_group=dist.is_initialized())
        if in_place is None and os.environ.get("RANK", "0") == "0":  # said once per job, whatever the logging
            print(f"torchspot: {why}", file=sys.stderr, flush=True)  # (a caller that chose says its own reason)
        self.device = device or default_device()
        self._columns: Columns | None = None
        """A sharded run in place: this worker's column and its node's agreements (sharding.py)."""
        if sharded and self.in_place:
            from torchspot_trainer.elastic.sharding import Columns  # noqa: PLC0415 - (DTensor's import, where used)

            self._columns = Columns(self.device)
        self._run = RunState(state_dict, load_state_dict, self.device, snapshot_every=snapshot_every)
        self.checkpoint_every, self.commit_seconds = checkpoint_every, commit_seconds
        path = events_file or os.environ.get(EVENTS_FILE_ENV, "")
        self._records = Records(Path(path) if path else None, checkpoints=checkpoint_uri, progress=progress_records,
                                metrics=served_metrics(os.environ))  # fmt: skip
        self._saving: Saving | None = None
        if checkpoint_uri:
            self._saving = Saving(checkpoint_uri, every=checkpoint_every, keep=keep_checkpoints, sharded=sharded,
                                  on_report=lambda report: self._records.checkpoint(report, rank=self.rank),
                                  saver=checkpoint_saver, retries=checkpoint_retries,
                                  one_copy=self._columns is not None)  # fmt: skip
        self._checkpoints = None if self._saving is None else self._saving.replicated
        """The replicated state's checkpoints (rank 0's), which a resume and a heal read."""
        self.sharded = sharded
        self.checkpoint_uri = checkpoint_uri
        self._closed = self._boundary_due = False
        """`_boundary_due`: a step committed whose boundary (notices, checkpoint) the loop has not passed yet."""
        self._skipped = self._void = False
        """Whether the step being counted had its update skipped (`update_skipped`); whether the step is void
        (`start_step`)."""
        self._leaving = Leaving(
            hold=hold, events_at=events_at, emit=self._emit, kept=self._kept, before_exit=self._before_stuck_exit,
            snapshot=node_snapshot(os.environ, per_rank=sharded and not self.in_place),
            step_of=lambda state: int(state["torchspot"]["step"]),
        )  # fmt: skip
        if sharded and not self.in_place:  # each rank's snapshot holds its own shards (recovery/reshard.py)
            from torchspot_trainer.recovery.reshard import own_shards  # noqa: PLC0415 - (DTensor's import, where used)

            self._run.keep_shards(own_shards)
        self._member = Member(self._run, in_place=self.in_place, sharded=sharded, device=self.device,
                              columns=self._columns, saving=self._saving, leaving=self._leaving,
                              records=self._records, emit=self._emit, leave=self.leave)  # fmt: skip
        self._groups, self._live, self._healing = self._member.groups, self._member.live, self._member.healing
        self._notice_rows: list[list[int]] | None = None
        """Every rank's [notice level, node] at the step's end, as the last bucket brought them (in place)."""
        if self._groups is not None:  # registered at once: a round handed over during the loop's set-up is taken
            self._groups.start()
            # A node that leaves on notice tells its agent before it writes the emergency checkpoint, so that the
            # others re-form meanwhile; not where a copy spans nodes, whose checkpoint is its group's collective.
            if self._columns is None or self._columns.nodes == 1:
                self._leaving.stop.done_with_group = self._groups.done_with_group
        self._order = StepOrder(commit_seconds, self.leave, number=lambda: self._run.step + 1)
        self._peer_every = peer_copy_every
        self._peers: PeerCopies | None = None
        """The trades of a sharded state's copies, every `_peer_every` steps, once begun (`_trade_copies`)."""

    # -- what the loop reads ------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the current group."""
        return self._member.global_rank

    @property
    def world_size(self) -> int:
        """The current group's size."""
        return self._member.world_size

    @property
    def generation(self) -> int | None:
        """In place, the number of the group this worker is in (it grows at each re-form: a record's
        lineage); None on the restart path, where a group lasts as long as its processes."""
        return None if self._live is None else self._live.generation

    @property
    def state_arriving(self) -> bool:
        """Whether a heal's state is on its way to this worker: it entered a group that trains on, and takes
        the group's next step with the others, its gradients counting zero, its state loaded before that
        step's update. Until then the loop's state is not the run's: a loop that reads it to decide what it
        does next (whether an evaluation is due) takes that step first."""
        return self._healing is not None and self._healing.pending()

    @property
    def resumed_from(self) -> str:
        """Where this worker's state came from last: `checkpoint`, `snapshot` (its node's own copy), `peer`
        (healed from a live rank), `live` (in place, the state it held: a re-form sent it none) or `start`."""
        return self._member.resumed_from

    @property
    def last_checkpoint(self) -> int | None:
        """The step of the newest committed checkpoint this worker knows of (rank 0's saves, or the one it
        resumed from), if any."""
        return None if self._checkpoints is None else self._checkpoints.last_committed

    @property
    def checkpoint_error(self) -> str | None:
        """Why the newest checkpoint save failed, until one commits again (training goes on meanwhile)."""
        return None if self._checkpoints is None else self._checkpoints.last_error

    def current_step(self) -> int:
        """Steps committed so far (by this run's lineage: a heal or a resume moves it). The first call
        enters the job's first group and resumes (a joiner is healed here), so that a loop's condition
        reads the run's step, not a new process's 0: a worker that joined a run at its last step
        would otherwise train one step more."""
        if not self._member.begun and not self._closed:
            self._begin()
        return self._member.step()

    # -- the step -----------------------------------------------------------------

    def start_step(self) -> None:
        """Begin a step: enter the first group (or, after a step that did not commit, or at an agreed
        switch, the next one) and heal in it. `OptimizerWrapper.zero_grad` calls it.

        A step begun in a group whose holders of the run's state healed between steps is void: it sends
        nothing and is not applied (`should_commit` says False), and the loop decides again from the state
        it holds now, as theirs do (heal.py: they may be evaluating, and its step's all-reduce would meet
        their evaluation's collectives)."""
        self._order.check_begin()
        if self._order.phase == BEGUN and (self._groups.buckets.posted() if self._groups is not None
                                           else self._order.computed):  # fmt: skip
            log.warning("rank %d: step %d computed but not applied, nor its skip said (elastic.GradScaler says "
                        "it): counted now, as its update skipped", self.rank, self._run.step + 1)  # fmt: skip
            self.update_skipped()
        self._void = False
        if not self._member.begun:
            self._begin()
        elif self._boundary_due and self._pass_boundary():
            pass  # a notice: the group re-formed without the leaving node
        elif self._member.must_reform():
            # The switch the last step agreed on (`should_commit`), or a round that came between steps: no
            # step is started in a group that is over. Not at the commit: what the loop does between the
            # two (a figure's `all_reduce`) runs among the ranks that took the step, which a joiner is not.
            self._reform(stepping=True)
            self._void = self._healing is not None and self._healing.holders_between
            if self._columns is not None:  # (the node's workers alike: a void step sends nothing on any)
                self._void = self._columns.reform_now(self._void)
        if self._groups is not None:
            self._groups.buckets.clear()
        self._order.begin()

    def update_skipped(self) -> bool:
        """The step's gradients were computed, and its update skipped: a gradient scaler found inf or NaN
        in them and did not call `optimizer.step()`, as it does in any loop (`GradScaler` tells). The step
        still consumed its samples: it counts as taken, under the commit rule (where its collectives did
        not complete, it is taken again after the re-form, as any). A step begun with its predecessor's
        gradients computed but neither applied nor said skipped is counted so too, a line said. True where
        the step committed so (False: it did not, and the group re-formed)."""
        self.require_step("a skipped update")
        if not self.should_commit():
            return False
        self._skipped = True
        self.commit()
        return True

    def require_step(self, what: str) -> None:
        """Raise ApiOrderError unless a step has begun (`start_step`), naming `what` came too early."""
        self._order.require(what)

    def stepping(self) -> bool:
        """Whether a step has begun whose update was neither applied nor refused yet."""
        return self._order.phase == BEGUN

    def computed(self) -> None:
        """The step's model ran forward (the elastic DistributedDataParallel tells): a step whose update
        then never comes had it skipped (`update_skipped`)."""
        self._order.require("the forward pass")
        self._order.computed = True

    def reduce_bucket(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's communication hook, in place: the bucket's average over the current group, started now;
        its future completes when the all-reduce ended, however it ended (the outcome decides the commit:
        groups.py's `reduce`)."""
        self.require_step("a backward pass")
        assert self._groups is not None
        if self._void:  # (start_step) nothing is sent; zeros keep a gradient scaler's check finite
            void: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            void.set_result(bucket.buffer().zero_())
            return void
        member = self._member
        return self._groups.reduce(
            bucket, rank=member.rank, world=member.world, buffers=self._run.buffers, row=self._leaving.stop.row,
            deadline=self._order.started + self.commit_seconds,
        )  # fmt: skip

    def share(self) -> tuple[int, int]:
        """(this rank's place, the ranks that compute the step): what `ElasticSampler` deals the step's
        samples over. Every rank, except in the step after a heal beside it (heal.py): its holders."""
        if self._healing is None:
            return self.rank, self.world_size
        place, count = self._healing.share(self._member.rank, self._member.world)
        if self._columns is None:
            return place, count
        return self._columns.global_rank(place), count * self._columns.per_copy  # (a column's place is its copy's)

    def should_commit(self) -> bool:
        """Whether the step's update may be applied: every collective of the step completed (the
        commit rule). When it may not, the update is skipped and the next step re-forms first.
        `OptimizerWrapper.step` calls it before the update."""
        self.require_step("optimizer.step()")
        if not self.in_place:
            self._order.allow()
            return True
        assert self._groups is not None
        if self._void:
            self._void = False
            self._order.end()
            log.warning("rank %d: step %d not applied: begun before a heal whose holders went on between steps; "
                        "the loop decides again from the healed state", self.rank, self._run.step + 1)  # fmt: skip
            self._run.restore_buffers()
            return False
        member = self._member
        shards = None if self._columns is None else self._columns.reduce(
            self._groups, rank=member.rank, world=member.world, buffers=self._run.buffers, row=self._leaving.stop.row,
            deadline=self._order.started + self.commit_seconds,
        )  # fmt: skip
        outcomes, lines = self._groups.settle(self._run.buffers, member.world)
        if not outcomes:
            raise ApiOrderError(
                "optimizer.step() with no gradient averaged in this step: call backward() on the output of the "
                "elastic DistributedDataParallel model (or, sharded, of the model) first"
            )
        if self._columns is not None:  # the node's workers alike: their shards are one copy
            lines = self._columns.agree(member.world, lines)
        if lines is None:
            member.failed = any(outcome is Outcome.FAILED for outcome in outcomes)
            self._order.end()
            log.warning("rank %d: step %d not applied: its all-reduce did not complete (%s); re-forming",
                        self.rank, self._run.step + 1, ", ".join(sorted({o.value for o in outcomes})))  # fmt: skip
            self._run.restore_buffers()  # its forward passes' BatchNorm statistics go with it
            self._reform()  # now: the loop's condition then reads the healed step (`current_step`)
            return False
        if self._columns is not None and shards is not None:
            self._columns.take(shards)
        self._notice_rows = [[line.level, line.node] for line in lines]
        if any(line.ready for line in lines):  # a joiner is ready: every rank switches after this step
            member.reform_due = True
        self._order.allow()
        return True

    def all_reduce(self, tensor: torch.Tensor) -> bool:
        """Sum `tensor` over the current group's ranks, in place; True when it completed. For the loop's own
        figures (a loss to log, an evaluation's counts): every rank calls it at the same point of its loop,
        between steps or inside one, as with `torch.distributed.all_reduce`.

        In place, a collective that a newer round broke (a peer lost, frozen, leaving or joining) returns
        False and leaves `tensor` as it was: a figure is skipped rather than the loop stopped, and the next
        step re-forms. A host tensor goes over the generation's gloo group, a device one over its data plane.
        On the restart path it is torch's own all-reduce over the default group (a lost peer raises, and
        the agent restarts the worker)."""
        if not self._member.begun and not self._closed:
            self._begin()
        if self._groups is None:
            dist.all_reduce(tensor)
            return True
        if self._void:  # (start_step) a void step's figure is no group's
            return False
        groups = self._groups
        outcome = (
            groups.all_reduce(tensor) if self._columns is None else self._columns.all_reduce(tensor, groups.all_reduce)
        )
        member = self._member
        member.failed = member.failed or outcome is Outcome.FAILED  # the agent hears of a peer's failure at the re-form
        member.regroup = member.regroup or outcome is not Outcome.DONE
        return outcome is Outcome.DONE

    def commit(self) -> None:
        """The step's update was applied: count it, move the samplers on, tell the agent and the operator
        (its notices and its checkpoint follow at the boundary: `start_step`). `OptimizerWrapper.step`
        calls it after the update."""
        self._order.committed()
        positions = self._run.positions
        world = self.world_size
        samples = positions[0].step_chunk(world) if positions and self._records.events else None
        trained = positions[0].next_step_samples(world) if positions else 0
        self._run.advance(world)
        self._run.capture()
        if self._peers is not None:  # (at once, not at the boundary: the loop's own work after a step may be long)
            self._peers.after_commit(self._run.step, self._run.base, self._run.kept_state)
        if self._groups is not None:
            self._groups.stepped()
        generation = None if self._live is None else self._live.generation
        self._records.step(self._run.step, rank=self.rank, world=world, generation=generation, samples=samples,
                           skipped=self._skipped, trained=trained,
                           seconds=time.monotonic() - self._order.started)  # fmt: skip
        self._skipped = False
        self._boundary_due = True  # (`_pass_boundary`, once the loop is done with this step)

    def close(self, **summary: Any) -> None:
        """The loop is over: the final checkpoint is written (unless the last one is of this step: rank 0's,
        or every rank's where the state is sharded) and waited for; the manager's threads stop. `summary`:
        the loop's own figures, added to the `done` record (a final test accuracy)."""
        if self._closed:
            return
        if self._member.reform_due:  # the last step agreed on a switch: its joiners wait in that group for their heal
            self._reform()
        if self._healing is not None:
            self._healing.settle()  # a heal's state for a step the loop did not take: the run's state
        self._closed = True
        self._order.close()
        if self._saving is not None and self._member.begun:
            self._saving.finish(self._run.step, self._member.rank, self._run.full, self.world_size)
        if self._groups is not None:
            self._groups.close()
        self._records.close()
        self._leaving.close()
        self._emit({"event": "done", "step": self._run.step, "world_size": self.world_size, **summary})

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- groups -------------------------------------------------------------------

    def ensure_group(self) -> None:
        """torch's default process group, made now if the script has not: on the restart path over every rank
        (DDP and FSDP2 need it); for a sharded run in place over this node's workers only (sharding.py)."""
        self._member.ensure_group()

    def shard_mesh(self, shard_size: int = 0) -> DeviceMesh:
        """The device mesh a sharded model is given to FSDP2's `fully_shard` over (`ensure_group` first). In
        place: this node's workers, each node one copy of the state (sharding.py), whatever `shard_size`. On
        the restart path: replica groups of `shard_size` ranks (HSDP) where the world makes two or more,
        else every rank (FSDP: `sharding.restart_mesh`)."""
        from torchspot_trainer.elastic.sharding import restart_mesh  # noqa: PLC0415 - (DTensor's import, where used)

        if self._columns is not None:
            return self._columns.mesh()
        self.ensure_group()
        return restart_mesh(self.device, shard_size)

    def scales_loss(self) -> None:
        """A gradient scaler runs with this manager (`GradScaler` tells): every heal broadcasts."""
        self._member.scaled = True

    def _begin(self) -> None:
        """The first step: resume and enter the first group (member.py)."""
        self._member.begin()
        if self.sharded and not self.in_place:
            self._trade_copies()

    def _trade_copies(self) -> None:
        """A sharded state on the restart path, resumed: the last round's traded copies go (read by the resume),
        and this round's trades begin where they are asked for and another node is there to trade with
        (recovery/peer_copy.py). Every rank alike (a group of the trades' own is made)."""
        from torchspot_trainer.recovery.peer_copy import PeerCopies, remove_traded  # noqa: PLC0415 - (where used)

        snapshot = self._leaving.snapshot
        if snapshot is None:
            return
        remove_traded(snapshot.path)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if self._peer_every and dist.get_world_size() > per_node:
            self._peers = PeerCopies(self._peer_every, dist.new_group(backend="gloo"), per_node, snapshot.path)
            self._leaving.also_keep.append(self._peers.keep)

    def _reform(self, *, stepping: bool = False) -> None:
        """The next group and a heal in it (member.py); the old group's boundary and notices are void."""
        self._boundary_due = False
        self._notice_rows = None  # (the old group's; a notice is shared again at the next group's boundary)
        self._member.reform(stepping=stepping)

    # -- notices --------------------------------------------------------------------

    def heed_notices(self) -> bool:
        """Between steps, where the loop does long work of its own (an evaluation): the eviction notices
        shared as at a step's end, every rank at the same point of its loop, so that a notice that comes
        meanwhile has its emergency checkpoint (of the last committed step) at once rather than after the
        work; on one the group stops as after a step. In place, where the group changed first (a switch
        agreed at the last step, a newer round, a collective of the loop's that did not complete), the
        worker enters the next group and heals there. True where the group changed: the loop's work begun
        in the old one is void (its rank and world size may differ now), and it begins it again from its
        state, which the heal may have replaced (`state_changed`). One small all-gather."""
        self._order.require_between("heed_notices()")
        if not self._member.begun and not self._closed:
            self._begin()
        if self._boundary_due and self._pass_boundary():
            return True
        if self._member.must_reform():
            self._reform()
            return True
        return self._notices_stop_here(gather=True)

    def state_changed(self) -> None:
        """The loop changed its state between steps (an evaluation's result it keeps in `state_dict`): a
        heal counts this state newer than the same step's without the change, so that every rank goes on
        from it. Call it at the same point of the loop on every rank, once the work's last collective
        completed."""
        self._run.version += 1

    def _pass_boundary(self) -> bool:
        """The boundary after the last committed step, as the loop goes on from it (the next step, or its
        own work between steps: whatever it did with that step first, a progress record written before a
        notice may end the worker): the notices, then the checkpoint schedule. True where a notice
        re-formed the group (in place) rather than training on; no checkpoint is begun then (the notice's
        emergency checkpoint holds that step)."""
        self._boundary_due = False
        if self._notices_stop_here(gather=self._live is None):
            return True
        if self._saving is not None:
            self._saving.after_commit(self._run.step, self._member.rank, self._run.full, self.world_size)
        return False

    def _notices_stop_here(self, *, gather: bool) -> bool:
        """Share every rank's [notice level, node] (`gather`: one all-gather now; else, in place, as the step's
        last bucket brought them) and, on any notice, stop the group here (`Leaving.stop_for`). True where
        the group changed meanwhile (in place: the round without the leaving node, or any newer, came) and
        the worker entered the next one, rather than training on."""
        self._leaving.at_boundary()
        rows, self._notice_rows = self._notice_rows or [], None
        try:
            if gather:
                rows = self._gather_notices()
            if any(level for level, _node in rows):  # (every boundary but a notice's: nothing more to do)
                member = self._member
                self._leaving.stop_for(rows, step=self._run.step, rank=member.rank, group=member.collectives(),
                                       saving=self._saving, state=self._run.full, world=self.world_size)  # fmt: skip
        except GroupChanged as exc:
            self._member.failed = exc.failed
            self._reform()
            return True
        return False

    def _gather_notices(self) -> list[list[int]]:
        """Every rank's [notice level, node], gathered now; GroupChanged in place where the group broke. A
        sharded run's columns gather each over their own, and the node's workers then agree on them
        (`Columns.agree_notices`), so that they stop, or re-form, together."""
        outcome = Outcome.DONE
        try:
            rows = self._member.collectives().boundary(self._run.step, self._leaving.stop.row)
        except GroupChanged as exc:
            if self._columns is None:
                raise
            rows, outcome = [], Outcome.FAILED if exc.failed else Outcome.BROKEN
        except RuntimeError as exc:  # the restart path: a peer's socket closed, it left
            self.leave(f"the notices' agreement after step {self._run.step} failed ({exc})")
        if self._columns is None:
            return rows
        agreed = self._columns.agree_notices(self._member.world, rows if outcome is Outcome.DONE else None)
        if agreed is None:
            raise GroupChanged(Outcome.BROKEN if outcome is Outcome.DONE else outcome)
        return agreed

    def _before_stuck_exit(self) -> None:
        """A worker that leaves (stuck in a collective after its SIGTERM, or by `leave`), its snapshot kept:
        its save in flight, if any, gets a moment."""
        if self._saving is not None:
            self._saving.give_a_moment(LEAVE_SAVE_WAIT)

    def leave(self, why: str) -> NoReturn:
        """Leave the run by the restart path now: one line with the cause, this node's snapshot kept, a save
        in flight given a moment, then exit with the code for which the agent restarts the worker. For a
        loop that finds its worker cannot go on (a collective of its own that raised, a broken device);
        the manager calls it where a step cannot commit."""
        self._leaving.leave(f"rank {self.rank}: {why}")

    def _kept(self) -> Kept | None:
        """What the node's snapshot would keep now (`Leaving`): its lineage and the host copy of the last
        committed step (hostcopy.py: on the CPU the live state, but during an update), once the first
        group's resume is done and not after `close()` (the final checkpoint holds it). A sharded run keeps none
        in place (its workers are healed from a live copy), nor before its first step: there is nothing to keep,
        and torch's `get_state_dict` would count a step in a fresh optimizer's state."""
        if not self._member.whole or self._closed or (self.sharded and (self.in_place or self._run.step == 0)):
            return None
        return self._run.kept()

    def before_update(self) -> None:
        """The optimizer is about to change the parameters (`OptimizerWrapper.step`): on a GPU the update
        waits, on the device, for the host copy to have read them; on the CPU no snapshot is written from
        the live state until the commit. A sharded checkpoint in flight has its copy of the state first."""
        self._run.before_update()
        if self._saving is not None:
            self._saving.before_update()

    # -- state ----------------------------------------------------------------------

    def add_position(self, position: _Position) -> None:
        """A sampler's position, moved on at each commit and carried in the state (sampler.py)."""
        if self._member.begun:
            raise ApiOrderError("an ElasticSampler made after the first step: make it before the loop begins")
        self._run.positions.append(position)

    def watch_shards(self, parameters: list[torch.Tensor]) -> None:
        """The optimizer's parameters (`OptimizerWrapper`): in place, a sharded run's gradients are theirs."""
        if self._columns is not None:
            self._columns.parameters = parameters

    def watch_model(self, module: torch.nn.Module) -> None:
        """The model under DDP (ddp.py): its buffers kept as they are at each commit for the node's snapshot;
        in place its floating-point ones are taken from rank 0 at each step (riders.py), and a generation's
        first step sends its gradients in its parameters' order (buckets.py)."""
        self._run.watch_buffers(list(module.buffers()))
        if self._groups is not None:
            self._groups.buckets.order(list(module.parameters()))

    # -- output ---------------------------------------------------------------------

    def _emit(self, record: dict[str, Any], *, any_rank: bool = False) -> None:
        """One record (records.py): rank 0's on stdout, or any rank's with `any_rank`."""
        self._records.emit(record, rank=self.rank, any_rank=any_rank)
