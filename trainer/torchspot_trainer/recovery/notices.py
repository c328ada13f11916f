"""What the group does with an eviction notice at a step boundary: the rules (pure) and
`NoticeStop`, which carries them out.

Every step all ranks share their notice level (one tiny all-gather); any notice stops
the group at that boundary, and the lowest rank whose node leaves writes the emergency
checkpoint (or, when no node said it leaves there, the first rank of a node that learned it
just after: `saves_emergency`). The same agreement runs before every evaluation batch.

A notice belongs to a node: only one local rank polls Scheduled Events (the metadata
service allows about 5 requests/s per VM; 8 pollers would pass it), so a rank's level in
the agreement is the highest of its node's ranks (`node_levels`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from torchspot_trainer.checkpoint.manager import SaveReport
from torchspot_trainer.markers import agent_restarting, node_leaving
from torchspot_trainer.recovery.group import Group
from torchspot_trainer.recovery.signals import EvictionNotice, Notice, ScheduledEventsWatcher

log = logging.getLogger(__name__)

EXIT_EVICTED = 128 + signal.SIGTERM
"""Exit code of a worker that stopped for SIGTERM after its emergency checkpoint."""
EXIT_FAILED = 1
"""Exit code of a worker whose training loop raised (a collective failed: a peer left)."""
NOTICE_RESTART = 1
NOTICE_LEAVING = 2
"""A rank's notice, all-gathered after every step: any notice stops the group at this boundary,
and the lowest leaving rank, if any, writes the emergency checkpoint (`emergency_saver`)."""


class GroupBroken(RuntimeError):
    """A collective did not complete in time: a peer is frozen or gone (the agents re-form)."""


def emergency_saver(levels: list[int]) -> int | None:
    """The rank that writes the emergency checkpoint: the lowest one whose node leaves, or None
    when no node leaves (every notice is an agent's restart). Pure."""
    return next((rank for rank, level in enumerate(levels) if level >= NOTICE_LEAVING), None)


def saves_emergency(rank: int, rows: list[list[int]], *, leaving_now: bool) -> bool:
    """Whether `rank` writes the emergency checkpoint at a boundary whose all-gathered rows are `rows`
    (`rows[r]` is rank r's [level, node]). Pure.

    The agreed saver (`emergency_saver`) when there is one. Otherwise the first rank of a node that
    learned only after sharing its level that it leaves (`leaving_now`, its level read again): a notice
    can stop the group at a boundary where the leaving node still said 0. A CI run lost the emergency
    checkpoint so, by its logs: the other node's agent restarted its workers for our node's departure,
    one of its ranks reached the all-gather after that SIGTERM (its level 1), ours before theirs
    (level 0), and the group stopped there with no saver. Every rank then holds this boundary's state, so the one
    that learned late writes it; two nodes that both learn late write the same step twice.
    """
    saver = emergency_saver(node_levels(rows))
    if saver is not None:
        return rank == saver
    node = rows[rank][1]
    return leaving_now and rank == min(r for r, (_, n) in enumerate(rows) if n == node)


def node_levels(rows: list[list[int]]) -> list[int]:
    """Each rank's level as its node's: `rows[r]` is rank r's [level, node]. Pure."""
    highest: dict[int, int] = {}
    for level, node in rows:
        highest[node] = max(highest.get(node, 0), level)
    return [highest[node] for _, node in rows]


def notice_level(notice: Notice | None, *, restarting: bool, leaving: bool) -> int:
    """A rank's notice level at a step boundary. Pure.

    NOTICE_LEAVING when our agent has marked that the node leaves (`leaving`), notice or not:
    its SIGTERM may reach us after the other nodes have stopped for their restart, and then
    nobody would write the emergency checkpoint. Otherwise 0 without a notice, NOTICE_RESTART
    for our agent's SIGTERM to re-form the group (`restarting`: the node stays), and
    NOTICE_LEAVING for anything else (the node's eviction, a Scheduled Event).
    """
    if leaving:
        return NOTICE_LEAVING
    if notice is None:
        return 0
    if notice.source == "SIGTERM" and restarting:
        return NOTICE_RESTART
    return NOTICE_LEAVING


def waits_for_save(in_flight: int | None, kept: int | None, *, leaving: bool) -> bool:
    """Whether a worker leaving its group waits for its checkpoint save in flight (of step
    `in_flight`). Pure. Not when its node stays and the snapshot it kept holds that step or a newer
    one (`kept`): the next round resumes from the snapshot, and the wait only held back its agent's
    re-form (0-5 s of a recovery on a surviving rank 0). A node that leaves takes its snapshot with
    it, so its save still gets its chance."""
    if in_flight is None:
        return False
    return leaving or kept is None or kept < in_flight


def leave(code: int) -> NoReturn:
    """Exit now with `code`, our output flushed: no interpreter shutdown to wait on."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class NoticeStop:
    """Shares notices at each boundary and stops the group on one (`at_boundary`).

    :param notice: this worker's notice (SIGTERM, Scheduled Events).
    :param hold: seconds the staying ranks wait for the leaving node (--notice-hold).
    :param emit: the trainer's event output (`any_rank=True` for an event only this rank sees).
    :param keep_snapshot: leave this node's state for the next round (the trainer's snapshot).
    """

    def __init__(
        self,
        notice: EvictionNotice,
        *,
        hold: float,
        emit: Callable[..., None],
        keep_snapshot: Callable[[], None],
        node: int = 0,
        ping_timeout: float = 10.0,
    ) -> None:
        self.notice = notice
        self.hold = hold
        self.node = node
        """This rank's node in the group (torchrun's GROUP_RANK)."""
        self.ping_timeout = ping_timeout
        """Seconds a hold's ping may take before the group counts as broken (a peer gone)."""
        self.emit = emit
        self.keep_snapshot = keep_snapshot
        self.watcher: ScheduledEventsWatcher | None = None
        """The Scheduled Events poller, when on: its event is approved once the checkpoint is safe."""
        self.done_with_group: Callable[[], None] = lambda: None
        """Called on a leaving rank once the group has shared the notice, before its emergency
        checkpoint: in place, its agent may take the node out of the rendezvous then (handover.py)."""

    def level(self) -> int:
        """notice_level from our notice and our agent's markers (the restart marker is read only
        for a SIGTERM; the leaving marker at every boundary, a file check of microseconds)."""
        notice = self.notice.notice if self.notice.is_set() else None
        restarting = notice is not None and notice.source == "SIGTERM" and agent_restarting()
        return notice_level(notice, restarting=restarting, leaving=node_leaving())

    def row(self) -> list[int]:
        """This rank's line of the boundary's agreement: its notice level and its node."""
        return [self.level(), self.node]

    def at_boundary(self, group: Group, *, step: int, save: Callable[[], SaveReport] | None) -> bool:
        """Share every rank's notice level (all ranks call this at the same boundary); on any
        notice stop the group here (`stop`) and return True. `save` writes the emergency
        checkpoint of this boundary's state (None: no checkpoints in this run). In place on CPU the
        levels were shared with the step's gradients (`Group.boundary`): a notice that came after
        them is shared at the next boundary, as one that came during the agreement would be."""
        self.notice.step_boundary()
        rows = group.boundary(step, self.row)
        if self.notice.is_set():
            self.notice.acknowledged.set()
        if not any(node_levels(rows)):
            return False
        saves = saves_emergency(group.rank, rows, leaving_now=self.level() >= NOTICE_LEAVING)
        if saves and emergency_saver(node_levels(rows)) is None:
            log.warning("rank %d: our node leaves, learned after this boundary's agreement: it saves", group.rank)
        self.stop(group, step=step, save=save if saves else None)
        return True

    def stop(self, group: Group, *, step: int, save: Callable[[], SaveReport] | None) -> None:
        """Emergency checkpoint at this boundary, then leave (or hold) without training on.

        The saver (a leaving rank: its grace period covers it) writes the checkpoint to Blob;
        nobody does when every notice is an agent's restart (a node joins or a peer is lost, no
        node of ours leaves): each node's snapshot carries the state to the next round (a sharded
        state, which no snapshot holds, is written by every rank then too: elastic/saving.py). A rank
        that got its own SIGTERM, or whose agent marked its node leaving, leaves without waiting
        for the checkpoint (its snapshot holds the same step), so the nodes that stay re-form
        while the leaving one writes. In place, such a rank says so before it writes
        (`done_with_group`): the checkpoint needs no collective, and the others need not wait for it.
        """
        if self._leaving():
            self.done_with_group()
        if save is not None:
            report = save()
            self.emit({"event": "emergency_checkpoint", "step": step, "ok": report.ok, "rank": group.rank,
                       "seconds": round(report.seconds, 3)}, any_rank=True)  # fmt: skip
        notice = self.notice.notice
        if self._leaving():  # again: our agent may have marked the node leaving during the save
            self.keep_snapshot()  # the node may stay (torchrun restarting us for a new member)
            self.exit_evicted()
        self.notice.parked = True  # our agent's SIGTERM (the leaving node is gone) ends us at once
        if not group.agree(self.ping_timeout):  # everyone knows the checkpoint is committed
            raise GroupBroken(f"a rank did not reach the notice's barrier within {self.ping_timeout:.0f} s")
        if notice is not None and notice.event_id and self.watcher is not None:
            self.watcher.approve(notice.event_id)
        # Hold: ping the group until the evicted node is gone (the ping then fails, or does
        # not complete, and the agent re-forms the group), or until the hold passes (a false
        # alarm). Each ping is waited for on the host: on NCCL the call itself returns at once.
        deadline = time.monotonic() + self.hold
        while time.monotonic() < deadline:
            time.sleep(0.2)
            self.notice.step_boundary()
            if not group.ping(self.ping_timeout):
                raise GroupBroken(f"a peer did not answer the hold's ping within {self.ping_timeout:.0f} s")
            if self.notice.is_set() and self.notice.notice and self.notice.notice.source == "SIGTERM":
                self.keep_snapshot()
                self.exit_evicted()
        self.emit({"event": "notice_expired", "step": step, "held_s": self.hold})
        self.notice.parked = False
        self.notice.clear()

    def _leaving(self) -> bool:
        """Whether this rank's node leaves: its own SIGTERM, or its agent's mark."""
        notice = self.notice.notice
        return (notice is not None and notice.source == "SIGTERM") or node_leaving()

    def exit_evicted(self) -> NoReturn:
        """Leave at once after the emergency checkpoint; peers see our sockets close."""
        if self.watcher is not None:
            self.watcher.stop()
        leave(EXIT_EVICTED)
