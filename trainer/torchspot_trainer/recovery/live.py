"""A worker's process group rebuilt in place at a membership change: the group mechanics of recovery without
a restart, which the recovery API's manager (elastic/manager.py) and the lab's toy run on. Built and tested
on CPU with gloo; the NCCL decisions by NCCL's documented semantics.

At a membership change the agent hands the live workers an `Assignment` (the round, their new rank and
world, the round's store); each drops its group and builds the next one on the new store. What gloo does,
and how this module answers each:

- **An abandoned collective completes when a frozen peer thaws, into whatever buffer it was given**:
  every collective runs on a *staging copy*, copied back only if it completed in time.
- **Nothing cancels a gloo collective blocked on a frozen peer**: the calling thread never blocks in one;
  it waits for the work's completion against a deadline and the `broken` event (set by whoever learns of
  a new assignment), and reports how it ended as an `Outcome`, never by hanging.
- **An old group's destructor blocks while a zombie op is pending**: old groups go to a *graveyard*,
  never freed on the training thread; a reaper thread lets each go once nothing of it can run, and at most
  `GRAVEYARD` are held before the worker takes the restart path.
- **A group whose peer died can spin its event loop until its sockets close**, and nothing closes them
  while a collective runs: the reaper closes a grave's connections first (generation.close_connections),
  which fails what runs, so a zombie never writes at all.
- **gloo's constructor blocks until every rank has come**: a group is built on a thread of its own
  (generation.Build), abandoned when a newer round arrives first.
- **One TCPStore client serialises every thread that shares it**: each generation has its own, used only
  by the thread that builds the group.

On GPUs a generation has two groups: the gloo one for the agreements (`control=True`) and an NCCL
communicator for the gradients and a heal's state, made, aborted and probed by its data plane (planes.py,
which says how NCCL differs). On CPU the gloo group carries both.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.generation import GRAVEYARD, Build, Grave, Graveyard
from torchspot_trainer.recovery.group import nccl_environment
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome
from torchspot_trainer.recovery.planes import HostPlane, Parent, generation_environment, plane_for
from torchspot_trainer.recovery.resume import newest

log = logging.getLogger(__name__)

OP_TIMEOUT = timedelta(seconds=30)
"""A generation's op timeout (`LiveGroup`'s default): how long gloo lets a collective with a frozen peer
run, and an NCCL communicator's non-blocking calls wait (planes.py's `generation_environment`)."""
READY_SECONDS = 30.0
"""The most a deferred join waits for its joiners to be ready (`LiveGroup.offer`) before the current
generation switches anyway: a joiner that never gets there is then waited for by the group build's
deadline, and replaced by its agent's next round."""
POLL_SECONDS = 0.001
"""Between looks at a device collective's completion (a host one wakes its waiter: `LiveGroup._wait`):
a gloo all-reduce of a toy's gradient takes about a millisecond here, and a look costs microseconds."""
WAKE_SECONDS = 0.005
"""The longest a wait on a host collective sleeps without a look at its deadline (its completion and a
newer round wake it at once: `LiveGroup._wait`)."""
SEND_SETTLED = timedelta(milliseconds=50)
"""How long `_settle_sends` waits for a send it expects ended (a positive timeout: gloo's wait takes
zero for none)."""


class LiveGroup:
    """The current generation's groups, its re-forms, and its graveyard (module docstring).

    :param op_timeout: gloo's own timeout for an op: how long a zombie op lives (and so a grave).
    :param plane: where the generation's data travel (planes.py): the gloo group itself by default.
    """

    def __init__(
        self,
        op_timeout: timedelta = OP_TIMEOUT,
        *,
        defer_joins: bool = False,
        plane: HostPlane | None = None,
    ) -> None:
        self.op_timeout = op_timeout
        self.plane = plane or HostPlane()
        self.defer_joins = defer_joins
        """Train on in the current generation while a round that adds ranks waits for them (`offer`)."""
        self.assignment: Assignment | None = None
        self.broken = threading.Event()
        self.joiners_ready = threading.Event()
        """Set when a deferred round's group formed (its newcomers came), or READY_SECONDS passed: the
        caller's loop agrees on a boundary to switch at (`LiveCollectives.gather_ints`)."""
        self._pending: Assignment | None = None
        self._prebuilt: Build | None = None
        """The deferred round's group, built while the current generation trains on (`offer`)."""
        self._lock = threading.Lock()
        self._announced = -1
        """The newest generation `supersede` was told of."""
        self._group: Any = None
        """The generation's gloo group: its agreements, and its data too unless the plane has its own."""
        self._data: Any = None
        self._clean = True
        """No work of the data group abandoned in flight or failed (a shrink may then go without abort)."""
        self._store: Any = None
        self.graveyard = Graveyard(op_timeout)
        self._sending: list[tuple[Any, torch.Tensor]] = []
        """Sends posted and not yet seen ended (`post_send`), each with its buffer."""
        self._data_held: set[int] = set()
        """The ids of the generation's staging copies that a device communicator's work uses (`_hold`)."""
        self._staging: dict[int, torch.Tensor] = {}
        """The generation's staging copies and send buffers in use, by id: a dict, whose setting and
        popping of one key are atomic, because a heal's receiving thread uses it beside the training
        thread (`StateArrival`), and a list's removal compares tensors with `==`."""
        self.retirements = 0
        """Old data groups handed to the plane to retire (for tests and logs)."""
        self.probes = 0
        """Device probes run after a re-form from a generation whose data group had work in flight."""
        self._owed_probe = False
        """A data group was retired with work in flight and no generation has formed since."""
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchspot-send")
        self._sender.submit(lambda: None)  # its thread started now: a start waits for the new thread to run,
        # which at a heal on busy cores the source would pay (`send_beside`)
        self._waking: threading.Event | None = None
        """What wakes the host collective being waited for (`_wait`): set by its completion, and by
        `supersede` with `broken`."""
        self._breakers: list[Callable[[], None]] = []
        """Called (on the watcher's thread) each time `supersede` breaks a generation (`when_broken`)."""

    @property
    def rank(self) -> int:
        return self._require().rank

    @property
    def world(self) -> int:
        return self._require().world

    @property
    def generation(self) -> int:
        """The round last entered (-1 before the first): the next assignment must be newer, whether
        this one's group formed or not."""
        return -1 if self.assignment is None else self.assignment.generation

    def reconfigure(self, assignment: Assignment, deadline: float) -> bool:
        """Leave the current group for `assignment`'s: the old one goes to the graveyard, the new one
        is built on the round's store under `generation/<g>/` (a key of an older round is never read).

        The build runs on a thread of its own (gloo's constructor blocks until every rank has come, up
        to the op timeout) and is abandoned when `broken` is set (a newer round) or the `deadline`
        passes; it fails when the round's store is gone (its agent moved on to a newer round). Either
        way this returns False and the caller waits for the next assignment. Raises RuntimeError when
        the graveyard is full, when an old data group's abort has hung, or when the device fails its
        probe after an abort of work in flight (the caller takes the restart path)."""
        parent = self._leave()
        with self._lock:  # against a watcher's `supersede` judging by the assignment being replaced
            self._group = self._data = self._store = None
            self.assignment = assignment
            self._pending = None
            self.joiners_ready.clear()
            if self._announced > assignment.generation:  # a newer round was seen already: skip this one
                self.broken.set()
            else:
                self.broken.clear()
        build = self._take_prebuilt(assignment)
        if build is None:
            build = Build(assignment, self.plane, self.op_timeout, parent)
        elif parent is not None:  # built beside it while it trained on (a join: nothing to shrink)
            parent.retire()
        while not build.done.wait(POLL_SECONDS * 5):
            if self.broken.is_set() or time.monotonic() > deadline:
                build.abandon()
                self._bury(build)  # it ends within the op timeout; what it built is dropped
                log.warning("generation %d: group not formed (a newer round, or the deadline)", assignment.generation)
                return False
        outcome = build.result
        if outcome is None or isinstance(outcome, Exception):
            log.warning("generation %d: group not formed (%s)", assignment.generation, outcome)
            return False
        if self._owed_probe:  # after the build, which the old communicator's abort overlapped
            self.probes += 1
            if not self.plane.healthy():
                raise RuntimeError("the device failed its probe after an abort: restart")
            self._owed_probe = False
        with self._lock:  # `offer` defers a join only for a generation that formed
            self._group, self._data, self._store = outcome
        return True

    def _leave(self) -> Parent | None:
        """The current generation to the graveyard (its data group handed on as the next build's
        `Parent`); raises RuntimeError where `reconfigure` says."""
        held = self.graveyard.held()
        if len(held) >= GRAVEYARD:
            raise RuntimeError(f"{GRAVEYARD} old groups still held: restart instead of another re-form")
        now = time.monotonic()
        if any(grave.parent.stuck(now) for grave in held):
            raise RuntimeError("an old communicator's abort has not returned: restart instead of another re-form")
        parent = None
        if self._group is not None:
            previous = self._require()
            parent = Parent(
                self._data if self.plane.separate else None, previous.generation, previous.rank, previous.world,
                clean=self._clean, abort=self.plane.abort, on_retired=self.graveyard.wake,
            )  # fmt: skip
            grave = Grave(self._group, parent, self._store, self._staging, now, data=frozenset(self._data_held))
            self.graveyard.dig(grave)
            self.retirements += parent.group is not None
            self._owed_probe = self._owed_probe or (parent.group is not None and not parent.clean)
        self._staging, self._sending, self._data_held = {}, [], set()
        self._clean = True
        return parent

    def heal(self, committed: int, state: torch.Tensor, deadline: float) -> int | None:
        """At a generation's start: agree on the newest committed step and give every rank `state` (in
        place) from the lowest rank that holds it, so a rank that lost an update the others committed,
        a joiner or a restarted worker goes on from the same state. The newest step, or None if the
        group failed (the caller waits for the next round)."""
        rows = self.agree([float(committed)], deadline)
        if rows is None:
            return None
        step, source = newest(rows)
        if self.broadcast(state, source, deadline) is not Outcome.DONE:
            return None
        return step

    def supersede(self, generation: int) -> None:
        """Break the current generation if `generation` is newer (the hand-over's watcher thread). Judged
        under the lock `reconfigure` replaces the assignment under: a watcher that read the generation
        being replaced would otherwise break the new one, which its peers are forming (the abandoned
        group's sockets would close under them, and no newer round would come).
        Remembered: a `reconfigure` for an older generation than one seen here gives it up at once
        (otherwise its build would wait its deadline for peers that moved on)."""
        with self._lock:
            self._announced = max(self._announced, generation)
            breaking = self.assignment is None or generation > self.assignment.generation
            if breaking:
                self.broken.set()
                waking = self._waking
                if waking is not None:
                    waking.set()
        if breaking:
            for breaker in self._breakers:
                breaker()

    def when_broken(self, breaker: Callable[[], None]) -> None:
        """Call `breaker` whenever `supersede` breaks the current generation, on the caller's thread (the
        watcher's), after `broken` is set: for collectives whose end is told (`post_told`), not waited for."""
        self._breakers.append(breaker)

    def offer(self, assignment: Assignment) -> None:
        """A newer round, from the hand-over's watcher thread. Normally `supersede`. With `defer_joins`,
        a round that only grows the world (its agent says it kept every member: `Assignment.grows`; by
        the sizes alone a round that lost a frozen member and gained two was deferred, and the loop
        waited in the frozen member's collective for its timeout) is deferred: the loop trains on in the
        current generation while the newcomers start and set up. The round's group is built meanwhile, on
        a thread of its own (gloo's constructor waits for the joiners without the GIL), and `joiners_ready` is set once
        it formed (every joiner came) or after READY_SECONDS; `reconfigure` then takes it as built. So
        the others pause only for the state's transfer, not for a joiner's start-up nor for the
        group's connections. A second newer round while one is deferred supersedes at once, and so does
        a round that comes while the current generation's group is still being built: that build waits
        for ranks that moved on to the newer round, until its deadline. So does a round that does not
        follow the current generation directly: this node missed the rounds between (it was frozen,
        and has just thawed), so its generation is gone, and training on in it would wait in a
        collective for gloo's op timeout."""
        with self._lock:
            current = self.assignment
            deferred = (
                self.defer_joins
                and current is not None
                and self._group is not None  # a generation still being built has nothing to train on
                and self._pending is None
                and not self.broken.is_set()
                and assignment.generation == current.generation + 1  # a later one: this node missed rounds
                and assignment.world > current.world
                and assignment.grows  # every member kept (its agent knows; the sizes cannot tell)
            )
            if deferred:
                self._pending = assignment
        if not deferred:
            self.supersede(assignment.generation)
            return
        build = Build(
            assignment, self.plane, self.op_timeout, None, connect=self.op_timeout + timedelta(seconds=READY_SECONDS),
            on_done=lambda: self._ready(assignment),
        )  # fmt: skip
        with self._lock:
            self._prebuilt, previous = build, self._prebuilt
        if previous is not None:
            previous.abandon()
        timer = threading.Timer(READY_SECONDS, self._ready, args=(assignment,))
        timer.daemon = True
        timer.start()

    def _ready(self, assignment: Assignment) -> None:
        """The deferred round's group formed (its joiners came: they were the ranks it waited for), or
        READY_SECONDS passed: the loop switches at its next boundary."""
        with self._lock:
            if self._pending is assignment:
                self.joiners_ready.set()

    def _take_prebuilt(self, assignment: Assignment) -> Build | None:
        """The build `offer` started for `assignment`'s generation, if any; one for another is given up."""
        with self._lock:
            build, self._prebuilt = self._prebuilt, None
        if build is not None and build.assignment != assignment:
            build.abandon()
            self._bury(build)
            return None
        return build

    def _bury(self, build: Build) -> None:
        """An abandoned group build: held like a generation's grave (nothing of it to retire); where the
        plane's communicator holds device memory, until the build ended (its abort: `Build.abandon`),
        so that GRAVEYARD bounds them too."""
        parent = Parent(None, self.generation, -1, 0, clean=True, abort=None)
        parent.retire()
        ends = build.done if self.plane.separate else None
        self.graveyard.dig(Grave(build.thread, parent, None, {}, time.monotonic(), build=ends))

    def all_reduce(self, tensor: torch.Tensor, deadline: float, *, control: bool = False) -> Outcome:
        """Sum `tensor` over the group, in place, through a staging copy (module docstring); the
        tensor is unchanged unless the outcome is DONE. `deadline` is a `time.monotonic()` time.
        `control`: on the gloo group (a host tensor: an agreement), else on the data plane's."""
        staging = tensor.detach().clone()
        group = self._pick(control)
        work = self._enqueue(group, lambda: group.allreduce([staging]))
        if work is None:
            return Outcome.FAILED
        self._hold(group, work, staging)
        outcome = self._wait(group, work, staging, deadline)
        if outcome is Outcome.DONE:
            tensor.copy_(staging)
            if self._sending and group is self._data:
                self._settle_sends()
        return outcome

    def _enqueue(self, group: Any, call: Callable[[], Any]) -> Any:
        """`call`'s work (a collective or a send of `group`, started), or None where starting it raised:
        a communicator that recorded an error refuses new work at once (NCCL: DistBackendError), as a
        gloo pair whose connection closed refuses a send. The group is gone, as if the work had failed:
        the caller says FAILED and re-forms, where the error escaped and restarted every local worker."""
        try:
            return call()
        except RuntimeError as exc:
            log.warning("generation %s: a collective could not start (%s)", self.generation, str(exc).splitlines()[0])
            self._clean = self._clean and not (self.plane.separate and group is self._data)
            return None

    def post(self, tensor: torch.Tensor, *, control: bool, owned: bool = False) -> Callable[[float], Outcome]:
        """`all_reduce` started now and waited for later: the returned function waits (given the
        deadline) and writes the sum into `tensor` if it completed. A step's gradient buckets so run beside
        its backward pass (elastic/buckets.py). Waited for after the generation was left, it says BROKEN (the
        staging copy is held with that generation's grave until the collective ends: `_hold`). It
        does not let a heal's sends go
        (`_settle_sends`): their receivers may not have them yet.

        `owned`: the caller gives `tensor` to the collective (it never reads or writes it again unless
        the outcome is DONE), so it is its own staging copy: no copy of a gradient bucket's 25 MiB."""
        staging = tensor if owned else tensor.detach().clone()
        group = self._pick(control)
        held = self._staging
        work = self._enqueue(group, lambda: group.allreduce([staging]))
        if work is None:
            return lambda _deadline: Outcome.FAILED
        self._hold(group, work, staging)

        def finish(deadline: float) -> Outcome:
            if held is not self._staging:  # left for a newer generation meanwhile
                return Outcome.BROKEN
            outcome = self._wait(group, work, staging, deadline)
            if outcome is Outcome.DONE and staging is not tensor:
                tensor.copy_(staging)
            return outcome

        return finish

    def post_told(self, tensor: torch.Tensor, on_end: Callable[[Outcome], None]) -> None:
        """`post` of a tensor the caller gives to the collective (`owned`), on a generation whose data
        travel on its gloo group, whose end is told instead of waited for: `on_end(DONE)` or
        `on_end(FAILED)` on gloo's thread as it ends (at once where it cannot start). No thread of
        the caller's waits, so a step's gradient bucket completes as DDP's own does (a waiting thread
        per bucket would cost a small model's steps more than the all-reduce). A
        collective that a newer round leaves hanging is the caller's to give up (`when_broken`).
        Not on a device plane, whose future may complete as its work is queued (planes.py): `post`."""
        if self.plane.separate:
            raise ValueError("post_told is for a generation whose data travel on its gloo group: use post")
        group = self._pick(False)
        work = self._enqueue(group, lambda: group.allreduce([tensor]))
        if work is None:
            on_end(Outcome.FAILED)
            return
        generation = self.generation

        def ended(future: Any) -> None:
            try:
                future.wait()
            except RuntimeError as exc:  # gloo: a peer's connection closed, or the op timed out
                log.warning("generation %s: collective failed (%s)", generation, str(exc).splitlines()[0])
                on_end(Outcome.FAILED)
                return
            on_end(Outcome.DONE)

        self._hold(group, work, tensor, then=ended)

    def broadcast(self, tensor: torch.Tensor, src: int, deadline: float) -> Outcome:
        """`tensor` from rank `src` to every rank, through a staging copy, on the data plane's group,
        as `all_reduce`."""
        staging = tensor.detach().clone()
        options = dist.BroadcastOptions()
        options.rootRank = src
        group = self._pick(False)
        work = self._enqueue(group, lambda: group.broadcast([staging], options))
        if work is None:
            return Outcome.FAILED
        self._hold(group, work, staging)
        outcome = self._wait(group, work, staging, deadline)
        if outcome is Outcome.DONE:
            tensor.copy_(staging)
        return outcome

    def post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Send `tensor` to rank `dst` on the data plane's group without waiting: the caller goes on
        (a heal's source trains while its state travels). The tensor is the send's from now on (the
        caller passes one it does not write again, one per send) and is held with the generation,
        like a staging copy, until the send is seen ended. Gloo matches it to the receiver's receive
        of the same `tag` (transfer.StateArrival).

        A gloo send's work reports completion only to `wait()` (its `is_completed()` stays False until
        then; so does a receive's), and the data flow whoever waits. A receiver takes part in the next
        collective only once it received the state (elastic/heal.py's `before_collective`), so when that collective
        completes here every send has: `all_reduce` then lets their buffers go (`_settle_sends`). Here,
        not on a thread per send: starting one cost the source milliseconds on busy cores. Raises
        GroupChanged (failed) where the send cannot start (`_enqueue`)."""
        group = self._pick(False)
        work = self._enqueue(group, lambda: group.send([tensor], dst, tag))
        if work is None:  # the receiver's connection is gone: so is the generation
            raise GroupChanged(Outcome.FAILED)
        self._staging[id(tensor)] = tensor
        self._sending.append((work, tensor))

    def on_sending_thread(self, send: Callable[[], None]) -> Future[None]:
        """Run `send` (a heal's sends: transfer.send_beside) on this group's sending thread, beside the
        caller's passes. The caller waits for the future before the generation's next collective, so
        the sends and staging are only ever touched by one thread at a time."""
        return self._sender.submit(send)

    def receiving(self) -> tuple[Any, dict[int, torch.Tensor]]:
        """The current generation's data group, and the staging its receive buffers are held in: what a
        receive on a thread of its own uses (transfer.StateArrival)."""
        return self._pick(False), self._staging

    def _settle_sends(self) -> None:
        """After a completed collective of every rank: the sends' buffers let go (`post_send`); one not
        ended after all (it cannot happen as the trainer uses them) stays held with the generation."""
        sending, self._sending = self._sending, []
        for work, tensor in sending:
            try:
                work.wait(SEND_SETTLED)
            except RuntimeError as exc:
                log.warning("generation %s: a send had not ended (%s)", self.generation, exc)
                continue
            self._staging.pop(id(tensor), None)

    def agree(self, row: list[float], deadline: float) -> list[list[float]] | None:
        """Every rank's `row` (the same length on every rank), by rank; None if the group failed.
        One all-reduce of a world x len(row) table in which each rank fills its own line, on the
        gloo group."""
        table = torch.zeros(self.world, len(row), dtype=torch.float64)
        table[self.rank] = torch.tensor(row, dtype=torch.float64)
        if self.all_reduce(table, deadline, control=True) is not Outcome.DONE:
            return None
        return [[float(value) for value in line] for line in table.tolist()]

    def graves(self) -> int:
        """Old groups held (for tests and logs)."""
        return self.graveyard.count()

    def retiring(self) -> int:
        """Old data groups whose abort has not returned yet (for tests and logs)."""
        return self.graveyard.retiring()

    def _hold(self, group: Any, work: Any, staging: torch.Tensor, then: Callable[[Any], None] | None = None) -> None:
        """Hold `staging`, which `work` writes into, with the generation while a zombie may still
        write: a host (gloo) collective lets it go itself as it ends, completed or failed (its
        future's callback), whether or not anyone waits for it. So a grave whose collectives have
        all ended is let go as the last one ends (its callback wakes the reaper). A step's gradient
        buckets are posted and then not waited for when the step breaks first (a peer killed: the
        update's all-reduce fails before them); held until the op timeout, their copies would keep
        frequent faults' generations in the graveyard until a worker falls back to a restart. A device
        communicator's future may complete as its work is queued (planes.py): its copies go when
        `_wait` sees the work end, or with the grave. `then(future)`: called
        after, on the same thread (a host collective only: `post_told`)."""
        key = id(staging)
        held = self._staging
        held[key] = staging
        if self.plane.separate and group is self._data:
            self._data_held.add(key)
            return

        def ended(future: Any) -> None:
            if held.get(key) is staging:  # (this closure keeps `staging`, so its id names no other tensor)
                held.pop(key, None)  # (`_wait` may pop it meanwhile)
            if not held and held is not self._staging:  # its generation's last: the grave may go now
                self.graveyard.wake()
            if then is not None:  # (one callback: each takes the GIL on gloo's thread)
                then(future)

        work.get_future().add_done_callback(ended)

    def _wait(self, group: Any, work: Any, staging: torch.Tensor, deadline: float) -> Outcome:
        held = self._staging  # `staging` is held (`_hold`) until its collective has ended
        data = self.plane.separate and group is self._data
        if not (self._awaited(work, deadline) if not data else self._polled(work, deadline)):
            self._clean = self._clean and not data
            return Outcome.BROKEN
        try:
            work.wait()
            failure = "the communicator reports an error" if data and self.plane.failed(group) else None
        except RuntimeError as exc:  # gloo: a peer's connection closed, or the op timed out
            failure = str(exc)
        if failure is not None:
            log.warning("generation %s: collective failed (%s)", self.generation, failure)
            held.pop(id(staging), None)  # the op has ended, in error: nothing writes into the copy later
            self._clean = self._clean and not data
            return Outcome.FAILED
        held.pop(id(staging), None)
        return Outcome.DONE

    def _awaited(self, work: Any, deadline: float) -> bool:
        """Wait for a host (gloo) collective's `work`; False when `broken` was set or the deadline
        passed first. Woken by its future's completion, not by polling: a poll's sleep added about a
        millisecond to every collective (two a step), and each look took a slice of the cores the
        other ranks were computing on. The future completes (an error too) before the work reports
        it, so the caller's `wait()` may block for the microseconds in between."""
        future = work.get_future()
        waking = threading.Event()
        self._waking = waking
        future.add_done_callback(lambda _done: waking.set())
        while not future.done():
            if self.broken.is_set():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            waking.wait(min(left, WAKE_SECONDS))
        return True

    def _polled(self, work: Any, deadline: float) -> bool:
        """`_awaited` for a device communicator's work, whose future NCCL may complete as the work is
        queued on its stream (planes.py): its completion is looked at every POLL_SECONDS instead."""
        while not work.is_completed():
            if self.broken.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    def _require(self) -> Assignment:
        if self.assignment is None:
            raise RuntimeError("no generation yet: call reconfigure first")
        return self.assignment

    def _pick(self, control: bool) -> Any:
        self._require()
        return self._group if control else self._data


def in_place_groups(device: torch.device) -> LiveGroup:
    """A worker's groups in place, one per round its agent hands over, joins deferred while the current
    generation trains on, its data on `device`'s plane (planes.py). On a GPU the environment every
    generation's NCCL communicator reads is set first (group.nccl_environment, with the generations' op
    timeout), so it must be made before the first generation forms. The trainer's in-place path and
    the API's manager make theirs here."""
    if device.type == "cuda":
        os.environ.update(nccl_environment(os.environ))
        os.environ.update(generation_environment(os.environ, OP_TIMEOUT))
    return LiveGroup(defer_joins=True, plane=plane_for(device))


def wait_for_assignment(read: Callable[[], Assignment | None], after: int, deadline: float) -> Assignment | None:
    """Poll `read` until it returns an assignment of a generation newer than `after`, or None at the
    deadline (the caller then takes the restart path)."""
    while time.monotonic() < deadline:
        found = read()
        if found is not None and found.generation > after:
            return found
        time.sleep(POLL_SECONDS * 5)
    return None
