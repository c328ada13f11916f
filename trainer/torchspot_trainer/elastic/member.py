"""The worker as a member of the run's groups: its rank and size in the current group, its first group (a
resume) and each next one (its heal), and the duties that follow rank 0 from group to group.

The Manager (manager.py) drives the step and asks its Member where the step goes; the Member knows nothing
of a step's order or its notices. In place, a group is one generation of the agent's rounds (groups.py); on
the restart path, torch's default group, which lasts as long as the worker's process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from torchspot_trainer.elastic.groups import InPlaceGroups
from torchspot_trainer.elastic.leaving import Leaving
from torchspot_trainer.elastic.records import Records
from torchspot_trainer.elastic.saving import Saving
from torchspot_trainer.elastic.settings import REFORM_SECONDS, node_name
from torchspot_trainer.elastic.state import RunState
from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.collectives import LiveCollectives
from torchspot_trainer.recovery.group import Group

if TYPE_CHECKING:
    from torchspot_trainer.elastic.sharding import Columns


class Member:
    """One worker's membership of the run's groups (module docstring).

    :param run: the loop's state and the manager's own (state.py).
    :param in_place: whether groups re-form in place (the agent's rounds), else the restart path's.
    :param columns: a sharded run in place: this worker's column and its node's agreements (sharding.py).
    :param saving: the run's checkpoints, if any: a resume reads them, and rank 0's duty is to write them.
    :param leaving: the node's snapshot (a resume reads it) and the notices' row (its node).
    :param emit: writes one record (records.py), `any_rank` as the manager's.
    :param leave: ends the worker by the restart path, the cause given (a group that cannot be entered).
    """

    def __init__(
        self,
        run: RunState,
        *,
        in_place: bool,
        sharded: bool,
        device: torch.device,
        columns: Columns | None,
        saving: Saving | None,
        leaving: Leaving,
        records: Records,
        emit: Callable[..., None],
        leave: Callable[[str], NoReturn],
    ) -> None:
        self.run, self.in_place, self.sharded, self.device, self.columns = run, in_place, sharded, device, columns
        self._saving, self._leaving, self._records, self._emit, self._leave = saving, leaving, records, emit, leave
        self._checkpoints = None if saving is None else saving.replicated
        per_copy = 1 if columns is None else columns.per_copy
        self.rank = int(os.environ.get("RANK", "0")) // per_copy
        self.world = int(os.environ.get("WORLD_SIZE", "1")) // per_copy
        """This worker's rank and size in its group: the run's, or a sharded run's column's in place."""
        self.begun = self.whole = False
        """`begun`: the first group was entered; `whole`: its resume is done, so the state may be kept as a
        snapshot from now on."""
        self.reform_due = self.regroup = self.failed = False
        """`reform_due`: the last step agreed on a switch to a joiner's group; `regroup`: a collective of the
        loop's between steps did not complete; `failed`: one failed (rather than gave way to a newer round):
        the agent hears of it at the re-form."""
        self.scaled = False
        """A gradient scaler runs (`Manager.scales_loss`): no rank sits a step out after a heal (heal.py)."""
        self.resumed_from = "start"
        """`checkpoint`, `snapshot` (a node's own copy), `peer` (healed from a live rank), `live` (in place,
        the state it held: a re-form sent it none) or `start`: where this worker's state came from last."""
        self.groups = None if not in_place else InPlaceGroups(
            device, state=self._heal_state, load=self._healed, view=None if columns is None else columns.view,
            on_lost=None if columns is None else columns.copy_lost,
        )  # fmt: skip
        self.live = None if self.groups is None else self.groups.live
        self.healing = None if self.groups is None else self.groups.healing
        self._default: Group | None = None
        """The restart path's collectives over the default group (`collectives`)."""

    @property
    def global_rank(self) -> int:
        """This worker's rank among every worker of the group (a sharded run's: over its column's nodes)."""
        return self.rank if self.columns is None else self.columns.global_rank(self.rank)

    @property
    def world_size(self) -> int:
        """Every worker of the group."""
        return self.world if self.columns is None else self.world * self.columns.per_copy

    def step(self) -> int:
        """The run's committed steps as this worker holds them, or as a heal on its way brings them."""
        arriving = None if self.healing is None else self.healing.arriving_step()
        return self.run.step if arriving is None else arriving

    def ensure_group(self) -> None:
        """torch's default process group, made now if the script has not: on the restart path over every rank
        (DDP and FSDP2 need it); for a sharded run in place over this node's workers only (sharding.py)."""
        if self.columns is not None:
            self.columns.ensure_group()
        elif not self.in_place and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")

    def collectives(self) -> Group:
        """The loop's collectives over the current group: the generation's in place (its rank and size
        change at each re-form), else the default group's, made once (they never change in a process)."""
        if self.live is not None:
            return LiveCollectives(self.rank, self.world, self.device, live=self.live, op_seconds=REFORM_SECONDS)
        if self._default is None:
            self._default = Group(self.rank, self.world, self.device)
        return self._default

    def begin(self) -> None:
        """The first group: resume, and enter it (in place, healing there) or share rank 0's state."""
        self.begun = True
        self.ensure_group()  # (in place, a sharded run's node group: its checkpoints load over it)
        if self.in_place:
            self.resume()
            self.enter_and_heal(stepping=False)
        else:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            if self.sharded:  # (each rank's snapshots: its own shards, a trade's copies)
                self.resumed_from = self.run.resume_sharded(self._saving, self._leaving.read_snapshots())
            else:
                mine = self._leaving.read_snapshot()
                self.resumed_from = self.run.resume(self.collectives(), self._checkpoints, mine)
            self._rank_duties()
            self._started(generation=None)
        self.whole = True

    def group_over(self) -> bool:
        """In place, whether the group must re-form before the loop goes on: the last step agreed on a switch
        to a joiner's group, a collective of the loop's between steps did not complete, or a newer round
        broke it."""
        return self.live is not None and (self.reform_due or self.regroup or self.live.broken.is_set())

    def must_reform(self) -> bool:
        """`group_over`, where a sharded run's node's workers re-form together: wherever any of them must."""
        over = self.group_over()
        return over if self.columns is None else self.columns.reform_now(over)

    def reform(self, *, stepping: bool = False) -> None:
        """After a step that did not commit, or at an agreed switch: the next group, and a heal in it
        (`stepping`: at a step's start, so that the heal may go beside it: heal.py)."""
        assert self.groups is not None
        if self.failed:
            self.groups.report_failure()
        self.failed = self.reform_due = self.regroup = False
        self.enter_and_heal(stepping=stepping)

    def enter_and_heal(self, *, stepping: bool) -> None:
        """Enter the first newer round that forms and heal in it; again in the next while a newer round
        or a lost peer breaks the heal."""
        groups = self.groups
        assert groups is not None
        started = time.monotonic()
        source = groups.enter(self.run.step, self.run.version, stepping=stepping, scaled=self.scaled,
                              entered=self._entered, leave=self._leave)  # fmt: skip
        self.reform_due = False
        if source == "peer":  # (a receiver beside the step loads its state before the step's update)
            self.resumed_from = "peer"
        elif self.whole:  # a re-form: it goes on from the state it holds (the first group's is its resume's)
            self.resumed_from = "live"
        self._rank_duties()
        self._emit({"event": "generation", "generation": groups.live.generation, "rank": self.global_rank,
                    "world_size": self.world_size, "step": self.step(), "pid": os.getpid(), "node": node_name(),
                    "resumed_from": self.resumed_from, "trainers": groups.healing.trainers,
                    "seconds": round(time.monotonic() - started, 3)}, any_rank=True)  # fmt: skip
        self._started(generation=groups.live.generation)

    def resume(self) -> None:
        """In place, before the first group: the node's snapshot or the newest checkpoint (RunState); a sharded
        run's newest checkpoint, resharded over the node's workers (each node loads a whole copy)."""
        if self.columns is None:
            self.resumed_from = self.run.resume_from_copies(self._leaving.read_snapshot(), self._checkpoints)
        elif self._saving is not None:
            self.resumed_from = self.run.resume_sharded(self._saving)

    def _started(self, *, generation: int | None) -> None:
        """A group's start record (records.py), and the host copy of the state the group starts from (a
        node's snapshot before its first commit)."""
        first = self.run.positions[0] if self.run.positions else None
        self._records.started(step=self.step(), world=self.world_size, rank=self.global_rank,
                              resumed_from=self.resumed_from, generation=generation, position=first)  # fmt: skip
        self.run.capture()

    def _entered(self, assignment: Assignment) -> None:
        """A round entered: this worker's rank, world size and node there."""
        self.rank, self.world = assignment.rank, assignment.world
        self._leaving.stop.node = assignment.node

    def _heal_state(self) -> dict[str, Any]:
        """What a heal sends: the state at the step boundary, a sharded run's as its local shards."""
        state = self.run.at_boundary()
        if self.columns is None:
            return state
        from torchspot_trainer.elastic.sharding import local_state  # noqa: PLC0415 - (DTensor's import, where used)

        return dict(local_state(state))

    def _healed(self, state: dict[str, Any]) -> None:
        """A heal's state from a live peer, taken over (a sharded run's laid out as this worker's own)."""
        if self.columns is not None:
            from torchspot_trainer.elastic.sharding import like  # noqa: PLC0415 - (DTensor's import, where used)

            state = like(state, self.columns.without_gradients(self.run.full))
        self.run.load(state)
        self.resumed_from = "peer"

    def _rank_duties(self) -> None:
        """Rank 0 reports steps and checkpoints to the operator (through the job's etcd); the duty
        follows rank 0 from group to group."""
        if self._saving is not None:
            self._saving.ranks_changed(self.rank)
        self._records.rank_is(self.global_rank)
