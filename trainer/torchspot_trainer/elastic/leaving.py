"""How a worker leaves: its eviction notices, and its node's snapshot (the manager's module docstring says
what each gives a loop; recovery/notices.py, signals.py and snapshot.py hold the rules). The manager's
workers and the built-in trainer's leave alike.

`Leaving` owns what the process-wide hooks touch (SIGTERM, `sys.excepthook`, a fork's child), so that
`close()` can give them back as they were; its user decides when the group stops for a notice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, NoReturn

from torchspot_trainer import RUN_ID_ENV
from torchspot_trainer.elastic.saving import Saving
from torchspot_trainer.recovery.group import Group, abort_group, arm_exit_deadline
from torchspot_trainer.recovery.notices import EXIT_FAILED, NOTICE_LEAVING, GroupBroken, NoticeStop, leave
from torchspot_trainer.recovery.outcome import GroupChanged
from torchspot_trainer.recovery.peer_copy import read_traded, remove_traded
from torchspot_trainer.recovery.signals import (
    STUCK_EXIT_AFTER,
    EvictionNotice,
    ScheduledEventsWatcher,
    reset_sigterm,
    watch_sigterm,
)
from torchspot_trainer.recovery.snapshot import Held, LocalSnapshot, default_path

log = logging.getLogger("torchspot.elastic")

LEAVE_SAVE_WAIT = 5.0
"""Seconds a worker that leaves gives its snapshot's write and its checkpoint save in flight."""
_FORK_RESETS: list[bool] = []
"""Set once this process has its fork hook (`Leaving._watch`)."""

Kept = tuple[int, Callable[[Callable[[dict[str, Any] | None], float | None]], float | None]]
"""What a snapshot keeps: the step its state came from (its lineage: snapshot.py's `base`), and the
host copy's `write_from` (recovery/hostcopy.py), which hands a writer the newest whole state kept at a
step boundary (its "torchspot" part says its step; None where there is none) and holds that copy
while it writes: on a GPU it is host memory, so a hung device cannot stop the write."""


def _reset_in_child() -> None:
    """A forked child's SIGTERM back to its default, its wakeup fd off (signals.reset_sigterm): where the
    fork did not come from the main thread, the child has none to set them from, and keeps them."""
    with contextlib.suppress(ValueError):
        reset_sigterm()


def node_snapshot(environ: Mapping[str, str], *, per_rank: bool = False) -> LocalSnapshot | None:
    """The node's copy of the state (recovery/snapshot.py), under an elastic agent only (RUN_ID_ENV set):
    one that restarts the worker, whose run id and process id name the file. Elsewhere no next round
    would read it, and another script started from the same shell would. `per_rank`: a file for each
    local rank (a sharded state's shards: recovery/reshard.py)."""
    if RUN_ID_ENV not in environ:
        return None
    path = default_path(dict(environ))
    if per_rank:
        path = path.with_name(f"{path.stem}-local{environ.get('LOCAL_RANK', '0')}{path.suffix}")
    return LocalSnapshot(path, round_started=time.time())


class Leaving:
    """A worker's notices (SIGTERM from the main thread on, Scheduled Events from one rank per node) and
    its node's snapshot.

    :param hold: after a notice's emergency checkpoint, seconds the staying ranks wait (NoticeStop).
    :param events_at: the Scheduled Events endpoint, or None.
    :param emit: the record output (the manager's, the trainer's).
    :param kept: what a snapshot would keep now (`Kept`), or None while there is no state of the run to
        keep (before the first resume, after the run).
    :param before_exit: a stuck worker's last call after its snapshot (its save in flight's moment).
    :param snapshot: the node's snapshot file (`node_snapshot`), or None: none kept.
    :param step_of: the step of a state `kept` gives.
    :param stuck_exit_after: seconds a worker stuck after its SIGTERM has before it exits (signals.py).
    :param vm_name: this VM's name in Scheduled Events (None: the metadata service's).
    :param write_wait: seconds a snapshot's write may hold the worker (None: until written, where a
        larger state's write matters more and its callers bound the exit: group.arm_exit_deadline).
    """

    def __init__(
        self,
        *,
        hold: float,
        events_at: str | None,
        emit: Callable[..., None],
        kept: Callable[[], Kept | None],
        before_exit: Callable[[], None],
        snapshot: LocalSnapshot | None,
        step_of: Callable[[dict[str, Any]], int],
        stuck_exit_after: float = STUCK_EXIT_AFTER,
        vm_name: str | None = None,
        write_wait: float | None = LEAVE_SAVE_WAIT,
    ) -> None:
        self.notice = EvictionNotice()
        self.stop = NoticeStop(
            self.notice, hold=hold, emit=emit, keep_snapshot=self.keep_snapshot,
            node=int(os.environ.get("GROUP_RANK", "0")),
        )  # fmt: skip
        self.snapshot = snapshot
        self.kept_step: int | None = None
        """The step of the snapshot this node keeps for the next round (written by this worker or another
        local rank of the round), once one is: a save in flight older than it need not hold the exit."""
        self._kept, self._before_exit, self._step_of, self._write_wait = kept, before_exit, step_of, write_wait
        self._lock, self._taken, self._kept_now = threading.Lock(), False, threading.Event()
        self.also_keep: list[Callable[[], None]] = []
        """What a stopping worker writes after its snapshot: a trade's copies (recovery/peer_copy.py)."""
        self._sigterm_watched = self._watch(events_at, vm_name, stuck_exit_after)
        self._excepthook, sys.excepthook = sys.excepthook, self._keep_then_report

    def _watch(self, url: str | None, vm_name: str | None, stuck_exit_after: float) -> bool:
        """Turn SIGTERM into the notice (only the main thread may take signals: a worker whose Leaving is
        made elsewhere says so and leaves SIGTERM as it is), and poll Scheduled Events at `url` from one
        rank per node. Whether SIGTERM is watched."""
        if url and os.environ.get("LOCAL_RANK", "0") == "0":
            self.stop.watcher = ScheduledEventsWatcher(self.notice, url, vm_name=vm_name).start()
        if threading.current_thread() is not threading.main_thread():
            log.warning("torchspot: the Manager was made off the main thread: a SIGTERM is not taken as a notice")
            return False
        watch_sigterm(self.notice, stuck_exit_after=stuck_exit_after, before_exit=self._stuck_exit)
        if not _FORK_RESETS:  # a DataLoader's worker forked from here is not this worker: no notice there
            os.register_at_fork(after_in_child=_reset_in_child)
            _FORK_RESETS.append(True)
        return True

    def at_boundary(self) -> None:
        """A step boundary: the SIGTERM watcher's stuck clock starts again, and a notice raised before it
        counts as seen (it is shared at this boundary or the next)."""
        self.notice.step_boundary()
        if self.notice.is_set():
            self.notice.acknowledged.set()

    def read_snapshot(self) -> tuple[Held, dict[str, Any]] | None:
        """The node's snapshot and its state, if there is one that loads."""
        return self.snapshot.read() if self.snapshot is not None else None

    def read_snapshots(self) -> list[tuple[Held, dict[str, Any]]]:
        """A sharded rank's snapshots that load: its own, and its last trade's copies (recovery/peer_copy.py)."""
        if self.snapshot is None:
            return []
        own = self.snapshot.read()
        return ([] if own is None else [own]) + read_traded(self.snapshot.path)

    def keep_snapshot(self) -> None:
        """Leave this node's copy of the committed state for the next round (recovery/snapshot.py): the
        restart path resumes from the newest copy any node holds rather than from the last checkpoint.
        Once per worker, by the first local rank of the round to get here, when `kept` has one. Given
        `write_wait` seconds: a device that hangs cannot hold the worker's exit. A second caller (the main
        thread's way out and the SIGTERM watcher's may both get here) waits as long for the first one's
        write: without it, the watcher's exit ended a worker whose main thread was writing (a bench's join,
        where a peer was also judged lost, resumed 21 steps back)."""
        snapshot = self.snapshot
        if snapshot is None:
            return
        with self._lock:
            second = self._taken
            kept = None if second else self._kept()
            self._taken = second or kept is not None
        if second:
            self._kept_now.wait(self._write_wait)
        if kept is None:
            return
        base, write_from = kept

        def to_disk(state: dict[str, Any] | None) -> float | None:
            if state is None:  # no whole copy yet, or an update under way on the CPU's live state
                return None
            step = self._step_of(state)
            took = snapshot.write({"step": step, **state}, base)
            if snapshot.written_this_round():  # by this worker, or another local rank of the round
                self.kept_step = step
            if took is not None:
                log.info("torchspot: local snapshot of step %d written in %.2f s", step, took)
            return took

        def write() -> None:
            write_from(to_disk)

        writer = threading.Thread(target=write, name="torchspot-snapshot", daemon=True)
        writer.start()
        writer.join(self._write_wait)
        for keep in self.also_keep:
            keep()
        self._kept_now.set()

    def stop_for(self, rows: list[list[int]], *, step: int, rank: int, group: Group, saving: Saving | None,
                 state: Callable[[], dict[str, Any]], world: int) -> None:  # fmt: skip
        """On a notice in the ranks' [level, node] `rows` at the boundary after `step`, stop the group there
        (`NoticeStop.stop`): the emergency checkpoint where `saving` says this rank writes it (of `state()`,
        the committed step), then the hold. Raises GroupChanged in place where the round without the
        leaving node came; leaves by the restart path where the hold failed."""
        stop = self.stop
        save = None
        if saving is not None and saving.saves_emergency(rank, rows, leaving_now=stop.level() >= NOTICE_LEAVING):
            save = lambda: saving.emergency(step, state(), world)  # noqa: E731 - (written when the stop says)
        try:
            stop.stop(group, step=step, save=save)
        except (GroupBroken, RuntimeError) as exc:
            if isinstance(exc, GroupChanged):
                raise
            self.leave(f"rank {rank}: the hold after a notice at step {step} failed ({exc})")

    def leave(self, why: str) -> NoReturn:
        """Leave the run by the restart path now, under a deadline armed first (whatever hangs on the way, a
        communicator's abort, the worker is gone by then): one line with `why`, this node's snapshot kept,
        the user's last call (a save in flight's moment), the communicator aborted, then exit with the code
        for which the agent restarts the worker."""
        arm_exit_deadline()
        print(f"torchspot: {why}; leaving for the restart path", file=sys.stderr, flush=True)
        self.keep_snapshot()
        self._before_exit()
        abort_group()
        leave(EXIT_FAILED)

    def _stuck_exit(self) -> None:
        """A worker stuck in a collective after its SIGTERM is about to exit: it keeps its node's snapshot,
        then its user's last call, under the exit deadline (whatever hangs on the way, it is gone then)."""
        arm_exit_deadline()
        self.keep_snapshot()
        self._before_exit()

    def _keep_then_report(self, kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        """`sys.excepthook` while the manager runs: a loop that raised (a collective failed where a peer
        left, on the restart path) keeps the node's snapshot, then the error is reported as before."""
        self.keep_snapshot()
        self._excepthook(kind, value, trace)

    def close(self) -> None:
        """The run is over: no snapshot to carry to a next round, and the process's hooks as they were (a
        SIGTERM after the loop ends the script as it would without the manager)."""
        if self.stop.watcher is not None:
            self.stop.watcher.stop()
        if self.snapshot is not None:
            self.snapshot.remove()
            remove_traded(self.snapshot.path)
        if sys.excepthook == self._keep_then_report:
            sys.excepthook = self._excepthook
        if self._sigterm_watched:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
