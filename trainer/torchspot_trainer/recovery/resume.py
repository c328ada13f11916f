"""Where a (re)started group takes its state from: a node's own copy, Blob, or nothing.

Resume from the newest node-local snapshot any rank holds (snapshot.py: the survivors of
a lost peer hold the last completed step), else from the newest committed checkpoint.
Rank 0 chooses and tells the others, so every rank loads the same state:

- a snapshot is sent over the process group only when some rank lacks it (a joining
  node), from the lowest rank that holds it;
- a checkpoint is read from Blob once, by rank 0, and sent to all the others (a Blob read
  per rank would fetch the same bytes once per GPU).

Both are sent as tensors (wire.py), not as pickled objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.recovery.group import Group
from torchspot_trainer.recovery.snapshot import Held, choose_source
from torchspot_trainer.recovery.wire import broadcast_state


class HealRow(NamedTuple):
    """One rank's line of a heal's agreement in place (in_place.py's `_heal`): every rank gathers every
    rank's (`Group.gather_ints`, as integers: `as_ints`, `parse`) and decides alike from the same
    table. A step is -1 where there is none."""

    live: int
    """The last step this rank completed in place (-1: a new process, a joiner or a restarted worker)."""
    held: int
    """The step of its node's snapshot (a new process's state on disk)."""
    committed: int
    """The step of the last checkpoint it knows committed to Blob (a new rank 0 learns it here)."""
    evaluated: int
    """The step of its last epoch-end evaluation (`evaluation_source`)."""
    may_sit_out: bool
    """It can sit a step out while the state travels (`trainers_of_next_step`): a capability."""
    went_ahead: bool = False
    """It went ahead at a switch, training without waiting for this agreement (`go_ahead_refuted`)."""
    summed: int = -1
    """The step of the last whole progress record it summed (`record_writer`)."""
    written: int = -1
    """The step of the last record it wrote (`record_writer`)."""
    trains_next: bool = True
    """The next thing it does from its live state is a training step (`trainers_of_next_step`)."""

    def as_ints(self) -> list[int]:
        """The row as the agreement gathers it."""
        return [int(value) for value in self]

    @classmethod
    def parse(cls, line: Sequence[int]) -> HealRow:
        """A gathered line back as a row (its flags as booleans)."""
        live, held, committed, evaluated, sits, ahead, summed, written, trains = line
        return cls(live, held, committed, evaluated, bool(sits), bool(ahead), summed, written, bool(trains))


def evaluation_source(rows: Sequence[HealRow], best: int, source: int | None) -> int | None:
    """After a heal in place: the rank whose epoch-end evaluation every rank takes, or None when they
    hold the same one already. Pure.

    `rows`: the heal's agreement; `best`: the step they go on from; `source`: the rank whose state the
    ranks behind `best` received (None: none was sent). A rank at `best` keeps its own evaluation, one
    behind takes the source's. They can differ: a frozen peer can leave an all-reduce completed on one
    rank and not on another (gloo's ring), and so the epoch end's evaluation counted by one survivor
    and not by the other, which then evaluated while its peer trained, and gloo aborted both on the
    mismatched collective (a bench freeze trial's restarted survivor, 2 in about 100). The newest
    evaluation among the ranks at `best` wins, from the lowest rank that holds it."""
    after = [row.evaluated if source is None or row.live == best else rows[source].evaluated for row in rows]
    if len(set(after)) <= 1:
        return None
    newest = max(row.evaluated for row in rows if row.live == best)
    return next(rank for rank, row in enumerate(rows) if row.live == best and row.evaluated == newest)


def trainers_of_next_step(rows: Sequence[HealRow], best: int, source: int) -> list[int] | None:
    """After a heal in place that sends a live rank's state (`source`'s, at step `best`) to the ranks
    behind it: the ranks that train the next step while the others receive the state, or None when
    the others must have it first. Pure.

    Every rank must be able to sit out (`HealRow.may_sit_out`: its data plane sends point to point,
    no gradient scaler or SyncBatchNorm needs it in the step), the ranks at `best` must train next
    (`HealRow.trains_next`: no evaluation, not the end), and those must agree on their evaluation.
    A rank behind `best` takes the state, evaluation and all, from them: a soak's node thawed with a
    live state at an epoch's end, its evaluation due there, was counted unable to sit out once, and
    every switch to a round with it was refuted, three in a row, until a join broke the pattern
    (2.6 s without a step, bench/README.md).
    A joiner would otherwise be healed first, then train: on 2 CPU cores the others waited 10-20 ms
    for the state's broadcast before their step (bench/README.md). TorchFT heals so as well: a
    joining replica's gradients count zero in its first step, which it takes with the state it
    receives meanwhile."""
    if not all(row.may_sit_out for row in rows) or not all(row.trains_next for row in rows if row.live == best):
        return None
    if evaluation_source(rows, best, source) is not None:
        return None
    trainers = [rank for rank, row in enumerate(rows) if row.live == best]
    return trainers if len(trainers) < len(rows) else None


def go_ahead_refuted(rows: Sequence[HealRow]) -> bool:
    """Whether the ranks that went ahead at a switch (`HealRow.went_ahead`: they train
    without waiting for the heal's agreement, in_place.py's `_heal`) took a go-ahead the agreement
    does not give: the newest step is not theirs, not a live state, or they are not the next
    step's trainers. Pure. False when none went ahead.

    Every rank of the generation reads the same rows and so decides alike: the ranks that went
    ahead fail their step before its update, and the others fail the heal instead of waiting for
    a state or a broadcast the ranks ahead will never send. A soak's thawed node whose heal was
    refuted so (it was counted unable to sit out: `trainers_of_next_step`) waited in the heal's
    broadcast for gloo's op timeout before (27.7 s without a step, bench/README.md)."""
    ahead = [rank for rank, row in enumerate(rows) if row.went_ahead]
    if not ahead:
        return False
    best, source, from_live = heal_source(rows)
    return best != rows[ahead[0]].live or not from_live or trainers_of_next_step(rows, best, source) != ahead


def record_writer(rows: Sequence[HealRow], best: int) -> int | None:
    """After a heal in place: the rank that writes the progress record of `best` (the step every rank
    goes on from) again, or None when none needs to. Pure. From the step of the last whole record each
    rank summed (`HealRow.summed`: every rank sums it, with the step's gradients) and of the last one
    it wrote (`HealRow.written`: rank 0 writes).

    A step is applied once its gradient all-reduce completed on every rank, and only rank 0 writes
    its record after that: where rank 0 is lost in between, the step is trained and was never
    logged (a soak's step 8376 of 40,400, bench/README.md). Nobody can tell whether the lost rank
    wrote it before it went, so the lowest live rank at `best` that summed the record writes it
    whenever no rank of the new group wrote it: a step is logged at least once, and a record
    written again says so (progress.py's `Progress.replayed`)."""
    if any(row.written == best for row in rows):
        return None
    return next((rank for rank, row in enumerate(rows) if row.live == best and row.summed == best), None)


def heal_source(rows: Sequence[HealRow]) -> tuple[int, int, bool]:
    """After a heal in place with some live rank (a row's live step at least 0): (the step every rank
    goes on from, the lowest rank that holds it, whether that is a live state rather than a
    snapshot). Pure."""
    live, held = [row.live for row in rows], [row.held for row in rows]
    best = max(*live, *held)
    from_live = best == max(live)
    return best, (live if from_live else held).index(best), from_live


def kept_ranks(roster: tuple[int, list[int]] | None, generation: int, world: int) -> list[int] | None:
    """At a switch to a round that only adds ranks: the ranks in it (`generation`, of `world` ranks)
    of the generation switched from, sorted; None when `roster` (live.py's `LiveGroup.roster`) is of
    another round, or some old rank had not been offered it. Pure. Every one of them completed the
    step the switch came after, so they are the heal's trainers (`trainers_of_next_step`) whatever a
    newcomer holds, as far as the heal's agreement, which the trainers check before their step's
    update, confirms (in_place.py's `_heal`)."""
    if roster is None or roster[0] != generation:
        return None
    ranks = roster[1]
    if len(set(ranks)) != len(ranks) or len(ranks) >= world or any(not 0 <= rank < world for rank in ranks):
        return None
    return sorted(ranks)


def find_state(
    group: Group, manager: CheckpointManager | None, mine: tuple[Held, dict[str, Any]] | None
) -> tuple[str, dict[str, Any] | None]:
    """(`snapshot`, state), (`checkpoint`, state) or (`start`, None); the same on every rank.

    `mine` is this rank's node's snapshot (every local rank reads the node's one file). Sets the
    manager's last committed step from what rank 0 found, so the first save after the resume
    knows it. Without a manager (a run with no --checkpoint-uri) the nodes' snapshots are all there
    is: a group re-formed after a loss resumes from the survivors' newest, not from step 0.
    """
    held = gather_held(group, None if mine is None else mine[0])
    choice = torch.tensor([-1, -1], dtype=torch.long, device=group.device)  # [snapshot source, step]
    loaded = None
    if group.rank == 0:
        committed = manager.latest_step() if manager is not None and any(held) else None
        picked = choose_source(held, committed)
        if picked is not None:
            choice[0], choice[1] = picked[0], picked[1].step
            if manager is not None:
                manager.last_committed = committed
        else:
            loaded = None if manager is None else manager.load_latest()
            choice[1] = -1 if loaded is None else loaded.step
    group.broadcast(choice, 0)
    source, step = int(choice[0]), int(choice[1])
    if source >= 0:
        return "snapshot", _state_from(group, source, held, mine)
    if step < 0 or manager is None:
        return "start", None
    manager.last_committed = step
    state = broadcast_state(None if loaded is None else loaded.state, 0, group.rank, group.device, group.broadcast)
    return "checkpoint", state


def gather_held(group: Group, mine: Held | None) -> list[Held | None]:
    """Every rank's snapshot (base and step), by rank."""
    rows = group.gather_ints([0, 0, 0] if mine is None else [1, mine.base, mine.step])
    return [Held(base, step) if has else None for has, base, step in rows]


def _state_from(
    group: Group, source: int, held: list[Held | None], mine: tuple[Held, dict[str, Any]] | None
) -> dict[str, Any]:
    """The chosen snapshot's state: this rank's own copy when it holds the same one, else the
    source's, sent over the process group (only when some rank lacks it: a joining node;
    every rank knows from `held` whether one does)."""
    chosen = held[source]
    state = mine[1] if mine is not None and mine[0] == chosen else None
    if any(h != chosen for h in held):
        state = broadcast_state(
            state if group.rank == source else None, source, group.rank, group.device, group.broadcast
        )
    assert state is not None
    return state


def newest(rows: list[list[float]]) -> tuple[int, int]:
    """(the newest committed step, the lowest rank that holds it) from `agree` rows whose first value
    is each rank's committed step. Pure. A rank that committed a step the others did not (its
    all-reduce completed, a peer's failed) is the one the others heal from."""
    step = max(int(row[0]) for row in rows)
    return step, next(rank for rank, row in enumerate(rows) if int(row[0]) == step)
