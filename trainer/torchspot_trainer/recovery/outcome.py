"""How a collective of a live group ended (live.py), in a module of its own: what posts collectives
(buckets.py, the elastic manager) reads it without importing the group that runs them."""

from __future__ import annotations

from enum import Enum

__all__ = ["Outcome"]


class Outcome(Enum):
    """How a collective ended: errors are flags, so a failed step is skipped, not raised through."""

    DONE = "done"
    FAILED = "failed"
    """A peer's socket closed (gloo raised) or the op timed out: the group is gone."""
    BROKEN = "broken"
    """The caller's `broken` event was set (a new assignment) or its deadline passed."""
