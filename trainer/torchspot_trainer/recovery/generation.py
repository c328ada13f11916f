"""One generation's groups (recovery/live.py's module docstring says why each is so): their build on a
thread of its own (`Build`: gloo's constructor blocks until every rank has come, and a rank that moved on
to a newer round never comes), and what is left of them once a newer generation replaced them (`Grave`,
held until nothing of it can run; `close_connections`, where something still does).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore  # what torch.distributed re-exports

from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.planes import HostPlane, Parent

__all__ = ["DATA_PREFIX", "GRAVEYARD", "Build", "Grave", "Graveyard", "close_connections", "generation_prefix"]

CLOSE_TAG = 0x70_00_00_01
"""The tag of `close_connections`'s receive, which nobody sends on."""
CLOSE_WAIT = timedelta(milliseconds=1)
"""How long that receive is waited for: its timeout is what closes the group's connections."""
DATA_PREFIX = "data/"
"""Under `generation_prefix`: the keys of the generation's data group where it is a group of its own."""
GRAVEYARD = 8
"""Old groups held at most (each keeps its staging buffers until its zombie op ends, and is let go
once the op timeout has passed; one with no op abandoned in flight at once); beyond it a worker takes
the restart path instead of another re-form."""
REAP_SECONDS = 0.5
"""The longest the reaper sleeps while graves are held: a collective's end and a new grave wake it at
once; a data group's retirement and the op timeout's horizon are looked at so."""


def generation_prefix(assignment: Assignment) -> str:
    """The store keys of an assignment's group (pure): its round's, and within it its column's where a
    sharded run's columns each form a group of their own on the round's store (handover.column_of)."""
    column = f"column/{assignment.column}/" if assignment.column >= 0 else ""
    return f"generation/{assignment.generation}/{column}"


@dataclass
class Grave:
    """An old generation, held until nothing of it can run (`Graveyard._reap`)."""

    control: Any
    parent: Parent
    """Its data group, retired (aborted) by the next generation's build."""
    store: Any
    staging: dict[int, torch.Tensor]
    """Buffers a collective or send of it may still write or read, by id (LiveGroup's `_staging`)."""
    since: float
    closed: bool = False
    """Its connections were closed (`close_connections`) while a collective of it was in flight."""
    data: frozenset[int] = frozenset()
    """The ids of `staging`'s buffers that its data group's work uses (a device communicator's): let go
    once that group's abort has returned (`Graveyard._reap`), after which no kernel of it can run."""
    build: threading.Event | None = None
    """An abandoned group build's end (`Build.done`), where its communicator holds device memory: the
    grave stays until it ended."""


def close_connections(group: Any) -> None:
    """Close every connection of a gloo `group` that a generation left with collectives in flight.

    Freeing a gloo group closes its sockets, but not while a collective of it runs, and neither
    `abort()` nor `shutdown()` does anything for gloo (torch 2.13). A collective stuck on a peer
    that is gone would hold them until the op timeout (30 s), and its group's event loop may spin a
    core meanwhile (module docstring). A receive from a peer, waited for with a timeout, is the one
    door gloo leaves: its timeout makes the group's context signal every connection (gloo's
    "Application timeout caused pair closure"), each is closed, and every collective in flight fails
    at once. The peers still in that generation see their connections closed, as after a crash.
    Called on the reaper's thread (about 10 ms here). Where every connection failed already, nothing
    is left open to close."""
    rank, world = group.rank(), group.size()
    for peer in range(world):
        if peer == rank:
            continue
        try:
            work = group.recv([torch.zeros(1)], peer, CLOSE_TAG)
        except RuntimeError:  # this connection failed already: it is closed
            continue
        with contextlib.suppress(RuntimeError):  # the timeout: every connection of the group closed with it
            work.wait(CLOSE_WAIT)  # (it cannot complete: nobody sends on CLOSE_TAG)
        return


class Build:
    """One generation's group build on a thread of its own (gloo's constructor blocks until every rank
    has come): its store client, its gloo group, then its data plane's group. `done` is set when it
    ended either way; `result` then holds (control, data, store) or the exception. `abandoned`: the
    caller gave it up (what it makes after is ended, not used).

    :param connect: how long gloo's constructor waits for the other ranks (a deferred round's build
        waits for its joiners' set-up); the group's op timeout is `op_timeout` after that.
    :param on_done: called on the build's thread when it ended (given here: a build that fails at
        once may end before its caller could set anything on it).
    """

    def __init__(
        self,
        assignment: Assignment,
        plane: HostPlane,
        op_timeout: timedelta,
        parent: Parent | None,
        *,
        connect: timedelta | None = None,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.assignment = assignment
        self.parent = parent
        self.result: tuple[Any, Any, Any] | Exception | None = None
        self.done = threading.Event()
        self.abandoned = threading.Event()
        self.on_done = on_done
        self._communicator: Any = None
        """The data plane's communicator once made (`_made`), before its first collective."""
        self._ended = False
        """That communicator was aborted, here or by `abandon` (once)."""
        self._lock = threading.Lock()
        self._plane, self._op_timeout = plane, op_timeout
        self._connect = connect or op_timeout
        self.thread = threading.Thread(target=self._run, name=f"torchspot-group-{assignment.generation}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        assignment, plane, parent = self.assignment, self._plane, self.parent
        try:
            store = TCPStore(assignment.store_host, assignment.store_port, is_master=False, timeout=self._connect)
            prefixed = PrefixStore(generation_prefix(assignment), store)
            control = dist.ProcessGroupGloo(prefixed, assignment.rank, assignment.world, self._connect)
            if self._connect != self._op_timeout:
                control.set_timeout(self._op_timeout)
            data = plane.make(
                PrefixStore(DATA_PREFIX, prefixed), control, timeout=self._op_timeout, parent=parent,
                abandoned=self.abandoned, made=self._made,
            )  # fmt: skip
            if self.abandoned.is_set() and plane.separate:  # made too late: nobody will use or end it
                self._end(data)
            self.result = (control, data, store)
        except Exception as exc:  # the store went away, or a peer never came within the op timeout
            self.result = exc
            with self._lock:
                communicator = self._communicator
            if communicator is not None:  # made, then failed or given up: nobody will use it
                self._end(communicator)
        finally:
            if parent is not None:  # never made (the build failed first): retired all the same
                parent.retire()
            self.done.set()
            self.on_done()

    def _made(self, communicator: Any) -> None:
        """The data plane made its communicator (before its first collective, which waits for its init)."""
        with self._lock:
            self._communicator = communicator
        if self.abandoned.is_set():
            self._end(communicator)

    def _end(self, communicator: Any) -> None:
        """Abort the build's communicator, once, whoever asks first."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._plane.abort(communicator)

    def abandon(self) -> None:
        """Give the build up (a newer round, or the caller's deadline). A communicator already made is
        aborted from here, on a thread of its own: the build's own thread may wait in C++ for the init
        of a non-blocking communicator whose peer never comes (its first collective), out of reach of
        `abandoned` until the nonblocking timeout (planes.py's `generation_environment`)."""
        self.abandoned.set()
        if self.parent is not None:  # no later build shrinks it: its abort need not wait for this one
            self.parent.retire()
        with self._lock:
            communicator = None if self._ended else self._communicator
        if communicator is not None:
            threading.Thread(
                target=self._end, args=(communicator,), name="torchspot-abandon", daemon=True
            ).start()  # fmt: skip


class Graveyard:
    """The old generations a worker holds until nothing of them can run (live.py's module docstring: an old
    group's destructor blocks while a zombie op is pending, and a dead generation's loop may spin), and
    the reaper thread that lets them go, never on the training thread.

    :param op_timeout: gloo's own timeout for an op: how long a zombie op lives (and so a grave).
    """

    def __init__(self, op_timeout: timedelta) -> None:
        self.op_timeout = op_timeout
        self._graves: list[Grave] = []
        self._lock = threading.Lock()
        """Guards `_graves`, which the reaper thread empties beside the training thread's re-forms."""
        self._wake = threading.Event()
        self._reaper: threading.Thread | None = None
        """Runs while graves are held (`dig`, `_reaping`)."""

    def wake(self) -> None:
        """Have the reaper look now (a collective of an old generation ended, or its data group retired)."""
        self._wake.set()

    def dig(self, grave: Grave) -> None:
        """Hold `grave` until no op of it can run, and have the reaper look at once: a generation left
        after a peer died may already be free to go, and until it goes its loop may spin. The reaper
        thread runs while graves are held."""
        with self._lock:
            self._graves.append(grave)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reaping, name="torchspot-reaper", daemon=True)
                self._reaper.start()
        self._wake.set()

    def held(self) -> list[Grave]:
        """The graves still held, after letting go of those that may go (`_reap`)."""
        with self._lock:
            self._reap()
            return list(self._graves)

    def count(self) -> int:
        """Old groups held (for tests and logs)."""
        with self._lock:
            return len(self._graves)

    def retiring(self) -> int:
        """Old data groups whose abort has not returned yet (for tests and logs)."""
        with self._lock:
            return sum(not grave.parent.retired.is_set() for grave in self._graves)

    def _reaping(self) -> None:
        """The reaper: `_reap` whenever a collective ends or a grave is dug, and every REAP_SECONDS,
        until the graveyard is empty; a grave with a collective still in flight has its connections
        closed first (`close_connections`), so that collective fails and the grave goes: a dead
        generation left for the next re-form's look spins its loop on a core meanwhile, which the
        survivors' training pays for."""
        while True:
            self._wake.wait(REAP_SECONDS)
            self._wake.clear()  # before the look: a wake during it is not lost
            with self._lock:
                self._reap()
                if not self._graves:
                    self._reaper = None
                    return
                closing = [grave for grave in self._graves if grave.staging and not grave.closed]
                for grave in closing:
                    grave.closed = True
            for grave in closing:  # outside the lock: a re-form's look does not wait for it
                close_connections(grave.control)  # (a generation's gloo group: a buried build holds no staging)

    def _reap(self) -> None:
        """Let go, on a thread of their own, of the graves no op of which can still run: those whose
        data group's abort has returned and that are older than the op timeout (their zombie ops have
        timed out by then) or have no collective abandoned in flight (no staging copy held: each is
        released when its op completes). A destructor that still blocks blocks nobody who trains.
        Without the second kind, frequent faults fill the graveyard with idle groups within the op
        timeout, and the worker falls back to a restart. A device communicator's copies (which no
        callback lets go) go once its abort returned, for the same reason. An abandoned build of a
        device communicator stays until its thread ended. Called with `_lock` held."""
        horizon = time.monotonic() - self.op_timeout.total_seconds()
        old: list[Grave] = []
        kept: list[Grave] = []
        for grave in self._graves:
            if grave.parent.retired.is_set():  # its device communicator's abort returned: no kernel writes now
                for key in grave.data:
                    grave.staging.pop(key, None)
            built = grave.build is None or grave.build.is_set()
            done = built and grave.parent.retired.is_set() and (grave.since < horizon or not grave.staging)
            (old if done else kept).append(grave)
        if old:
            self._graves = kept
            threading.Thread(target=old.clear, name="torchspot-release", daemon=True).start()
