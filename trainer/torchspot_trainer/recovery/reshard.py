"""A sharded state's snapshots: each rank writes its own shards as it stops, and the next round's resume
reshards the newest whole set of them over its group, from the ranks that hold them.

A replicated state's snapshot is one whole copy per node (snapshot.py). A sharded rank holds only its
shards, so each rank writes a file of its own, and a round may resume from the snapshots only where they
hold every shard of the state.

- **What a rank's file holds** (`shard_form`): the state with each DTensor as its local shard and that
  shard's place in the whole tensor (offsets and sizes: the DTensor's `__create_chunk_list__`, which torch's
  distributed checkpoint reads too), and the writer's rank and world size (`WRITER`). It is built from the
  host copy, so a hung device cannot stop it (hostcopy.py).
- **Which set** (`choose_set`, pure): the snapshots of one lineage and step that, among the new group's
  ranks, hold every writer rank of their round; the newest such set (its base, then its step); and not
  older than the newest committed checkpoint. Otherwise none, and the resume reads that checkpoint. A node
  lost without notice took its ranks' shards with it: that set is never whole, and the run goes back to the
  last checkpoint (replica groups in place, docs/sharded-in-place.md, lose no step there).
- **The exchange** (`reshard`, a collective of the new group): each rank works out, for each DTensor of its
  own layout, the regions of the old shards that overlap its new shard, and asks their holders; each holder
  sends each asker its regions in one message (gloo's send and receive, every pair at once). Where several
  old shards hold the same region (a replicated mesh dimension), the rank's own copy is read, else the
  lowest writer rank's. The rest of the state (the step, the samplers' positions, a tensor that is not
  sharded) comes from the holder of writer rank 0. A holder sends each element of its old shards at most
  once per asker that needs it, and the asker's new shards are laid out as its own (`from_local` in the
  template's mesh and placements).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchspot_trainer.recovery.snapshot import Held

__all__ = ["WRITER", "Holding", "choose_set", "own_shards", "reshard", "resume_from", "shard_form"]

log = logging.getLogger(__name__)

SHARD = "torchspot_shard"
"""The key that marks a local shard in a rank's snapshot (`shard_form`), beside its "offsets" and "sizes"."""
WRITER = "torchspot_writer"
"""The top-level key of a rank's snapshot: [its rank, its world size] in the round that wrote it."""

Path_ = tuple[str | int, ...]
"""A leaf's place in a state: the keys and list indices from its top."""
Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A region of a whole tensor: its offsets and sizes, one of each per dimension."""


@dataclass(frozen=True)
class Holding:
    """What one rank's snapshot holds: the lineage and step (snapshot.Held), and the rank and world size of
    the round that wrote it."""

    held: Held
    rank: int
    world: int


def shard_form(state: Any, rank: int, world: int) -> dict[str, Any]:
    """`state` (a dict) as a rank's snapshot keeps it (module docstring): each DTensor its local shard with its
    place in the whole, and `WRITER`."""
    formed = _form(state)
    assert isinstance(formed, dict)
    return {**formed, WRITER: [rank, world]}


def own_shards(state: dict[str, Any]) -> dict[str, Any]:
    """`shard_form` as this process writes it: its rank and world size in torch's default group."""
    return shard_form(state, dist.get_rank(), dist.get_world_size())


def _box(value: DTensor) -> Box:
    """A DTensor's local shard's region of the whole (one chunk: torch's distributed checkpoint reads it so)."""
    (chunk,) = value.__create_chunk_list__()  # type: ignore[no-untyped-call]
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _form(value: Any) -> Any:
    if isinstance(value, DTensor):
        offsets, sizes = _box(value)
        return {SHARD: value.to_local(), "offsets": list(offsets), "sizes": list(sizes)}
    if isinstance(value, dict):
        return {key: _form(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_form(item) for item in value)
    return value


def holding(state: dict[str, Any] | None, held: Held | None) -> Holding | None:
    """What a rank's snapshot (its state as `shard_form` made it, and its Held) holds; None: none, or a file
    of another form (a replicated state's)."""
    writer = None if state is None else state.get(WRITER)
    if held is None or not isinstance(writer, list) or len(writer) != 2:
        return None
    return Holding(held, int(writer[0]), int(writer[1]))


def choose_set(holdings: list[list[Holding]], committed: int | None) -> tuple[Held, list[int]] | None:
    """The set of snapshots the new group resumes from, and for each of its writer ranks the new rank that
    holds it; None: resume from the checkpoint. Pure.

    `holdings[r]` is what new rank r's snapshots hold (its own; with peer copies, peer_copy.py, a trade's two
    as well); `committed` the newest committed checkpoint's step. A set is the snapshots of one base, step and
    world size; it is whole where every writer rank below that world size is held. The newest whole set wins
    (base, then step, then world size), each writer rank held by the lowest new rank that holds it, unless it
    is older than `committed`.
    """
    sets: dict[tuple[int, int, int], dict[int, int]] = {}
    for new_rank, held in enumerate(holdings):
        for holds in held:
            if 0 <= holds.rank < holds.world:
                key = (holds.held.base, holds.held.step, holds.world)
                sets.setdefault(key, {}).setdefault(holds.rank, new_rank)
    whole = [key for key, by_rank in sets.items() if len(by_rank) == key[2]]
    if not whole:
        return None
    base, step, world = max(whole)
    if committed is not None and step < committed:
        return None
    by_rank = sets[(base, step, world)]
    return Held(base, step), [by_rank[rank] for rank in range(world)]


# -- the exchange ---------------------------------------------------------------------------------------


def _leaves(value: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Every leaf of a state with its path; a shard of `shard_form` is one leaf."""
    if isinstance(value, dict) and SHARD not in value:
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    else:
        yield path, value


def _overlap(one: Box, other: Box) -> Box | None:
    """The region two regions share, or None."""
    starts = tuple(max(a, b) for a, b in zip(one[0], other[0], strict=True))
    ends = tuple(min(a + n, b + m) for a, n, b, m in zip(one[0], one[1], other[0], other[1], strict=True))
    if any(end <= start for start, end in zip(starts, ends, strict=True)):
        return None
    return starts, tuple(end - start for start, end in zip(starts, ends, strict=True))


def _within(tensor: torch.Tensor, at: tuple[int, ...], region: Box) -> torch.Tensor:
    """The part of `tensor`, a region of the whole that starts at `at`, that is `region`."""
    index = tuple(slice(start - base, start - base + size) for start, size, base in zip(*region, at, strict=True))
    return tensor[index]


@dataclass(frozen=True)
class _Ask:
    """One region of one tensor that a new rank asks the holder of writer rank `writer` for."""

    writer: int
    path: Path_
    region: Box


def _asks(templates: dict[Path_, Any], boxes: dict[int, dict[Path_, tuple[Box, str]]], holders: list[int],
          me: int) -> list[_Ask] | str:  # fmt: skip
    """What this rank asks for (module docstring), given the leaves of its own state (`templates`), or why the
    snapshots do not make its state (a tensor none of them holds whole, another dtype: not this model's)."""
    asks: list[_Ask] = []
    for path, value in templates.items():
        if not isinstance(value, DTensor):
            continue
        mine = _box(value)
        dtype = str(value.dtype)
        seen: set[Box] = set()
        covered = 0
        writers = sorted(range(len(holders)), key=lambda writer: (holders[writer] != me, writer))
        for writer in writers:
            old = boxes[writer].get(path)
            if old is None or old[0] in seen:
                continue
            if old[1] != dtype:
                return f"{_name(path)} is {old[1]} in the snapshots, {dtype} here"
            seen.add(old[0])
            region = _overlap(mine, old[0])
            if region is not None:
                asks.append(_Ask(writer, path, region))
                covered += math.prod(region[1])
        if covered != math.prod(mine[1]):
            return f"the snapshots do not hold {_name(path)} whole"
    return asks


def _name(path: Path_) -> str:
    return ".".join(str(key) for key in path)


def reshard(
    group: dist.ProcessGroup,
    held: dict[int, dict[str, Any]],
    holders: list[int],
    template: Callable[[], dict[str, Any]],
) -> dict[str, Any] | None:
    """The state of the chosen set (`holders`, from `choose_set`) as this rank shards it: `template()` laid
    out as this group shards the model, each of its DTensors filled from the old shards (module docstring).
    `held` is the set's snapshots this rank holds for the set, by writer rank. Every rank of `group` calls it
    (gloo, whose ranks are the default group's); None on every rank where the snapshots do not make some
    rank's state, said in one line."""
    me = dist.get_rank(group)
    table: dict[int, dict[Path_, tuple[Box, str]]] = {
        writer: {path: ((tuple(leaf["offsets"]), tuple(leaf["sizes"])), str(leaf[SHARD].dtype))
                 for path, leaf in _leaves(state) if isinstance(leaf, dict)}
        for writer, state in held.items()
    }  # fmt: skip
    tables: list[dict[int, dict[Path_, tuple[Box, str]]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(tables, table, group=group)
    boxes = {writer: box for part in tables if part is not None for writer, box in part.items()}
    templates = dict(_leaves(template()))  # (its leaves, walked once)
    asks = _asks(templates, boxes, holders, me)
    every: list[list[_Ask] | str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, asks, group=group)
    refused = next((why for why in every if isinstance(why, str)), None)
    if refused is not None:
        if me == 0:
            log.warning("torchspot: not resuming from the shards' snapshots (%s)", refused)
        return None
    assert isinstance(asks, list)
    received = _trade(group, held, holders, every, templates)
    rest = [_without_shards(held[0]) if 0 in held else None]
    dist.broadcast_object_list(rest, group=group, group_src=holders[0])
    state: dict[str, Any] = _assembled(rest[0], templates, asks, [holders[ask.writer] for ask in asks], received)
    return state


def _trade(group: dist.ProcessGroup, held: dict[int, dict[str, Any]], holders: list[int],
           every: list[list[_Ask] | str | None], templates: dict[Path_, Any]) -> dict[int, torch.Tensor]:  # fmt: skip
    """Each holder's regions for each asker, as bytes, sent and received every pair at once: what this rank
    received, by holder (`templates`: the leaves of this rank's own state, which say each region's dtype)."""
    me = dist.get_rank(group)
    leaves = {writer: dict(_leaves(state)) for writer, state in held.items()}
    ops, received = [], {}
    for asker, asked in enumerate(every):
        assert isinstance(asked, list)
        pieces = [_within(leaves[ask.writer][ask.path][SHARD], tuple(leaves[ask.writer][ask.path]["offsets"]),
                          ask.region).contiguous().reshape(-1).view(torch.uint8)
                  for ask in asked if holders[ask.writer] == me]  # fmt: skip
        if pieces and asker != me:
            ops.append(dist.P2POp(dist.isend, torch.cat(pieces), group=group, group_peer=asker))
        elif pieces:
            received[me] = torch.cat(pieces)
    mine = every[me]
    assert isinstance(mine, list)
    sizes: dict[int, int] = {}
    for ask in mine:
        holder = holders[ask.writer]
        sizes[holder] = sizes.get(holder, 0) + math.prod(ask.region[1]) * templates[ask.path].dtype.itemsize
    for holder, size in sizes.items():
        if holder != me:
            received[holder] = torch.empty(size, dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, received[holder], group=group, group_peer=holder))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return received


def _without_shards(state: dict[str, Any]) -> Any:
    """A snapshot's state with its shards left out: what every rank takes as it is."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return None if SHARD in value else {key: strip(item) for key, item in value.items() if key != WRITER}
        if isinstance(value, list | tuple):
            return type(value)(strip(item) for item in value)
        return value

    return strip(state)


def _assembled(rest: Any, templates: dict[Path_, Any], asks: list[_Ask], holders: list[int],
               received: dict[int, torch.Tensor]) -> Any:  # fmt: skip
    """`rest` with each shard's place holding this rank's new shard: the regions `asks` asked for (from
    `holders`, one for each), read in order from each holder's bytes, as DTensors laid out as the leaves of
    this rank's own state (`templates`) are."""
    read = dict.fromkeys(received, 0)
    locals_: dict[Path_, torch.Tensor] = {}
    for ask, holder in zip(asks, holders, strict=True):
        like = templates[ask.path]
        at, sizes = _box(like)
        local = locals_.setdefault(ask.path, torch.empty(sizes, dtype=like.dtype))
        size = math.prod(ask.region[1]) * like.dtype.itemsize
        piece = received[holder][read[holder] : read[holder] + size].view(like.dtype)
        read[holder] += size
        _within(local, at, ask.region).copy_(piece.view(ask.region[1]))

    def place(value: Any, path: Path_) -> Any:
        if path in locals_:
            like = templates[path]
            return DTensor.from_local(locals_[path].to(like.device), like.device_mesh, like.placements,
                                      run_check=False, shape=like.shape, stride=like.stride())  # fmt: skip
        if isinstance(value, dict):
            return {key: place(item, (*path, key)) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(place(item, (*path, index)) for index, item in enumerate(value))
        return value

    return place(rest, ())


def resume_from(
    group: dist.ProcessGroup,
    mine: list[tuple[Held, dict[str, Any]]],
    template: Callable[[], dict[str, Any]],
    committed: Callable[[], int | None],
) -> dict[str, Any] | None:
    """The restart path's resume from the shards' snapshots, every rank of `group` alike: the newest whole set
    (`choose_set`; `committed()`, the newest committed checkpoint's step, read by rank 0 where any rank holds
    a snapshot), resharded over `group` (`reshard`). `mine` is this rank's snapshots (its own; a trade's
    copies). None on every rank where there is no such set, or it does not make this state: the caller reads
    the checkpoint."""
    readable = [(state, holding(state, held)) for held, state in mine]
    found = [(state, holds) for state, holds in readable if holds is not None]
    every: list[list[Holding] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, [holds for _, holds in found], group=group)
    choice: list[tuple[Held, list[int]] | None] = [None]
    if dist.get_rank(group) == 0 and any(every):
        choice[0] = choose_set([held or [] for held in every], committed())
    dist.broadcast_object_list(choice, group=group, group_src=0)
    if choice[0] is None:
        return None
    held, holders = choice[0]
    me = dist.get_rank(group)
    ours = {holds.rank: state for state, holds in found
            if holds.held == held and holds.world == len(holders) and holders[holds.rank] == me}  # fmt: skip
    state = reshard(group, ours, holders, template)
    if state is not None and me == 0:
        log.info("torchspot: resumed from the shards' snapshots of step %d, written by a world of %d, resharded "
                 "to a world of %d", held.step, len(holders), dist.get_world_size(group))  # fmt: skip
    return state
