"""The few collectives the training loop itself calls, over the default process group, and how
a worker ends a group that is broken.

Each collective moves a handful of numbers; they are here so the loop reads as what it asks
("every rank's notice", "the group's sums") rather than as tensor plumbing.

A broken group (a peer frozen or gone) must end the worker promptly, its snapshot safe, on
NCCL as on gloo. The two differ: a gloo collective blocks the calling thread and raises when
a peer's socket closes or its timeout passes; an NCCL collective is only queued on the
device's stream and returns at once, and a hung one is seen by nothing but NCCL's watchdog,
which (with its default asynchronous error handling) tears the process down, snapshot or
not. So:

- NCCL's own error handling is off (`nccl_environment`; torch's documentation asks for
  that where the program aborts communicators itself), and every path out of a broken group
  is ours: the agent's SIGTERM for a lost peer (signals.py), a step that outlasts
  `--collective-timeout` (`StepWatchdog`), or a collective that raises (gloo). Each writes
  the node's snapshot from the host copy (hostcopy.py), aborts the communicator
  (`abort_group`) and exits;
- a wait that must observe a peer (the notice hold's ping) polls the work's completion with
  a deadline (`Group.ping`) instead of trusting a call that returns at once.
"""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchspot_trainer.nccl import NCCL_ERROR_HANDLING_ENV

log = logging.getLogger(__name__)

GROUP_TIMEOUT_FACTOR = 2.0
"""The process group's timeout, in `--collective-timeout`s: above the step watchdog's limit, so the
watchdog (snapshot, abort, exit) always acts first and the two never race."""
EXIT_DEADLINE_SECONDS = 120.0
"""The most any way out of a broken group may take (snapshot, the save in flight, the abort), enforced
below Python (`arm_exit_deadline`): a device or a lock that never returns cannot keep a worker, and its
paid GPUs, for ever."""
ABORT_SECONDS = 10.0
"""How long the communicator's abort may take before the worker leaves without it."""
PING_POLL = 0.005
"""Seconds between looks at a ping's completion."""


def nccl_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What to set before an NCCL group is made: the watchdog's error handling off (0), unless the
    user chose a value (or the launcher did: `nccl.worker_environment`). Pure."""
    return {} if NCCL_ERROR_HANDLING_ENV in environ else {NCCL_ERROR_HANDLING_ENV: "0"}


GLOO_TRANSPORT = "gloo/transport/"
"""Where gloo's errors at a peer's socket come from (its messages name the source file): a peer's
connection closed or reset, or a read that timed out waiting for it."""


def peer_failure(exc: BaseException) -> str | None:
    """The first line of `exc` where it is a collective's failure at a peer (gloo's transport, or one of
    torch's distributed errors: NCCL's DistBackendError, a store's DistNetworkError), else None: a
    failure of the program itself. Pure.

    On the restart path a lost peer ends every survivor's step this way, the event the job is built
    for; its worker says so in a line, where another failure gets its traceback."""
    if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and GLOO_TRANSPORT in str(exc)):
        return next(iter(str(exc).splitlines()), type(exc).__name__)
    return None


def group_timeout(collective_timeout: float) -> timedelta:
    """The process group's timeout for a step watchdog of `collective_timeout` seconds. Pure."""
    return timedelta(seconds=collective_timeout * GROUP_TIMEOUT_FACTOR)


def group_device(device: torch.device) -> torch.device | None:
    """`init_process_group`'s device_id: a GPU rank's device, None on a CPU. Pure.

    Bound to its device, an NCCL group creates its communicator in `init_process_group` itself
    (eager init) rather than at the first collective, inside the training loop: a rank whose GPU,
    driver or fabric fails then fails in set-up, where the trainer reports it, not in a step the
    watchdog must time out; and torch need not guess the device from the current one."""
    return device if device.type == "cuda" else None


def arm_exit_deadline(seconds: float = EXIT_DEADLINE_SECONDS) -> None:
    """End the process `seconds` from now, whatever it is doing then, with every thread's traceback on
    stderr: Python's faulthandler does it from its own C thread, which neither the GIL held by a stuck
    C call nor a lock can stop. Armed first in every way out of a broken group."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def abort_group(deadline: float = ABORT_SECONDS) -> None:
    """Abort the default group's communicators (NCCL: a hung collective's kernels end, and exiting
    cannot hang on them), waiting at most `deadline` seconds for the abort. Gloo has nothing to abort:
    its sockets close with the process."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return

    def abort() -> None:
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as exc:  # leaving anyway: a failed abort must not keep the worker
            log.warning("could not abort the NCCL communicator: %s", exc)

    aborting = threading.Thread(target=abort, name="nccl-abort", daemon=True)
    aborting.start()
    aborting.join(deadline)
    if aborting.is_alive():
        log.warning("the NCCL communicator's abort did not return within %.0f s; leaving without it", deadline)


@dataclass(frozen=True)
class Group:
    """This worker's place in the current group, and the loop's collectives over the default group
    (live.py's `LiveCollectives` runs the same ones over a group re-formed in place)."""

    rank: int
    world: int
    device: torch.device
    control: Any = None
    """A gloo group of the same ranks for the agreements at every step boundary (`control_group`),
    or None: they use the default group (gloo already, on CPUs)."""

    def gather_ints(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (the same length on all), by rank: one all-gather (this runs after
        every step). Through the control group where there is one: host memory over TCP, so the
        host never waits for the device's queue of work, as a read of an NCCL result would."""
        device = torch.device("cpu") if self.control is not None else self.device
        mine = torch.tensor(row, dtype=torch.long, device=device)
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.control)
        gathered: list[list[int]] = torch.stack(rows).tolist()
        return gathered

    def boundary(self, step: int, row: Callable[[], list[int]]) -> list[list[int]]:
        """The agreement at the boundary after `step` (the notices': notices.py): every rank's `row()`,
        by rank, gathered now (`gather_ints`). In place on CPU it came with the step's gradients
        (live.py's `LiveCollectives.boundary`)."""
        del step  # (the default group has nothing gathered ahead)
        return self.gather_ints(row())

    def ping(self, timeout: float) -> bool:
        """All-reduce a zero and wait for it on the host, at most `timeout` seconds: False when it
        did not complete (a peer is frozen or gone and the collective hangs, as on NCCL); a
        collective that failed raises (gloo: a peer's socket closed)."""
        return _completed(dist.all_reduce(torch.zeros(1, device=self.device), async_op=True), timeout)

    def agree(self, timeout: float) -> bool:
        """A barrier of every rank, through the control group on NCCL (host memory over TCP: never a
        device wait), waited for on the host at most `timeout` seconds: False when a rank did not
        come (it left, or froze); a collective that failed raises (a peer's socket closed). The
        notice path's barrier: a plain `dist.barrier()` on NCCL could never complete once the
        leaving node's ranks had exited, and the staying ranks sat in a device sync until their
        agent's SIGTERM."""
        return _completed(dist.all_reduce(torch.zeros(1), group=self.control, async_op=True), timeout)

    def sums(self, values: list[torch.Tensor]) -> list[float]:
        """The group's sums of these scalars (float64 on the device, one all-reduce)."""
        totals = torch.stack([value.detach().to(self.device, torch.float64).reshape(()) for value in values])
        dist.all_reduce(totals)
        result: list[float] = totals.tolist()
        return result

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """`tensor` from rank `src` to every rank, in place (wire.broadcast_state's `send`)."""
        dist.broadcast(tensor, src=src)


def _completed(work: Any, timeout: float) -> bool:
    """Wait on the host, at most `timeout` seconds, for an asynchronous collective: False when it did not
    complete; its failure raises (`work.wait`)."""
    assert work is not None
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(PING_POLL)
    work.wait()
    return True


def control_group(backend: str, timeout: float) -> Any:
    """A gloo group beside an NCCL one, for the small agreements the loop makes at every step
    boundary (eviction notices, resume sources); None on gloo, which is host-side already.

    On NCCL, reading an all-gather's result on the host waits for everything queued on the
    device before it: one host synchronisation per step, which stops the host from queueing
    the next step while the GPU runs this one. Every rank must call this, in the same order.
    """
    if backend != "nccl":
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))


class StepWatchdog:
    """Ends the worker when the loop has not reached a boundary for `limit` seconds.

    `boundary()` tells when the loop last was at one (the notice's clock, which every step,
    evaluation batch and hold ping sets); a thread looks once a second. Armed only while the
    loop trains (the trainer sets `armed`): set-up and the final save are not steps.

    :param on_broken: what to do then (the trainer: snapshot, abort, exit); does not return.
    """

    def __init__(
        self, limit: float, boundary: Callable[[], float], on_broken: Callable[[float], None], *, interval: float = 1.0
    ) -> None:
        self.limit = limit
        self.boundary = boundary
        self.on_broken = on_broken
        self.interval = interval
        self.armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-watchdog", daemon=True)

    def start(self) -> StepWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            since = time.monotonic() - self.boundary()
            if self.armed and since > self.limit:
                log.error("no step boundary for %.0f s (--collective-timeout): the group is broken", since)
                self.on_broken(since)
                return
