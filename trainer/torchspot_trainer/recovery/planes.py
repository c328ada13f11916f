"""Where a generation's device tensors travel: the data plane of a `LiveGroup`.

On CPU a generation is one gloo group, which carries everything (`HostPlane`). On GPUs it is two: a gloo
group for the small agreements made at every boundary (host memory, so the host never waits for the
device's queue) and an NCCL communicator for the gradients and a heal's state (`NcclPlane`). NCCL differs
from gloo where recovery needs it most; the plane answers each difference by its documented semantics:

- **A hung NCCL collective never returns and cannot be cancelled**: its kernels spin until the
  communicator is aborted. Each communicator is non-blocking (`generation_options`: its calls return at
  once and stay abortable), and the old one is aborted on a thread of its own (`Parent.retire`),
  overlapped with the successor's creation, since an abort can take a second even when idle.
- **A failed NCCL work reads as completed** with NCCL's error handling off (what the launcher sets):
  only the communicator's `get_error()` tells (`NcclPlane.failed`).
- **A sticky CUDA error poisons the process**: after an abort with work in flight, a probe on a stream of
  its own must pass within `PROBE_SECONDS`, or the worker takes the restart path (`device_healthy`).
- **The first collective of an eagerly made, non-blocking communicator waits for its init**: the plane
  runs one all-reduce of a zero on the build's thread, so the training thread never meets an unfinished
  communicator.
- **`ncclCommShrink`** (NCCL 2.27+) makes the survivors' communicator from the parent's, cheaper than a
  new one at scale: chosen (`replacement`, `shrink_flags`) when the new ranks are exactly the parent's
  survivors in their order (`shrink_plan`), and checked after.

Only the decisions run on CPU (tests/trainer/test_live.py); the options, the probe and one rank's
generations are tested on a GPU (tests marked cuda). Across GPU nodes this plane is **not measured**.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

NCCL_SHRINK_VERSION = (2, 27, 0)
"""NCCL's `ncclCommShrink`: a communicator without the excluded ranks, built from the parent's
bootstrap (torch's `shrink_group`; the backend's `shrink`), cheaper than a fresh communicator after
a loss."""
NCCL_SHRINK_HANG_VERSION = (2, 31, 0)
"""From this version torch 2.13's `SHRINK_ABORT` survivors block destroying the parent
(pytorch#194679, fix open): shrink without it, then abort the parent ourselves."""
SHRINK_DEFAULT = 0x00
"""NCCL_SHRINK_DEFAULT: shrink a parent with no operation in flight."""
SHRINK_ABORT = 0x01
"""NCCL_SHRINK_ABORT: end the parent's operations in flight first (a hung parent, after a loss).
NCCL leaves the parent's resources to the caller, who aborts it after."""
PROBE_SECONDS = 5.0
"""The most a device health probe may take: a tiny kernel and a synchronize take milliseconds on a
healthy device (11-21 ms on an H200 after an abort)."""
RETIRE_SECONDS = 10.0
"""The most an old communicator's abort may run (it took up to 1 s on an H200) before the worker
takes the restart path at its next re-form: an abort that never returns means a wedged driver."""
WARM_UP_POLL = 0.001
"""Between looks at the warm-up all-reduce's completion (and at whether its build was abandoned)."""


class Replace(Enum):
    """How the communicator of the next generation is made (`replacement`)."""

    NEW = "new"
    """A fresh communicator on the next round's store (every join: c10d 2.13 has no grow)."""
    SHRINK = "shrink"
    SHRINK_THEN_ABORT = "shrink, then abort the parent"


def replacement(version: tuple[int, int, int] | None, *, loss_only: bool) -> Replace:
    """How a generation's NCCL communicator is replaced at a membership change. Pure.

    Only a change that removes ranks and adds none can shrink, and only on an NCCL that has
    `ncclCommShrink`; everything else (a join, an old NCCL, no NCCL at all) gets a new one."""
    if not loss_only or version is None or version < NCCL_SHRINK_VERSION:
        return Replace.NEW
    if version >= NCCL_SHRINK_HANG_VERSION:
        return Replace.SHRINK_THEN_ABORT
    return Replace.SHRINK


def shrink_flags(how: Replace, *, clean: bool) -> int | None:
    """The flags of `ncclCommShrink` for `how`, or None for a new communicator instead. Pure.

    A parent with work abandoned in flight (`clean` False: a peer was lost inside a collective) can
    only shrink with SHRINK_ABORT, which ends that work first; where that flag hangs
    (`SHRINK_THEN_ABORT`) only a clean parent (the survivors of a departure with notice, which
    leaves at a boundary) shrinks."""
    if how is Replace.NEW:
        return None
    if how is Replace.SHRINK:
        return SHRINK_DEFAULT if clean else SHRINK_ABORT
    return SHRINK_DEFAULT if clean else None


def shrink_plan(members: list[tuple[int, int]], parent: tuple[int, int]) -> list[int] | None:
    """The parent's ranks to exclude, or None when the new generation cannot be a shrink of it. Pure.

    `members`: each new rank's (previous generation, rank in it), by new rank; `parent`: (the
    previous generation, its world). A shrink renumbers the survivors in their old order, so every
    member must come from the parent, in that order, and at least one parent rank be gone."""
    generation, world = parent
    if any(previous != generation for previous, _ in members):
        return None  # a joiner, or a rank that missed the parent (it was frozen through it)
    ranks = [rank for _, rank in members]
    if min(ranks, default=-1) < 0 or any(a >= b for a, b in itertools.pairwise(ranks)):
        return None  # renumbered otherwise than a shrink would
    if ranks[-1] >= world or len(ranks) >= world:
        return None
    return sorted(set(range(world)) - set(ranks))


def generation_options(timeout: timedelta) -> Any:
    """ProcessGroupNCCL's options for one generation: non-blocking (`config.blocking = False`: its
    init and collectives return at once and stay abortable, where a blocking init with a dead peer
    cannot be aborted), with the generation's op timeout. Eager init comes from binding the
    communicator to its device (`eager_connect_single_device`). Needs an NCCL build of torch."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = False
    options._timeout = timeout
    return options


def device_healthy(probe: Callable[[], None], timeout: float = PROBE_SECONDS) -> bool:
    """Whether the device still works after a communicator's abort: `probe` (a tiny kernel and a
    synchronize: `cuda_probe`) on a thread of its own, within `timeout`. An abort frees the kernels
    that spun on a dead peer and leaves the CUDA context healthy unless a sticky error hit it (an
    Xid, an ECC error, an illegal address); then every call fails or hangs, and the process must
    take the restart path (and the node, perhaps, be replaced)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            probe()
        except BaseException as exc:  # whatever it raised, the device is not usable
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, name="torchspot-device-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.warning("device probe still running after %.1f s: the device is not usable", timeout)
        return False
    if outcome[0] is not None:
        log.warning("device probe failed: %s", outcome[0])
        return False
    return True


def cuda_probe(device: torch.device) -> Callable[[], None]:
    """A probe for `device_healthy`: one element added on the device, on a stream of its own, then
    that stream synchronized: a whole-device synchronize would also wait for an old communicator's
    kernels, which its abort may still be ending."""

    def probe() -> None:
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            torch.ones(1, device=device).add_(1)
        stream.synchronize()

    return probe


class Parent:
    """The previous generation's data group, handed to the next one's build: what a shrink is made
    from, and what is then retired (aborted on a thread of its own, once) while the new one forms."""

    def __init__(
        self,
        group: Any,
        generation: int,
        rank: int,
        world: int,
        *,
        clean: bool,
        abort: Callable[[Any], None] | None,
        on_retired: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_retired`: called once `retired` is set (the graveyard's reaper looks then: live.py)."""
        self.group = group
        self.generation = generation
        self.rank = rank
        self.world = world
        self.clean = clean
        """No work of it was abandoned in flight or failed."""
        self.retired = threading.Event()
        """Set when its abort has returned (at once when there is nothing to abort): until then the
        generation's grave keeps its staging copies, which the aborted kernels may still write."""
        self._abort = abort
        self._on_retired = on_retired
        self._lock = threading.Lock()
        self.retiring_since: float | None = None

    def retire(self) -> None:
        """Start the abort (once; later calls do nothing)."""
        with self._lock:
            if self.retiring_since is not None:
                return
            self.retiring_since = time.monotonic()
        if self._abort is None or self.group is None:
            self._retired()
            return
        abort, group = self._abort, self.group

        def run() -> None:
            try:
                abort(group)
            except Exception as exc:  # an abort that fails has nothing more to end
                log.warning("generation %d: the old communicator's abort failed (%s)", self.generation, exc)
            self._retired()

        threading.Thread(target=run, name=f"torchspot-retire-{self.generation}", daemon=True).start()

    def _retired(self) -> None:
        self.retired.set()
        self._on_retired()

    def stuck(self, now: float, limit: float = RETIRE_SECONDS) -> bool:
        """Whether its abort has run longer than `limit` seconds without returning."""
        return self.retiring_since is not None and not self.retired.is_set() and now - self.retiring_since > limit


class HostPlane:
    """A generation whose control group carries its data too: gloo on CPU, where every tensor is in
    host memory. Nothing to make, abort or probe."""

    separate = False

    def make(
        self,
        store: Any,
        control: Any,
        *,
        timeout: timedelta,
        parent: Parent | None,
        abandoned: threading.Event,
        made: Callable[[Any], None] = lambda _group: None,
    ) -> Any:
        """The generation's data group, on the generation's `store` (its own prefix), built on the
        group build's thread after `control` (the generation's gloo group: its rank and size) formed;
        may shrink `parent`, and retires it. A group of its own is handed to `made` as soon as it
        exists, before its first collective: the caller owns it from then on, and aborts it where the
        build fails or is given up (generation.py's `Build`). Raises RuntimeError when `abandoned` is set
        first (the caller gave the build up: a newer round, or its deadline)."""
        if parent is not None:
            parent.retire()
        return control

    def abort(self, group: Any) -> None:
        """End a retired data group's work in flight (on the retiring thread)."""

    def failed(self, group: Any) -> bool:
        """Whether a completed work of `group` failed even though its `wait()` did not raise."""
        return False

    def healthy(self) -> bool:
        """Whether the device works, after an old generation's abort with work in flight."""
        return True


class NcclPlane(HostPlane):
    """The data of each generation on an NCCL communicator of its own (module docstring).

    :param device: this rank's GPU.
    :param version: NCCL's, as (major, minor, patch) (`nccl_version`).
    """

    separate = True

    def __init__(self, device: torch.device, version: tuple[int, int, int] | None) -> None:
        self.device = device
        self.version = version

    def make(
        self,
        store: Any,
        control: Any,
        *,
        timeout: timedelta,
        parent: Parent | None,
        abandoned: threading.Event,
        made: Callable[[Any], None] = lambda _group: None,
    ) -> Any:
        torch.cuda.set_device(self.device)  # the build's thread: the current device is per thread
        rank, world = control.rank(), control.size()
        options = generation_options(timeout)
        data: Any = None
        if parent is not None and parent.group is not None:
            data = self._shrunk(control, rank, world, parent, options)
            parent.retire()  # after the shrink, which needs it: overlapped with the new one's set-up
        if data is None:
            data = dist.ProcessGroupNCCL(store, rank, world, options)
            data.eager_connect_single_device(self.device)  # eager init, non-blocking: returns at once
        made(data)  # the caller's from now on: it aborts it, from its own thread where this one waits in C++
        zero = torch.zeros(1, device=self.device)
        work = data.allreduce([zero])  # waits for the init: here, not on the training thread
        while not work.is_completed():
            if abandoned.wait(WARM_UP_POLL):  # a peer that never comes: the caller ends its kernels
                raise RuntimeError("the new communicator's build was abandoned")
        if self.failed(data):
            raise RuntimeError(f"the new communicator failed its first all-reduce ({data.get_error()})")
        return data

    def _shrunk(self, control: Any, rank: int, world: int, parent: Parent, options: Any) -> Any:
        """The parent shrunk to this generation, or None (a new communicator is made instead). Every
        rank decides alike, from one all-gather over the new control group."""
        mine = torch.tensor([parent.generation, parent.rank], dtype=torch.long)
        rows = [torch.zeros_like(mine) for _ in range(world)]
        control.allgather([rows], [mine]).wait()
        members = [(int(row[0]), int(row[1])) for row in rows]
        excluded = shrink_plan(members, (parent.generation, parent.world))
        flags = shrink_flags(replacement(self.version, loss_only=excluded is not None), clean=parent.clean)
        if excluded is None or flags is None:
            return None
        try:
            shrunk = parent.group.shrink(excluded, flags, options)
        except Exception as exc:  # an NCCL without it after all, or a parent that could not: a new one
            log.warning("could not shrink the communicator (%s); making a new one", exc)
            return None
        if shrunk.rank() != rank or shrunk.size() != world:  # not the assigned ranks: of no use
            log.warning("the shrunk communicator's rank %d of %d is not %d of %d; making a new one",
                        shrunk.rank(), shrunk.size(), rank, world)  # fmt: skip
            self.abort(shrunk)
            return None
        return shrunk

    def abort(self, group: Any) -> None:
        call = getattr(group, "abort", None) or group._abort  # the binding's name differs by release
        call()

    def failed(self, group: Any) -> bool:
        """NCCL's error state: with its error handling off, a failed work reads as completed and its
        `wait()` does not raise (torch 2.8+: `get_error`; a torch without it cannot tell)."""
        get_error = getattr(group, "get_error", None)
        return get_error is not None and not str(get_error()).endswith("SUCCESS")

    def healthy(self) -> bool:
        return device_healthy(cuda_probe(self.device))


NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
"""How long torch waits in C++ for a non-blocking communicator to finish its init or an operation in
progress (torch's default: 30 minutes), read once per process."""
RUNTIME_CONNECT_ENV = "NCCL_RUNTIME_CONNECT"
"""NCCL's lazy connection (on by default from 2.22): peers connect at the first collective of each
kind and size, not at init."""


def generation_environment(environ: Mapping[str, str], timeout: timedelta) -> dict[str, str]:
    """What a worker that re-forms in place on NCCL sets before its first communicator, where the user
    set nothing. Pure. The nonblocking timeout at the generation's op timeout: a build whose peer never
    comes waits in C++ (the first collective waits for the init) out of reach of a newer round, for
    torch's 30 minutes otherwise; and NCCL's connections made at init, not lazily: the first
    gradient-sized all-reduce or heal of a generation would otherwise connect inside the training
    thread's call, where a second fault (two evictions seconds apart) leaves it in C++. Made on the
    build's thread, the connections cost the others nothing. Written from torch's and NCCL's
    documented settings; not measured on a GPU here."""
    wanted = {NONBLOCKING_TIMEOUT_ENV: str(max(1, round(timeout.total_seconds()))), RUNTIME_CONNECT_ENV: "0"}
    return {key: value for key, value in wanted.items() if key not in environ}


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL torch was built with, or None (a CPU build)."""
    if not dist.is_nccl_available():
        return None
    raw = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    return (int(raw[0]), int(raw[1]), int(raw[2]))


def plane_for(device: torch.device) -> HostPlane:
    """The data plane for a worker on `device`: NCCL on a GPU, the gloo group itself on a CPU."""
    if device.type == "cuda":
        return NcclPlane(device, nccl_version())
    return HostPlane()
