"""A manager's groups in place: its side of the agent's hand-over (handover.py), one generation per round
the agent hands over (recovery/live.py), a heal at each generation's start (heal.py), and each step's
collectives over the current generation: its gradient buckets with what the last one carries
(buckets.py, riders.py) and the loop's own sums. The manager (manager.py) enters the next round at the
first step, after a step that did not commit, at an agreed switch and at a notice's re-form; the loop
never sees a round. A sharded run's generations are its column's (sharding.py): local rank i of every
node, one worker a node; its gradients go as one flat bucket (`reduce_flat`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from torchspot_trainer.elastic.buckets import Bucket, StepBuckets
from torchspot_trainer.elastic.heal import Healing
from torchspot_trainer.elastic.riders import Line, pack, unpack
from torchspot_trainer.elastic.settings import REFORM_SECONDS
from torchspot_trainer.handover import Assignment, Handover
from torchspot_trainer.recovery.live import LiveGroup, in_place_groups, wait_for_assignment
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome

__all__ = ["KEEP", "InPlaceGroups"]

KEEP: list[object] = []
"""Every manager's groups, referenced until the process ends: freeing a gloo group whose peer is gone
can block (fork_server.run_program says why)."""


class _Flat:
    """A sharded run's gradients as one bucket (buckets.Bucket): no DDP lays them out."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return []


class InPlaceGroups:
    """One worker's generations, its hand-over and its heals (module docstring).

    :param device: where the gradients and a heal's state travel.
    :param state: the whole state to send in a heal (as at the step boundary).
    :param load: takes a heal's state over.
    :param view: a sharded run's: each round read as this worker's column's (`Columns.view`), none where its
        copy is not whole there; None: every worker of the round is one group.
    :param on_lost: a sharded run's: told of a round where `view` gives this worker no column
        (`Columns.copy_lost`).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        state: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
        view: Callable[[Assignment], Assignment | None] | None = None,
        on_lost: Callable[[Assignment], None] | None = None,
    ) -> None:
        self.view, self.on_lost = view, on_lost
        self.buckets = StepBuckets()
        """The step's buckets posted so far (`reduce`), given up whenever a newer round breaks the generation."""
        self.live: LiveGroup = in_place_groups(device)
        self.live.when_broken(self.buckets.give_up)
        KEEP.append(self.live)
        self.healing = Healing(self.live, device, state=state, load=load)
        self._handover: Handover | None = None

    def start(self) -> None:
        """Register with this node's agent (as the manager is made: a round handed over during the loop's
        set-up is acknowledged): it hands this worker each round from now."""
        handover = Handover.from_environment(view=self.view, on_lost=self.on_lost)
        handover.register(stamps_steps=True)
        handover.watch(self.live)
        self._handover = handover

    def done_with_group(self) -> None:
        """This worker's node leaves and its group has shared the notice: its agent may leave the rendezvous
        now, so that the others re-form while this worker writes the emergency checkpoint."""
        if self._handover is not None:
            self._handover.agreed()

    def enter(
        self,
        step: int,
        version: int,
        *,
        stepping: bool,
        scaled: bool,
        entered: Callable[[Assignment], None],
        leave: Callable[[str], NoReturn],
    ) -> str:
        """Enter the first newer round that forms and heal in it (heal.py: `step` and `version` are this
        rank's state's), again in the next while a newer round or a lost peer breaks the heal; `leave`
        where no round comes within REFORM_SECONDS. `entered(assignment)` is told each round entered.
        Returns where this rank's state comes from (`Healing.heal`). `stepping`: at a step's start;
        `scaled`: a gradient scaler runs (no rank may sit a step out: its scale is not in the state)."""
        handover, live = self._handover, self.live
        assert handover is not None
        # A device plane's heal broadcasts. A column's may go beside the step: a node's workers hold one step
        # and are alike fresh, so in every column the same nodes train and the same ones sit out.
        columns = self.view is not None
        may_sit_out = not (live.plane.separate or scaled)
        while True:
            assignment = wait_for_assignment(handover.read_as_written, live.generation,
                                             time.monotonic() + REFORM_SECONDS)  # fmt: skip
            if assignment is None:
                leave(f"no round handed over within {REFORM_SECONDS:g} s")
            if self.view is not None:
                seen = self.view(assignment)
                if seen is None:  # (its replica group is not whole in that round: its copy is incomplete)
                    leave(f"this worker's replica group is not whole in round {assignment.generation}")
                assignment = seen
            if not handover.enter(live, assignment, time.monotonic() + REFORM_SECONDS):
                continue
            self.buckets.whole = True  # (the generation's first step: buckets.py)
            entered(assignment)
            try:
                return self.healing.heal(assignment.rank, step, version, stepping=stepping, may_sit_out=may_sit_out,
                                         alike_at_start=columns)  # fmt: skip
            except GroupChanged as exc:
                if exc.failed:
                    handover.report_failure()

    def report_failure(self) -> None:
        """A collective of this worker failed at a peer (its socket closed): the agent judges its peers
        with its short timeout (rendezvous/losses.py)."""
        assert self._handover is not None
        self._handover.report_failure()

    def reduce(
        self,
        bucket: Bucket,
        *,
        rank: int,
        world: int,
        buffers: list[torch.Tensor],
        row: Callable[[], list[int]],
        deadline: float,
    ) -> torch.futures.Future[torch.Tensor]:
        """A DDP bucket's average over the current generation, started now (buckets.py): over the ranks that
        compute the step (after a heal beside it, its trainers; a receiver sends zeros), the last bucket
        carrying the model's float `buffers` from the first of them and this rank's line: its deferred
        round's joiners ready, and `row()`'s notice level and node (riders.py). Before the step's first
        collective a heal's sends are posted, or its state arrived (heal.py); where that failed the bucket
        is refused. A sharded run's `_Flat` goes as one bucket, never held (`whole` is for DDP's layouts)."""
        healing = self.healing
        if not self.buckets.posted():
            try:
                healing.before_collective()
            except GroupChanged as exc:
                return self.buckets.refuse(bucket, Outcome.FAILED if exc.failed else Outcome.BROKEN)
        trainers = healing.trainers
        source = 0 if trainers is None else trainers[0]  # (a receiver's buffers are stale)

        def riders(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            level, node = row()
            line = Line(self.live.joiners_ready.is_set(), level, node)
            return pack(buffers, rank, world, line, source=source, dtype=dtype, device=device)

        return self.buckets.post(
            bucket, self.live, world if trainers is None else len(trainers), riders=riders, deadline=deadline,
            zeros=healing.sits_out(rank),
        )  # fmt: skip

    def reduce_flat(self, gradients: torch.Tensor, **reduce: Any) -> torch.futures.Future[torch.Tensor]:
        """A sharded run's step: every local gradient shard of this rank in one flat tensor, averaged over
        its column as one last bucket (`reduce`'s keywords); the future's value is the average."""
        self.buckets.whole = False
        return self.reduce(_Flat(gradients), **reduce)

    def settle(self, buffers: list[torch.Tensor], world: int) -> tuple[list[Outcome], list[Line] | None]:
        """The step's buckets' outcomes, and, where every all-reduce completed, every rank's line the last
        bucket brought (the `buffers` take the source's values, and a heal's receiver loads its state
        first); None otherwise. No outcome: no bucket was posted."""
        outcomes, ride = self.buckets.take()
        self.buckets.whole = False  # (the generation's first step was taken: its next go bucket by bucket)
        if not outcomes or ride is None or any(outcome is not Outcome.DONE for outcome in outcomes):
            return outcomes, None
        self.healing.stepped()  # a receiver's state, taken before the step's buffers
        return outcomes, unpack(ride, buffers, world)

    def all_reduce(self, tensor: torch.Tensor) -> Outcome:
        """The loop's own sum over the current generation (a host tensor over its gloo group, a device one
        over its data plane), after a heal's sends or state (heal.py)."""
        if self.live.broken.is_set():
            return Outcome.BROKEN
        try:
            self.healing.before_collective()
        except GroupChanged as exc:
            return Outcome.FAILED if exc.failed else Outcome.BROKEN
        return self.live.all_reduce(tensor, time.monotonic() + REFORM_SECONDS, control=tensor.device.type == "cpu")

    def stepped(self) -> None:
        """A step committed: every member was alive at it (the agent's liveness proof)."""
        if self._handover is not None:
            self._handover.stepped(self.live.generation)

    def close(self) -> None:
        """No more rounds (the generations stay referenced: KEEP)."""
        if self._handover is not None:
            self._handover.stop()
