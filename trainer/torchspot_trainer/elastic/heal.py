"""A heal at a group's start, the API's: every rank goes on from the newest committed step any of them
holds, and the ranks that hold it do not wait for the others to receive it where they need not.

The ranks agree on one row each (`Row`). Where every rank at the newest step heals at a step's start
and every rank may sit a step out (`trainers_beside`), the lowest of them sends the state point to point
to the others, on its sending thread, beside the step that it and the others at that step take among
themselves (the sampler deals the step's samples over them: `Healing.share`). A receiver runs the
step's passes on the state it has while its own state travels, waits for it before its first gradient
bucket, sends zeros in the step's all-reduce, and loads the state before the update: every rank then
applies the same averaged gradients to the same state. The trainers' pause is the transfer's time
beyond their own passes, not the whole transfer. TorchFT heals a joining replica so: its gradients
count zero in its first step, which it takes with the state it received meanwhile.

Otherwise (the first group, a step that failed on some ranks, a device plane whose sends are
collectives, a gradient scaler whose scale the state does not carry) the lowest rank at the newest step
broadcasts the state and every rank waits for it, as the trainer's restart path's resume does.

What a loop does after a heal is its holders' choice: a rank holding the newest state that heals between
steps goes back to its loop, which decides from that state (it may begin an evaluation, whose collectives
are not a step's). A rank that healed at a step's start then takes no part in the step it began: the step
is void (`holders_between_steps`, `Manager.start_step`), and its loop decides again from the state it
holds now, as the holders' do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from torchspot_trainer.elastic.settings import REFORM_SECONDS
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome
from torchspot_trainer.recovery.transfer import StateArrival, send_beside
from torchspot_trainer.recovery.wire import broadcast_state

__all__ = ["Healing", "Row", "holders_between_steps", "source_of", "trainers_beside"]

log = logging.getLogger("torchspot.elastic")


@dataclass(frozen=True)
class Row:
    """One rank's line of a heal's agreement."""

    step: int
    """The step this rank's state is of: its last committed step, or what its resume loaded."""
    version: int
    """Its changes since that step (`Manager.state_changed`): of two states of one step, the changed one
    is newer."""
    fresh: bool
    """It holds no state of the run's group yet (a new process, or a receiver whose state never came)."""
    stepping: bool
    """It heals at a step's start (`Manager.start_step`): the loop takes a step next, whatever it reads."""
    may_sit_out: bool
    """Its gradients may count zero in a step (a host plane, no gradient scaler)."""

    @property
    def newness(self) -> tuple[int, int]:
        """What orders two ranks' states: the step, then the changes since it."""
        return self.step, self.version

    def as_floats(self) -> list[float]:
        return [float(self.step), float(self.version), float(self.fresh), float(self.stepping), float(self.may_sit_out)]

    @classmethod
    def parse(cls, line: Sequence[float]) -> Row:
        return cls(int(line[0]), int(line[1]), bool(line[2]), bool(line[3]), bool(line[4]))


def trainers_beside(rows: Sequence[Row]) -> list[int] | None:
    """The ranks that train the next step while the others receive the state (module docstring), or None
    where the others must have it first: no rank lacks the newest step, none holds it live, one holding
    it does not heal at a step's start, or a rank may not sit a step out. Pure."""
    best = max(row.newness for row in rows)
    trainers = [rank for rank, row in enumerate(rows) if row.newness == best and not row.fresh]
    if not trainers or len(trainers) == len(rows):
        return None
    if not all(rows[rank].stepping for rank in trainers) or not all(row.may_sit_out for row in rows):
        return None
    return trainers


def holders_between_steps(rows: Sequence[Row]) -> bool:
    """Whether a rank holding the newest state heals between steps (its loop decides next, from that
    state: module docstring). Where every holder heals at a step's start, their loops decided on that
    very state to take a step, and a rank whose state they replace takes it with them. Pure."""
    best = max(row.newness for row in rows)
    return any(not row.stepping for row in rows if row.newness == best)


def source_of(rows: Sequence[Row]) -> int:
    """The rank a broadcast heal sends from: the lowest holding the newest step, a live one before a
    new one's copy (a snapshot or checkpoint of the same step). Pure."""
    best = max(row.newness for row in rows)
    holders = [rank for rank, row in enumerate(rows) if row.newness == best]
    return next((rank for rank in holders if not rows[rank].fresh), holders[0])


class Healing:
    """One worker's heals, and what the last one left for the step after it (module docstring).

    :param live: the worker's groups.
    :param device: where a heal's state travels.
    :param state: the whole state to send (the model's buffers as at the step boundary).
    :param load: takes such a state over.
    """

    def __init__(
        self,
        live: LiveGroup,
        device: torch.device,
        *,
        state: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
    ) -> None:
        self._live, self._device = live, device
        self._state, self._load = state, load
        self.fresh = True
        """This process holds no state of the run's group yet (`Row.fresh`)."""
        self.trainers: list[int] | None = None
        """After a heal beside a step: the ranks that train it, until its all-reduce."""
        self.holders_between = False
        """The last heal's holders of the newest state healed between steps (`holders_between_steps`)."""
        self._arriving: tuple[StateArrival, int] | None = None
        self._arrived: dict[str, Any] | None = None
        self._sending: Future[None] | None = None

    def heal(
        self, rank: int, step: int, version: int, *, stepping: bool, may_sit_out: bool, alike_at_start: bool = False
    ) -> str:
        """Agree on the newest step in the group just entered and take it (module docstring). Returns
        where this rank's state comes from: `live` (it holds the newest), `peer` (loaded now, or on its
        way for the next step: `arriving_step`). Raises GroupChanged where the group fails meanwhile.
        `alike_at_start`: where every rank is fresh at step 0, each keeps its own state, as a sharded run
        under FSDP2 does (its script initialises alike: FSDP2 syncs nothing either); a broadcast would
        build the source's state now, which for torch's `get_state_dict` is an optimizer step of zeros
        that a run without it never takes (Adam's step count)."""
        self.drop()
        mine = Row(step, version, self.fresh, stepping, may_sit_out)
        agreed = self._live.agree(mine.as_floats(), time.monotonic() + REFORM_SECONDS)
        if agreed is None:
            raise GroupChanged(Outcome.BROKEN)
        rows = [Row.parse(line) for line in agreed]
        self.holders_between = holders_between_steps(rows)
        best = max(row.newness for row in rows)
        at_start = alike_at_start and all(row.fresh and row.newness == (0, 0) for row in rows)
        if at_start or all(row.newness == best and not row.fresh for row in rows):
            self.fresh = False
            return "live"
        trainers = trainers_beside(rows)
        if trainers is not None:
            self.trainers = trainers
            receivers = [other for other in range(len(rows)) if other not in trainers]
            if rank == trainers[0]:
                self._sending = send_beside(self._live, self._state(), receivers, self._device)
            if rank in trainers:
                return "live"
            arrival = StateArrival(self._live, trainers[0], self._device, time.monotonic() + REFORM_SECONDS)
            self._arriving = (arrival, best[0])
            return "peer"
        source = source_of(rows)
        state = broadcast_state(self._state() if rank == source else None, source, rank, self._device,
                                self._live_broadcast)  # fmt: skip
        self.fresh = False
        if rank != source and (mine.fresh or mine.newness != best):
            self._load(state)
            return "peer"
        return "live"

    def _live_broadcast(self, tensor: torch.Tensor, source: int) -> None:
        """A broadcast heal's collective over the current generation: GroupChanged where it fails."""
        outcome = self._live.broadcast(tensor, source, time.monotonic() + REFORM_SECONDS)
        if outcome is not Outcome.DONE:
            raise GroupChanged(outcome)

    def arriving_step(self) -> int | None:
        """The step of the state on its way to this receiver, if any: what the loop reads as its step."""
        return None if self._arriving is None else self._arriving[1]

    def pending(self) -> bool:
        """Whether a heal's state is on its way to this receiver or arrived and not loaded yet."""
        return self._arriving is not None or self._arrived is not None

    def sits_out(self, rank: int) -> bool:
        """Whether `rank` sits the step out (its gradients count zero)."""
        return self.trainers is not None and rank not in self.trainers

    def share(self, rank: int, world: int) -> tuple[int, int]:
        """(this rank's place, the ranks that train the step): what the step's samples are dealt over. A
        receiver computes the first trainer's share, which counts zero."""
        if self.trainers is None:
            return rank, world
        return (self.trainers.index(rank) if rank in self.trainers else 0), len(self.trainers)

    def before_collective(self) -> None:
        """Before the generation's next collective: a source's sends posted (its sending thread is done with
        the generation), a receiver's state arrived (the sender's step cannot complete, and so its update
        change what it packs, before every receiver has it). Raises GroupChanged where either failed."""
        if (failed := self._sends_posted()) is not None:  # the step fails, the next heal says why
            log.warning("a heal's state was not sent (%s)", failed)
            raise GroupChanged(Outcome.FAILED) from failed
        arriving, self._arriving = self._arriving, None
        if arriving is not None:
            self._arrived = arriving[0].result()

    def stepped(self) -> bool:
        """The step after a heal beside it completed its all-reduce: a receiver loads its state (before the
        update). True where it did."""
        self.trainers = None
        arrived, self._arrived = self._arrived, None
        if arrived is None:
            return False
        self._load(arrived)
        self.fresh = False
        return True

    def drop(self) -> None:
        """A re-form: what the last heal left for a step that never completed goes. A source's sends are
        waited for (they are posted on the generation being left); a receiver's state is let go (its
        thread's buffers stay held with that generation), and, if it never held the run's state, its
        next row says so (`fresh`)."""
        if (failed := self._sends_posted()) is not None:  # that generation is over; the next heal sends again
            log.info("a heal's state was not sent (%s)", failed)
        self.trainers, self._arriving, self._arrived = None, None, None

    def _sends_posted(self) -> Exception | None:
        """Wait for a source's sends to be posted, if any; what stopped them (a state that cannot be sent,
        a receiver's connection gone), if anything."""
        sending, self._sending = self._sending, None
        if sending is None:
            return None
        try:
            sending.result()
        except Exception as exc:  # (what the sending thread raised, handed to the caller to judge)
            return exc
        return None

    def settle(self) -> bool:
        """At the loop's end: a state still on its way is taken (the final checkpoint holds the run's
        step). True where one was loaded."""
        if self._arriving is None:
            return False
        try:
            self.before_collective()
        except GroupChanged as exc:
            log.warning("the heal's state did not arrive before the loop ended (%s)", exc)
            return False
        return self.stepped()
