"""A child process that serializes and uploads checkpoints, so training keeps its CPU and GIL.

Why a process and not a thread: a saver thread shares the training process's GIL.
`torch.save` into a buffer and the Blob SDK's request handling hold it in stretches,
and every short op of the training step must win it back (Python hands the GIL over
at most every 5 ms), so a CPU-bound step slowed down by far more than the save's own
CPU time. A child process has its own interpreter, runs at a lower priority (`nice`),
and only costs the training loop one memory copy per checkpoint.

How the state gets there: the parent owns one shared-memory byte buffer (grown when
the state grows) and copies every tensor into it at the step boundary (the stall);
what it sends over the pipe is only the state's skeleton, each tensor replaced by
its offset, dtype and shape. The child rebuilds the tensors from the buffer, hands
the state to the writer, and sends back the writer's report (and, while it retries
a failing upload, a note of each failed attempt, so the parent can tell a save that
is slow from one that is stuck on an outage).

The child ignores SIGTERM and SIGINT (an eviction signals the whole pod; the
trainer's emergency checkpoint is its business) and dies with the worker that started it
(`_die_with_worker`): an orphan must never commit a checkpoint behind the next round's back.
Under `torchspot-run` it is forked from the worker's warm server (forks.py), so its parent is that
server, not the worker; elsewhere it is a new interpreter, the worker's child.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing

from torchspot_trainer.checkpoint.storage import quiet_sdk_logs
from torchspot_trainer.forks import helper_context

log = logging.getLogger(__name__)

SAVER_NICE = 10
"""Niceness the saver adds to itself: on a CPU-bound node the training step wins every contest."""
ALIGN = 64
"""Byte alignment of each tensor in the shared buffer (any dtype may be viewed at such an offset)."""
STOP_TIMEOUT = 30.0
"""Seconds `close` waits for the child to finish and exit before killing it."""
_PR_SET_PDEATHSIG = 1

Writer = Callable[[int, Any, dict[str, Any]], Any]
"""Writes one checkpoint (step, state, meta) and returns its report."""
RetryHook = Callable[[int, str], None]
"""Told (step, error) each time an attempt of a save failed and another will follow."""


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lies in the shared buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def map_nested(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild the dicts, lists and tuples of a state around `leaf(x)` of everything else.

    The one walk over a training state: the snapshot copy, the shared-memory plan and
    its inverse all use it (mappings come back as plain dicts, tuples as tuples).
    """
    if isinstance(obj, Mapping):
        return {key: map_nested(value, leaf) for key, value in obj.items()}
    if isinstance(obj, list):
        return [map_nested(value, leaf) for value in obj]
    if isinstance(obj, tuple):
        return tuple(map_nested(value, leaf) for value in obj)
    return leaf(obj)


def buffer_layout(state: Any, start: int = 0) -> tuple[Any, int]:
    """The skeleton of `state` (tensors replaced by `TensorRef`s) and the buffer size it needs.

    Pure: nothing is copied. Strided tensors are laid out one after another, each at an
    `ALIGN`ed offset; anything else (sparse tensors, numbers, strings) stays in the skeleton.
    """
    offset = start

    def place(obj: Any) -> Any:
        nonlocal offset
        if not isinstance(obj, torch.Tensor):
            return obj
        if obj.layout != torch.strided:
            return obj.detach().to("cpu", copy=True)
        nbytes = obj.numel() * obj.element_size()
        ref = TensorRef(offset, nbytes, obj.dtype, tuple(obj.shape))
        offset += -(-nbytes // ALIGN) * ALIGN
        return ref

    skeleton = map_nested(state, place)
    return skeleton, offset


def _view(buffer: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    return buffer[ref.offset : ref.offset + ref.nbytes].view(ref.dtype).view(ref.shape)


def fill(buffer: torch.Tensor, state: Any, skeleton: Any) -> None:
    """Copy every tensor of `state` to its place in `buffer` (GPU tensors come to the host)."""
    if isinstance(skeleton, TensorRef):
        _view(buffer, skeleton).copy_(state.detach())
    elif isinstance(skeleton, Mapping):
        for key, value in skeleton.items():
            fill(buffer, state[key], value)
    elif isinstance(skeleton, list | tuple):
        for item, value in zip(state, skeleton, strict=True):
            fill(buffer, item, value)


def unpack(skeleton: Any, buffer: torch.Tensor) -> Any:
    """The state again: each `TensorRef` becomes its own (cloned) tensor."""
    return map_nested(skeleton, lambda leaf: _view(buffer, leaf).clone() if isinstance(leaf, TensorRef) else leaf)


class SaverProcess:
    """One child process that runs `make_writer()`'s writer on states passed in shared memory.

    :param make_writer: a picklable callable, run once in the child with the hook that
        tells the parent of a failed attempt, returning the writer.
    :param on_done: called on the parent's reader thread with each report, before the
        save's future resolves (so whoever waits on the future sees its effects).
    :param on_retry: called on the parent's reader thread when an attempt of the save
        in flight failed and the writer will try again.
    """

    def __init__(
        self,
        make_writer: Callable[[RetryHook], Writer],
        on_done: Callable[[Any], None],
        on_retry: RetryHook,
    ) -> None:
        context = helper_context()  # forked from the worker's warm server where there is one (forks.py)
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child_conn, make_writer), name="torchspot-saver", daemon=True
        )
        self._process.start()
        child_conn.close()
        self._on_done = on_done
        self._on_retry = on_retry
        self._buffer: torch.Tensor | None = None
        self._pending: Future[Any] | None = None
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="torchspot-saver-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the child still runs (it may be gone: killed, out of memory)."""
        return self._process.is_alive() and self._reader.is_alive()

    def submit(self, step: int, state: Mapping[str, Any], meta: dict[str, Any]) -> Future[Any]:
        """Copy `state` into shared memory and ask the child to write it. One save at a time."""
        with self._lock:
            if self._pending is not None and not self._pending.done():
                raise RuntimeError("a checkpoint save is still in flight; wait for it first")
            skeleton, size = buffer_layout(state)
            if self._buffer is None or self._buffer.numel() < size:
                self._buffer = torch.empty(max(size, 1), dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
                self._conn.send(("buffer", self._buffer))
            fill(self._buffer, state, skeleton)
            future: Future[Any] = Future()
            self._pending = future
            self._conn.send(("save", step, skeleton, meta))
        return future

    def close(self) -> None:
        """Let the save in flight finish, then stop the child (killed if it does not stop in time)."""
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("stop",))
        self._process.join(STOP_TIMEOUT)
        if self._process.is_alive():
            log.warning("checkpoint saver %s did not stop within %.0f s; killing it", self.pid, STOP_TIMEOUT)
            self._process.kill()
            self._process.join()
        self._reader.join(STOP_TIMEOUT)
        self._conn.close()
        self._process.close()

    def _read(self) -> None:
        """Resolve each save's future with the child's answer; fail the one in flight if the child dies."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "retrying":
                self._on_retry(message[1], message[2])
                continue
            with self._lock:
                future, self._pending = self._pending, None
            if future is None:
                continue
            if message[0] == "done":
                self._on_done(message[1])
                future.set_result(message[1])
            else:
                future.set_exception(RuntimeError(f"checkpoint saver process: {message[1]}"))
        with self._lock:
            future, self._pending = self._pending, None
        if future is not None and not future.done():
            future.set_exception(RuntimeError(f"checkpoint saver process {self.pid} exited during a save"))


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies; elsewhere the pipe's end stops it."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _die_with_worker() -> None:
    """Exit at once, from a watcher thread, when the worker that started this process ends, even in the
    middle of an upload. Its parent may be the worker's fork server (forks.py), whose death
    `_die_with_parent` covers; the worker is watched through a pidfd (Linux 5.3+), which is readable
    once it exits, else through multiprocessing's sentinel of it, a pipe whose last writer may also
    be a process the worker forked later (a data loader's worker, which follows it within seconds)."""
    worker = multiprocessing.parent_process()
    if worker is None or worker.pid is None:
        return
    try:
        handle = os.pidfd_open(worker.pid)
    except (OSError, AttributeError):  # an older kernel, or not Linux
        handle = worker.sentinel
    if not _alive(worker.pid):  # it ended before the watch began
        os._exit(0)

    def watch() -> None:
        select.select([handle], [], [])  # readable once the worker has ended
        os._exit(0)

    threading.Thread(target=watch, name="torchspot-saver-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: the pid was reused
        return False
    return True


def _child_main(conn: Connection, make_writer: Callable[[RetryHook], Writer]) -> None:
    """The saver's loop: take the buffer, write each state it is sent, answer, stop on request or EOF."""
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return
    _die_with_worker()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(SAVER_NICE)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s saver %(name)s: %(message)s")
    quiet_sdk_logs()
    writer: Writer | None = None
    failure = ""
    try:
        writer = make_writer(lambda step, error: conn.send(("retrying", step, error)))
    except Exception as exc:  # reported with every save rather than lost
        failure = f"cannot open checkpoint storage: {type(exc).__name__}: {exc}"
    buffer: torch.Tensor | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "buffer":
            buffer = message[1]
        elif message[0] == "save":
            _, step, skeleton, meta = message
            if writer is None or buffer is None:
                conn.send(("error", failure or "no shared buffer received"))
                continue
            try:
                report = writer(step, unpack(skeleton, buffer), meta)
            except Exception as exc:  # the parent raises it from wait()
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send(("done", report))
        else:
            return
