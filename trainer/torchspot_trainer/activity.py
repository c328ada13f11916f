"""Whether a node's workers do anything: the operator's stall rule for a program that reports no steps.

The built-in trainer reports its step every minute (rendezvous/milestones.py); any other program
reports only its rounds, so a healthy script that trained for twice `stallTimeoutSeconds` without a
membership change was failed as Stalled. Its agent cannot see its steps, but it sees its workers'
processes: a worker that trains uses the CPU (its passes on a CPU; on a GPU its kernel launches, its
Python and its data loading), and one that waits in a collective whose peer never comes does not
(gloo's wait sleeps on a condition variable). So an agent reports `activity` while its workers, with
their children (data-loading processes), used at least ACTIVE_CPU_SHARE of a core between two looks.

What this cannot tell: a hang that burns the CPU (a wait that spins, a loop that never ends) reads
as activity. torch's NCCL watchdog, which the launcher leaves on for programs other than ours
(nccl.py), ends the first; nothing outside the program can tell the second from work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import psutil

ACTIVE_CPU_SHARE = 0.02
"""The CPU share of one core a node's workers must use between two looks to count as active: a worker
waiting in a gloo collective uses about none, one that trains tens of percent or more."""
LOOK_SECONDS = 5.0
"""Between an agent's looks at its workers' CPU time: a few /proc reads each."""


def cpu_seconds(pids: Iterable[int]) -> float:
    """The CPU seconds (user and system) the processes `pids` and their descendants used so far, with
    the children they have reaped; a process that ended counts nothing."""
    total = 0.0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
            for child in process.children(recursive=True):
                with_child = child.cpu_times()
                total += with_child.user + with_child.system
        except psutil.Error:  # it ended (or a child did) between the listing and the read
            continue
    return total


def active(used: float, seconds: float) -> bool:
    """Whether `used` CPU seconds over `seconds` of wall time is work (ACTIVE_CPU_SHARE). Pure."""
    return seconds > 0 and used >= ACTIVE_CPU_SHARE * seconds


class Activity:
    """An agent's looks at its workers' CPU time (module docstring).

    :param measure: the CPU seconds of a set of processes (`cpu_seconds`).
    :param clock: the monotonic clock the looks are spaced by.
    """

    def __init__(
        self,
        *,
        measure: Callable[[Iterable[int]], float] = cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        every: float = LOOK_SECONDS,
    ) -> None:
        self._measure = measure
        self._clock = clock
        self._every = every
        self._last: tuple[float, frozenset[int], float] | None = None

    def look(self, pids: Iterable[int]) -> bool | None:
        """Whether the workers `pids` were active since the last look (`active`), once LOOK_SECONDS have
        passed since it; None between looks, at the first, and where the workers changed meanwhile (a
        restart: their CPU time began again)."""
        now = self._clock()
        last = self._last
        if last is not None and now - last[0] < self._every:
            return None
        workers = frozenset(pids)
        used = self._measure(workers)
        self._last = (now, workers, used)
        if last is None or last[1] != workers or not workers:
            return None
        return active(used - last[2], now - last[0])
