"""The rules for an eviction notice at a step boundary (pure; the trainer acts on them).

Every step all ranks share their notice level (one tiny all-gather); any notice stops
the group at that boundary, and the lowest rank whose node leaves writes the emergency
checkpoint. The same agreement runs before every evaluation batch.
"""

from __future__ import annotations

import signal

from torchspot.trainer.eviction import Notice

EXIT_EVICTED = 128 + signal.SIGTERM
"""Exit code of a worker that stopped for SIGTERM after its emergency checkpoint."""
EXIT_FAILED = 1
"""Exit code of a worker whose training loop raised (a collective failed: a peer left)."""
NOTICE_RESTART = 1
NOTICE_LEAVING = 2
"""A rank's notice, all-gathered after every step: any notice stops the group at this boundary,
and the lowest leaving rank, if any, writes the emergency checkpoint (`emergency_saver`)."""


def emergency_saver(levels: list[int]) -> int | None:
    """The rank that writes the emergency checkpoint: the lowest one whose node leaves, or None
    when no node leaves (every notice is an agent's restart). Pure."""
    return next((rank for rank, level in enumerate(levels) if level >= NOTICE_LEAVING), None)


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
