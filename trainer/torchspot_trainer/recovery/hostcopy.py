"""The training state in host memory at the last step boundary: what a node's snapshot is written from.

A worker often writes its snapshot (snapshot.py) because its group broke while it waits in a collective.
On a GPU that collective is queued work, and a `torch.save` of CUDA tensors would queue behind it
forever. So the state is copied to the host while the group is healthy, at step boundaries, and a
snapshot is written from that copy without touching the device.

- **On a GPU**: pinned buffers filled by a non-blocking copy on a side stream, overlapping the next
  step; the next update waits, on the device, until the copy has read what it changes. Copy k is whole
  once the device finished step k (`latest` asks its CUDA event, without waiting).
- **A ring of `SLOTS` (3)** whose newest whole copy a capture never takes: with the host two steps ahead
  of a device that hangs, the last step the device finished is still there (two slots lost it). When
  every other slot is in flight, the capture waits on the device: the host's lead is bounded by the ring.
- **No lock across a device call**: a wedged collective fills the launch queue and blocks a copy, and
  the SIGTERM watcher and the step watchdog must still reach the newest whole copy. Lock waits have a
  deadline (`LOCK_SECONDS`): past it, `write_from` writes nothing rather than hang.
- **On a CPU** the live tensors are host memory: the snapshot is written from them (no cost per step),
  except while the optimizer updates them (`before_update` until the next `capture`). `copy=True` takes
  real copies (the tests of the copy itself).
- **`every` K steps** costs 1/K as much; a snapshot then holds the last copy's step.
- **Buffers are frozen at the boundary** (`with_frozen`): the next forward writes BatchNorm's statistics
  before the update `before_update` guards, so a copy or snapshot read during it would pair step k's
  weights with step k+1's statistics.
- **A checkpoint of a step the ring holds is written from its copy** (`with_copy_of`): one wait for the
  device, where the live GPU state costs a blocking copy per tensor.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class _Slot:
    """One host copy: the state's structure with host tensors, its step, and (GPU) the copy's event."""

    state: dict[str, Any] | None = None
    step: int = -1
    buffers: list[torch.Tensor] = field(default_factory=list)
    done: Any = None
    """The CUDA event recorded after the copy (None on a CPU: the copy is done when `capture` returns)."""
    filling: bool = False
    """A capture is copying into it."""
    pins: int = 0
    """Snapshots being written from it: no capture takes it meanwhile."""


def _tensors(state: Any) -> list[torch.Tensor]:
    """The state's tensors, in a fixed walk order (dicts in insertion order)."""
    found: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(state)
    return found


def _replace(state: Any, host: list[torch.Tensor]) -> Any:
    """`state` with its tensors (in `_tensors` order) replaced by `host`; other values copied."""
    supply = iter(host)

    def build(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return next(supply)
        if isinstance(value, dict):
            return {key: build(item) for key, item in value.items()}
        if isinstance(value, list):
            return [build(item) for item in value]
        if isinstance(value, tuple):
            return tuple(build(item) for item in value)
        return copy.deepcopy(value)

    return build(state)


SLOTS = 3
"""Host copies in the ring on a GPU: the newest whole one, one in flight, one to fill next."""
LOCK_SECONDS = 5.0
"""How long a snapshot waits for the ring's lock (held only for bookkeeping, never across a device
call): longer means something is badly wrong, and no snapshot beats a worker that never exits."""


class HostCopy:
    """The newest whole host copy of the training state (see the module docstring).

    :param device: where training runs (a CUDA device: pinned buffers, side stream, a ring of slots).
    :param every: take a copy every this many steps.
    :param copy: copy the tensors (default: on a CUDA device only; on a CPU the live state is kept).
    :param slots: the ring's size when copying (at least 3: see the module docstring).
    :param fill: copies `live` into `buffers` and returns an event with `query()` and `synchronize()`
        for when the copy is done, or None when it is done on return (default: a side-stream CUDA copy on a
        GPU, a plain copy on a CPU; tests pass a device that stalls).
    """

    def __init__(
        self,
        device: torch.device,
        every: int = 1,
        *,
        copy: bool | None = None,
        slots: int = SLOTS,
        fill: Callable[[list[torch.Tensor], list[torch.Tensor]], Any] | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"a host copy every {every} steps: expected at least 1")
        if slots < SLOTS:
            raise ValueError(f"a ring of {slots} host copies: expected at least {SLOTS}")
        self.device = device
        self.every = every
        self.cuda = device.type == "cuda"
        self.copying = self.cuda or bool(copy) or fill is not None
        self._live: Callable[[], dict[str, Any]] | None = None
        """Without copies: what builds the live state, set at the last boundary."""
        self._updating = False
        self._slots = [_Slot() for _ in range(slots)]
        self._last: _Slot | None = None
        """The slot of the last capture (whole or in flight): the optimizer's update waits for it."""
        self._lock = threading.Lock()
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._fill = fill or (self._cuda_fill if self.cuda else _host_fill)
        self.copies = 0

    def due(self, step: int) -> bool:
        """True when `capture` at this step would take a copy."""
        return step % self.every == 0

    def keeps(self, step: int) -> bool:
        """True when `capture` at `step` keeps anything: always without copies (the live state), else
        when a copy is due. Lets the caller skip building what would be thrown away."""
        return not self.copying or self.due(step)

    def capture(self, step: int, build: Callable[[], dict[str, Any]]) -> None:
        """Copy the state `build()` returns (the live one: device tensors) to the host, if a copy is
        due at `step`. Without copies, keep `build` to call when a snapshot is written: nothing
        is built or copied per step.

        Call at a step boundary, from the training loop's thread. It may wait for the device (a
        full ring), never while holding what a snapshot needs."""
        if not self.copying:
            with self._lock:
                self._live, self._updating = build, False
            return
        if not self.due(step):
            return
        state = build()
        live = _tensors(state)
        slot = self._claim()
        done = None
        try:
            if [(b.shape, b.dtype) for b in slot.buffers] != [(t.shape, t.dtype) for t in live]:
                slot.buffers = [
                    torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda) for t in live
                ]  # the first copy, or the optimizer's state appeared (after its first step)
            done = self._fill(slot.buffers, live)
            filled = _replace(state, slot.buffers)
        except BaseException:
            with self._lock:
                slot.filling = False
            raise
        with self._lock:
            slot.state, slot.step, slot.done, slot.filling = filled, step, done, False
            self._last = slot
            self.copies += 1

    def _claim(self) -> _Slot:
        """A slot to fill: neither the newest whole one, nor one a snapshot is written from, nor one whose
        copy the device is still making (its buffers are being written). If every other slot is in
        flight, wait for the oldest to finish (the host's lead, bounded), holding no lock."""
        while True:
            with self._lock:
                slots = [(slot, slot.state is not None, slot.step, slot.done) for slot in self._slots]
            whole = {id(slot) for slot, filled, _, done in slots if filled and (done is None or bool(done.query()))}
            newest = max((s for s in slots if id(s[0]) in whole), key=lambda s: s[2], default=None)
            keep = None if newest is None else newest[0]
            with self._lock:  # only this thread fills slots: what changed since is at most a pin
                free = [
                    slot for slot, filled, _, _ in slots
                    if slot is not keep and not slot.pins and not slot.filling and (not filled or id(slot) in whole)
                ]  # fmt: skip
                if free:
                    chosen = min(free, key=lambda s: s.step)
                    chosen.state, chosen.filling = None, True  # not whole while the copy runs
                    return chosen
            flying = [s for s in slots if s[1] and id(s[0]) not in whole and s[3] is not None]
            if flying:
                min(flying, key=lambda s: s[2])[3].synchronize()  # the device, not a lock: the lead is bounded
            else:  # every other slot pinned or filling (a snapshot being written): give it a moment
                time.sleep(0.001)

    def _cuda_fill(self, buffers: list[torch.Tensor], live: list[torch.Tensor]) -> Any:
        """The copy on the side stream, after the step's work; its event."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for buffer, tensor in zip(buffers, live, strict=True):
                buffer.copy_(tensor.detach(), non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        return done

    def before_update(self) -> None:
        """Make the device wait, before the optimizer changes the parameters, until the last copy
        has read them (GPU; a CPU copy is done already; does not block the host). Without copies,
        mark the live state as changing until the next `capture` (and wait for a snapshot being
        written from it)."""
        if not self.copying:
            with self._lock:
                self._updating = True
            return
        last = self._last
        if self.cuda and last is not None and last.done is not None:
            torch.cuda.current_stream(self.device).wait_event(last.done)

    def latest(self) -> dict[str, Any] | None:
        """The newest whole copy (its "step" says which), without touching the device beyond asking its
        events; None before the first."""
        if not self.copying:
            return self.latest_live()
        with self._lock:
            slots = [(slot.state, slot.step, slot.done) for slot in self._slots if slot.state is not None]
        whole = [(state, step) for state, step, done in slots if done is None or bool(done.query())]
        return max(whole, key=lambda s: s[1])[0] if whole else None

    def write_from(self, write: Callable[[dict[str, Any] | None], T]) -> T:
        """`write(state)` with the newest whole copy (or None), that copy pinned meanwhile: no capture
        takes its slot, and none waits for the write. Without copies, the live state under the lock
        (no update starts meanwhile). A lock not had within `LOCK_SECONDS`: `write(None)`."""
        if not self.copying:
            if not self._lock.acquire(timeout=LOCK_SECONDS):
                return write(None)
            try:
                return write(self.latest_live())
            finally:
                self._lock.release()
        if not self._lock.acquire(timeout=LOCK_SECONDS):
            return write(None)
        try:
            candidates = [slot for slot in self._slots if slot.state is not None and not slot.filling]
            for slot in candidates:
                slot.pins += 1
        finally:
            self._lock.release()
        try:
            whole = [slot for slot in candidates if slot.done is None or bool(slot.done.query())]
            chosen = max(whole, key=lambda s: s.step) if whole else None
            return write(None if chosen is None else chosen.state)
        finally:
            with self._lock:
                for slot in candidates:
                    slot.pins -= 1

    def with_copy_of(self, step: int, use: Callable[[dict[str, Any] | None], T]) -> T:
        """`use(state)` with the copy of `step` once whole, its slot pinned meanwhile; `use(None)` when
        the ring holds no copy of that step (none due, or no copies: on a CPU the live state at the
        boundary is that state already). Waits for the device to finish the step and its copy, which
        reading the live state would wait for too. From the training thread, at a boundary."""
        if not self.copying:
            return use(None)
        with self._lock:
            slot = next((s for s in self._slots if s.state is not None and s.step == step and not s.filling), None)
            if slot is not None:
                slot.pins += 1
        if slot is None:
            return use(None)
        try:
            if slot.done is not None:
                slot.done.synchronize()
            return use(slot.state)
        finally:
            with self._lock:
                slot.pins -= 1

    def latest_live(self) -> dict[str, Any] | None:
        """Without copies: the live state, unless an update is under way (call holding the lock)."""
        return None if self._updating or self._live is None else self._live()


def with_frozen(tensors: list[torch.Tensor], build: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`build`, with each of `tensors` (a model's buffers) as it is now, at the step boundary, copied: any
    tensor of the built state whose storage is one of theirs (a `state_dict()` entry is a view of the
    buffer) is replaced by its copy, wherever the state holds it, whatever the state's layout (the
    recovery API's `state_dict` is the caller's; the trainer's holds its model under "model"). Whenever
    the state is built later, or copied on a side stream, its running statistics are this step's."""
    frozen = {(t.data_ptr(), t.shape): t.detach().clone() for t in tensors if t.numel()}
    if not frozen:
        return build

    def state() -> dict[str, Any]:
        built = build()
        live = _tensors(built)
        swapped = [frozen.get((t.data_ptr(), t.shape), t) if t.numel() else t for t in live]
        replaced: dict[str, Any] = _replace(built, swapped)
        return replaced

    return state


class BoundaryBuffers:
    """The model's buffers (BatchNorm's running statistics and batch counts) as they were at the last
    step boundary, copied on their device, for a step that breaks before its update: its forward
    passes updated them from its samples already, and a heal in which every rank is live sends
    nothing over them. Left so, every rank's statistics had taken one extra update from a step that
    was never applied, and the step taken again then gave rank 0's to everyone (in place: the
    manager's `should_commit`). A copy of a ResNet-50's buffers is about 200 KiB a step, on the device."""

    def __init__(self) -> None:
        self._kept: tuple[int, list[torch.Tensor]] | None = None

    def keep(self, buffers: list[torch.Tensor], step: int) -> None:
        """Copy the model's `buffers` as they are before the step after `step` (into the last copy's
        tensors where they fit)."""
        live = [buffer.detach() for buffer in buffers]
        kept = self._kept
        if kept is not None and [t.shape for t in kept[1]] == [t.shape for t in live]:
            for copy_, buffer in zip(kept[1], live, strict=True):
                copy_.copy_(buffer, non_blocking=True)
            self._kept = (step, kept[1])
            return
        self._kept = (step, [buffer.clone() for buffer in live])

    def restore(self, buffers: list[torch.Tensor], step: int) -> bool:
        """Put back the `buffers` kept at `step`, where the model is still at that step (the step after it
        broke before its update); whether it did."""
        kept = self._kept
        if kept is None or kept[0] != step:
            return False
        with torch.no_grad():
            for buffer, copy_ in zip(buffers, kept[1], strict=True):
                buffer.copy_(copy_)
        return True


def _host_fill(buffers: list[torch.Tensor], live: list[torch.Tensor]) -> None:
    """A CPU copy: done when it returns."""
    for buffer, tensor in zip(buffers, live, strict=True):
        buffer.copy_(tensor.detach())
