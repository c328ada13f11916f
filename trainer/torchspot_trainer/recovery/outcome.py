"""How a collective of a live group ended (live.py), and the error a loop's collective raises where it did
not complete, in a module of their own: what posts collectives (buckets.py, the elastic manager, the
loop's collectives) reads them without importing the group that runs them."""

from __future__ import annotations

from enum import Enum

__all__ = ["GroupChanged", "Outcome"]


class Outcome(Enum):
    """How a collective ended: errors are flags, so a failed step is skipped, not raised through."""

    DONE = "done"
    FAILED = "failed"
    """A peer's socket closed (gloo raised) or the op timed out: the group is gone."""
    BROKEN = "broken"
    """The caller's `broken` event was set (a new assignment) or its deadline passed."""


class GroupChanged(RuntimeError):
    """A collective of the trainer's loop did not complete in its generation: a newer round came (the
    hand-over broke it), a peer's socket closed (`failed`), or its deadline passed. The loop re-forms
    in the next round instead of leaving (train.py)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(f"the group's collective ended {outcome.value}")
        self.failed = outcome is Outcome.FAILED
