"""Where a loop is in its step, and the step's deadline: the order the manager's calls come in.

A step goes idle -> begun (`start_step`: `optimizer.zero_grad()`) -> allowed (`should_commit` said yes:
`optimizer.step()` applies the update) -> idle again (`commit`), or from begun back to idle where its
update is refused. A call that comes out of that order raises ApiOrderError naming what to call first:
the loop's mistake is said where it is made, not found later as a step that never counts. A step that has
not committed within its deadline of its start ends the worker by the restart path (`overdue`): a
collective that never completes, or a loop that never calls `optimizer.step()`, must not hold the job's
nodes for ever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torchspot_trainer.elastic.settings import ApiOrderError

IDLE, BEGUN, ALLOWED = "idle", "begun", "allowed"


class StepOrder:
    """The step's phase (module docstring), whether its model ran forward, and the watcher of its
    deadline: `seconds` after `begin()`, unless it committed or was refused, `overdue(why)` is called (from
    the watcher's thread), the step's `number()` named."""

    def __init__(self, seconds: float, overdue: Callable[[str], object], *, number: Callable[[], int]) -> None:
        self.phase = IDLE
        self.seconds = seconds
        self.started = 0.0
        """When the step began (monotonic): its deadline is `seconds` later."""
        self.computed = False
        """Whether the step's model ran forward: a step whose update never comes had it skipped."""
        self.closed = False
        self._overdue, self._number = overdue, number
        threading.Thread(target=self._watch, name="torchspot-commit-watch", daemon=True).start()

    def check_begin(self) -> None:
        """Raise unless a step may begin now: not after `close()`, not while an allowed update is uncounted."""
        if self.closed:
            raise ApiOrderError("the manager was closed: no step after close()")
        if self.phase == ALLOWED:
            raise ApiOrderError("optimizer.step() was allowed but the manager was not told: call manager.commit()")

    def begin(self) -> None:
        """A step begins now: its deadline runs from here."""
        self.phase, self.computed, self.started = BEGUN, False, time.monotonic()

    def require(self, what: str) -> None:
        """Raise unless a step has begun and its update is not decided yet, naming `what` came too early."""
        if self.phase != BEGUN:
            raise ApiOrderError(f"{what} before the step began: call optimizer.zero_grad() (Manager.start_step) first")

    def require_between(self, what: str) -> None:
        """Raise unless the loop is between steps, naming `what`."""
        if self.phase != IDLE:
            raise ApiOrderError(
                f"{what} inside a step: call it between optimizer.step() and the next optimizer.zero_grad()"
            )

    def allow(self) -> None:
        """The step's update may be applied; the loop then says it was (`committed`)."""
        self.phase = ALLOWED

    def end(self) -> None:
        """The step is over without an update (refused), or the loop stops (`close`)."""
        self.phase = IDLE

    def committed(self) -> None:
        """The allowed update was applied: the step is over."""
        if self.phase != ALLOWED:
            raise ApiOrderError("commit() without a step allowed to commit: call should_commit() first")
        self.phase = IDLE

    def close(self) -> None:
        """No more steps: the watcher stops at its next look."""
        self.closed = True
        self.phase = IDLE

    def _watch(self) -> None:
        while not self.closed:
            time.sleep(min(1.0, self.seconds / 4))
            if self.phase != IDLE and time.monotonic() - self.started > self.seconds:
                self._overdue(
                    f"step {self._number()} did not commit within {self.seconds:g} s of its start (a collective "
                    "that never completed, or a loop that never called optimizer.step())"
                )
