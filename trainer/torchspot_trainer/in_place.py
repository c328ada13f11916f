"""The trainer's in-place path (`--in-place`): one object the training loop calls at a few points, so that
the loop never names a round, a generation or a heal.

The agent hands its live workers each new round (handover.py); every collective of the loop runs over the
current generation (recovery/live.py) and raises GroupChanged when a newer round breaks it or a peer's
socket closes. The loop then calls `InPlace.reform`: enter the next round, and heal in it, every rank going
on from the newest state any of them holds; the loop plans its epoch again for the new world from the
sampler, which never counted the interrupted step.

The loop's calls, in a step's order:

- `keep_boundary` before the step's forward passes (the model's buffers, put back if the step breaks);
- `arm_buckets` before the last backward pass (the gradient buckets go out as they fill);
- `before_update` after it: the gradients averaged (a failed average raises GroupChanged before anything
  of the step is applied), a progress record's sums riding with them;
- `stepped` after the update (the agent learns that every member was alive at this step);
- `reform` where the step raised GroupChanged, and `receive` where a heal's receiver sits a step out.

The state comes and goes through the loop's `state` and `load` callables; the heal's rules are pure
functions of the ranks' rows (recovery/resume.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, NoReturn

import torch
from torch import nn

from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.elastic.settings import REFORM_SECONDS, node_name
from torchspot_trainer.handover import Assignment, Handover
from torchspot_trainer.recovery.collectives import LiveCollectives
from torchspot_trainer.recovery.hostcopy import BoundaryBuffers, with_frozen
from torchspot_trainer.recovery.live import in_place_groups, wait_for_assignment
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome
from torchspot_trainer.recovery.resume import (
    HealRow,
    evaluation_source,
    find_state,
    go_ahead_refuted,
    heal_source,
    kept_ranks,
    record_writer,
    trainers_of_next_step,
)
from torchspot_trainer.recovery.snapshot import Held
from torchspot_trainer.recovery.transfer import StateArrival, send_beside
from torchspot_trainer.recovery.wire import broadcast_state
from torchspot_trainer.run import Run

__all__ = ["InPlace", "Mine"]

log = logging.getLogger(__name__)

Mine = tuple[Held, dict[str, Any]] | None
"""A new rank's node snapshot and its state (recovery/snapshot.py), if it has one."""


class InPlace:
    """A worker that re-forms in place: its side of the hand-over, its generations, and what its last heal
    left for the next step.

    :param device: where the gradients and a heal's state travel.
    :param rank: the rank torchrun gave (the first round's assignment replaces it).
    :param collective_timeout: seconds a heal's receiver waits for its state.
    :param scaled: a gradient scaler runs (fp16): no rank may sit out a step it needs.
    :param state: the loop's whole state of a run (what a heal sends).
    :param load: takes such a state over (from a peer, a snapshot or a checkpoint).
    :param trains_next: whether the next thing the loop does with a run is a training step (no
        evaluation, not the end).
    :param emit: the loop's record output (a progress record written again).
    :param leave: leaves the group for the restart path (no round came); does not return.
    :param entered: told each round this worker enters (its rank, world size and node there).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        rank: int,
        world: int,
        collective_timeout: float,
        scaled: bool,
        state: Callable[[Run], dict[str, Any]],
        load: Callable[[Run, dict[str, Any]], None],
        trains_next: Callable[[Run], bool],
        emit: Callable[..., None],
        leave: Callable[[], NoReturn],
        entered: Callable[[Assignment], None],
    ) -> None:
        self.device, self.rank, self.world = device, rank, world
        self._timeout, self._scaled = collective_timeout, scaled
        self._state, self._load, self._trains_next = state, load, trains_next
        self._emit, self._leave, self._entered = emit, leave, entered
        self.live = in_place_groups(device)
        self.handover = Handover.from_environment()
        self.handover.register(stamps_steps=True)  # at once: a round handed over during the set-up is acknowledged
        self.handover.watch(self.live)
        self.checkpoints: CheckpointManager | None = None
        """The run's checkpoints, once opened: a heal tells a new rank 0 the last committed step."""
        self.holds_state = False
        """The model and step are a state of the run (not a joiner's before its heal's state arrived), so a
        re-form may go on from them (`reform`)."""
        self.trainers: list[int] | None = None
        """After a heal whose receivers sit out the next step: the ranks that train it (`_heal_beside_step`),
        on every rank until that step's all-reduce. The loop deals the step's samples over them only, and
        its BatchNorm buffers come from the first (`before_update`)."""
        self.arriving: tuple[StateArrival, int] | None = None
        """A heal's receiver: the state on its way, and the step it is of (`receive`)."""
        self._sending: Future[None] | None = None
        """A heal's source: its state being packed and sent beside its next step, until that step's
        all-reduce (`before_update`)."""
        self._confirming: Callable[[], list[list[int]]] | None = None
        """A heal gone ahead before its agreement came (`_heal`, at a switch to a deferred round): the
        agreement's rows to come, until the step's all-reduce."""
        self._progress: tuple[int, torch.Tensor] | None = None
        """A step due a progress record, and the record's sums over the group, summed with the step's
        gradients (`before_update`)."""
        self._summed: dict[str, Any] | None = None
        """The last whole progress record this rank summed, as rank 0 writes it (every rank has the sums):
        a survivor writes it again where rank 0 is lost before it did (`_write_again`)."""
        self._written = -1
        """The step of the last whole progress record this process wrote (as rank 0, or again)."""
        self._boundary = BoundaryBuffers()
        """The model's buffers before the step in flight, put back if it breaks before its update."""

    # -- the loop's calls -----------------------------------------------------------

    @property
    def generation(self) -> int:
        return self.live.generation

    def collectives(self) -> LiveCollectives:
        """The loop's collectives over the current generation."""
        return LiveCollectives(self.rank, self.world, self.device, live=self.live, op_seconds=self._timeout)

    def lineage(self) -> dict[str, Any]:
        """Who wrote a progress record: the generation and the node (progress.whole_records)."""
        return {"generation": self.live.generation, "node": node_name()}

    def keep_boundary(self, model: nn.Module, step: int) -> None:
        """Before a step's forward passes, which update the model's buffers before anything can fail."""
        self._boundary.keep(model, step)

    def arm_buckets(self, run: Run) -> None:
        """Before a step's last backward pass: its gradient buckets are posted as they fill
        (recovery/buckets.py), after a heal's sends are."""
        if run.buckets is not None:
            run.buckets.arm(partial(self.live.post, control=False, owned=True), self.world,
                            before_first=self._sends_posted)  # fmt: skip

    def before_update(
        self, run: Run, step: int, *, row: Callable[[], list[int]], sums: Callable[[], list[torch.Tensor]] | None
    ) -> None:
        """Average the gradients of the update that makes `step` (`row`: this rank's notice row, shared with
        them: NoticeStop.row). Where `sums` is given (`step` is due a progress record) the record's sums so
        far ride with the gradients (`LiveCollectives.average_gradients`), and `summed_progress` returns
        them. Every rank packs them at the same steps, a rank that sat the step out too (with zeros): the
        all-reduce's sizes must match."""
        self._sends_posted()
        self._confirm_go_ahead()
        trainers, self.trainers = self.trainers, None
        packed = None if sums is None else torch.stack([part.to(torch.float64) for part in sums()])
        summed = self.collectives().average_gradients(
            [p for p in run.model.parameters() if p.requires_grad], list(run.model.buffers()),
            boundary=(step, row), buffers_from=0 if trainers is None else trainers[0],
            buckets=run.buckets, sums=packed,
        )  # fmt: skip
        self._progress = None if summed is None else (step, summed)

    def stepped(self) -> None:
        """After a step's update: its all-reduce completed, so every member was alive (liveness.py)."""
        self.handover.stepped(self.live.generation)

    def summed_progress(self, step: int) -> list[float] | None:
        """The group's sums for `step`'s progress record where they came with its gradients, else None."""
        packed, self._progress = self._progress, None
        return packed[1].tolist() if packed is not None and packed[0] == step else None

    def record_written(self, record: dict[str, Any]) -> None:
        """A whole progress record (the group's sums) this rank emitted, or would as rank 0."""
        self._summed = record
        if self.rank == 0:
            self._written = int(record["step"])

    def receive(self, run: Run) -> int:
        """A heal's receiver, the step its trainers take without it: wait for the state, load it, and return
        the step it is of (the loop then sits that step out: zeros in its all-reduce)."""
        assert self.arriving is not None
        (arrival, step), self.arriving = self.arriving, None
        self._load(run, arrival.result())
        self.holds_state = True
        return step

    def enter(self) -> None:
        """Enter this worker's first round (`_enter_next`)."""
        self._enter_next()

    def resume(self, run: Run, mine: Mine, lap: Callable[[str], None]) -> str:
        """Heal in the round just entered (the resume), from `mine` where nobody holds a live state;
        where it breaks, again in the next. Returns where the state came from (`_heal`)."""
        return self._settle(run, live_step=-1, mine=mine, entered=True, lap=lap)

    def reform(self, run: Run, *, step: int, failed: bool, lap: Callable[[str], None]) -> str:
        """After a collective of the step after `step` did not complete (`failed`: a peer's failure rather
        than a newer round): enter the next round and heal in it (`_settle`). `lap` times the parts
        (`group`, `resume`). Returns where the state came from."""
        if failed:
            self.handover.report_failure()
        try:  # a heal's sends posted on the generation being left, before it goes to the graveyard
            self._sends_posted()
        except Exception as exc:  # that generation is over; a state that cannot be sent fails the next heal
            log.warning("rank %d: a heal's state was not sent (%s)", self.rank, exc)
        self._confirming = None  # (its agreement's staging copy goes with the generation)
        if run.buckets is not None:  # so do a broken step's buckets posted in it
            run.buckets.disarm()
        self._boundary.restore(run.model, step)  # the broken step's statistics go with it
        live_step = step if self.holds_state else -1  # a receiver whose state never came has none
        return self._settle(run, live_step=live_step, mine=None, entered=False, lap=lap)

    def close(self) -> None:
        """The run is over: no more rounds (the LiveGroup stays referenced: launch.py)."""
        self.handover.stop()

    # -- rounds and heals -----------------------------------------------------------

    def _sends_posted(self) -> None:
        """Wait for a heal's sends to be posted, if any (before the generation's next collective)."""
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.result()

    def _enter_next(self) -> None:
        """Enter the first newer round that forms (handover.py, live.py); leave by the restart path
        (the snapshot kept) when none comes within REFORM_SECONDS."""
        while True:
            assignment = wait_for_assignment(
                self.handover.read, self.live.generation, time.monotonic() + REFORM_SECONDS
            )
            if assignment is None:
                log.warning("rank %d: no round handed over within %.0f s; leaving for a restart", self.rank,
                            REFORM_SECONDS)  # fmt: skip
                self._leave()
            if self.handover.enter(self.live, assignment, time.monotonic() + REFORM_SECONDS):
                break
        self.rank, self.world = assignment.rank, assignment.world
        self._entered(assignment)

    def _settle(self, run: Run, *, live_step: int, mine: Mine, entered: bool, lap: Callable[[str], None]) -> str:
        """Enter the next round (unless `entered` already) and heal in it; again in the next one while a
        newer round or a lost peer breaks the heal."""
        while True:
            if not entered:
                self._enter_next()
                lap("group")
            entered = False
            try:
                source = self._heal(run, live_step=live_step, mine=mine)
            except GroupChanged as exc:
                if exc.failed:
                    self.handover.report_failure()
            else:
                self.holds_state = self.arriving is None or live_step >= 0
                return source
            finally:
                lap("resume")

    def _heal(self, run: Run, *, live_step: int, mine: Mine) -> str:
        """At a generation's start: every rank goes on from the newest state any of them holds. A live
        rank holds its last completed step (`live_step`); a new one (a joiner, or a worker its agent
        restarted) its node's snapshot, if any (`mine`). While nobody trains yet (the first
        generation), this is the restart path's resume (resume.find_state). Otherwise the newest step
        wins (a rank that completed a step its peers' collectives did not: they take it from it), from
        the lowest rank holding it, sent only when some rank lacks it: where it can, while the ranks
        that hold it train the next step without the others (`_heal_beside_step`). Returns where this
        rank's state came from: `live`, `peer`, `snapshot`, or find_state's.

        At a switch to a round that only adds ranks (`LiveGroup.roster`), the old ranks completed the
        same step and are its trainers: they go ahead without waiting for the agreement, which runs
        beside their step and is checked before its update (`_confirm_go_ahead`); a newcomer waits
        for it, to learn where its state comes from; the rows say which ranks went ahead so, and where
        the agreement refutes their go-ahead a newcomer fails the heal at once, as they fail their step
        (`resume.go_ahead_refuted`). The wait is the old ranks' latency alone, and the newcomer's part
        of the step does not need it."""
        self.arriving, self.trainers, self._confirming = None, None, None  # (those of a generation that broke)
        group = self.collectives()
        checkpoints = self.checkpoints
        committed = -1 if checkpoints is None or checkpoints.last_committed is None else checkpoints.last_committed
        may_sit_out, trains_next = self._may_sit_out(), live_step < 0 or self._trains_next(run)
        kept = None
        if live_step >= 0 and may_sit_out and trains_next:
            kept = kept_ranks(self.live.roster, self.live.generation, self.world)
        ahead = kept is not None and self.rank in kept  # a switch: no wait for the agreement
        summed = -1 if self._summed is None else int(self._summed["step"])
        row = HealRow(live_step, -1 if mine is None else mine[0].step, committed, run.evaluated[0], may_sit_out,
                      ahead, summed, self._written, trains_next)  # fmt: skip
        if kept is not None and ahead:
            self._confirming = group.gather_ints_beside(row.as_ints())
            return self._heal_beside_step(run, kept, live_step)
        rows = [HealRow.parse(line) for line in group.gather_ints(row.as_ints())]
        self._note_committed(rows)
        if go_ahead_refuted(rows):
            log.warning("rank %d: the heal's agreement (%s) refutes the go-ahead the old ranks took", self.rank, rows)
            raise GroupChanged(Outcome.FAILED)
        live = [row.live for row in rows]
        if max(live) < 0:
            found, state = find_state(group, checkpoints, mine)
            if state is not None:
                self._load(run, state)
            return found
        best, source, from_live = heal_source(rows)
        self._write_again(rows, best)
        if all(step == best for step in live):
            self._agree_on_evaluation(run, rows, best, None)
            return "live"
        trainers = trainers_of_next_step(rows, best, source) if from_live else None
        if trainers is not None:
            return self._heal_beside_step(run, trainers, best)
        sending = None
        if self.rank == source:
            sending = self._state(run) if from_live else (mine[1] if mine is not None else None)
        state = broadcast_state(sending, source, self.rank, self.device, group.broadcast)
        found = "live"
        if live_step != best:
            self._load(run, state)
            found = "peer" if from_live else "snapshot"
        if from_live:  # (from a snapshot every rank loaded the same state)
            self._agree_on_evaluation(run, rows, best, source)
        return found

    def _heal_beside_step(self, run: Run, trainers: list[int], best: int) -> str:
        """A heal whose receivers sit out the next step (`resume.trainers_of_next_step`). The lowest of
        `trainers` (the ranks at `best`) sends its state to each of the others point to point, packed
        and posted on its sending thread beside its own passes (`transfer.send_beside`); the
        trainers take the next step among themselves (the loop deals its samples over them) while the
        state travels; a receiver loads it, then takes part in the step's gradient all-reduce with
        zeros and applies the step (`receive`). The same samples make the same step whoever computes
        them, and the step's BatchNorm buffers come from a trainer."""
        self.trainers = trainers
        receivers = [rank for rank in range(self.world) if rank not in trainers]
        if self.rank == trainers[0]:
            state = with_frozen(list(run.model.buffers()), partial(self._state, run))()
            self._sending = send_beside(self.live, state, receivers, self.device)
        if self.rank in trainers:
            return "live"
        deadline = time.monotonic() + self._timeout
        self.arriving = (StateArrival(self.live, trainers[0], self.device, deadline), best)
        return "peer"

    def _may_sit_out(self) -> bool:
        """This rank's `HealRow.may_sit_out` (`resume.trainers_of_next_step`): its data plane sends point to
        point (the host one; NCCL's heal still broadcasts), and no gradient scaler needs a step it took
        part in (fp16). (SyncBatchNorm never runs in place: run.in_place_refusal.)"""
        return not (self.live.plane.separate or self._scaled)

    def _confirm_go_ahead(self) -> None:
        """Before the update of the step a go-ahead taken at a switch let the old ranks train (`_heal`):
        its agreement, which ran beside their passes, must say the same (it does unless a newcomer held a
        newer state than theirs or cannot sit the step out, or a newer round broke the group). Otherwise
        the step is not applied: GroupChanged as a failure, and the next round heals from the rows agreed
        there (the step's forward passes have moved BatchNorm's running statistics; the next step's
        all-reduce makes them one rank's again)."""
        confirming, self._confirming = self._confirming, None
        if confirming is None:
            return
        rows = [HealRow.parse(line) for line in confirming()]
        self._note_committed(rows)
        if go_ahead_refuted(rows):  # (the newcomers fail their heal on the same rows)
            log.warning("rank %d: the heal's agreement (%s) refutes the go-ahead taken", self.rank, rows)
            raise GroupChanged(Outcome.FAILED)

    def _note_committed(self, rows: list[HealRow]) -> None:
        """From a heal's rows: a new rank 0 knows the last checkpoint."""
        newest_committed = max(row.committed for row in rows)
        if self.checkpoints is not None and newest_committed >= 0:
            self.checkpoints.last_committed = newest_committed

    def _write_again(self, rows: list[HealRow], best: int) -> None:
        """Where this rank is the heal's `resume.record_writer`: write the progress record of `best`, the
        step the group goes on from, again, as this rank summed it and with the time the step completed
        (rank 0 may have been lost between the step's all-reduce and its record)."""
        if self._summed is None or record_writer(rows, best) != self.rank:
            return
        log.warning("rank %d: the record of step %d written again (rank 0 left before it was seen written)",
                    self.rank, best)  # fmt: skip
        self._emit({**self._summed, "replayed": True, "rank": self.rank}, any_rank=True)
        self._written = best

    def _agree_on_evaluation(self, run: Run, rows: list[HealRow], best: int, source: int | None) -> None:
        """Every rank goes on with the same epoch-end evaluation (resume.evaluation_source): otherwise one
        would evaluate while another trains. One broadcast of its accuracy, only when they differ."""
        sender = evaluation_source(rows, best, source)
        if sender is None:
            return
        accuracy = torch.tensor([run.evaluated[1]], dtype=torch.float64, device=self.device)
        self.collectives().broadcast(accuracy, sender)
        run.evaluated = (rows[sender].evaluated, float(accuracy))
        log.warning("rank %d: the evaluation of step %d taken from rank %d", self.rank, rows[sender].evaluated, sender)
