"""The training state in host memory at the last step boundary: what a node's snapshot is written from.

A worker writes its node's snapshot (snapshot.py) as it stops, and it often stops because
its group is broken: a peer froze, or vanished, while this worker waits inside a collective.
On a GPU that collective is work queued on the device's stream, and so is anything queued
after it: a `torch.save` of CUDA tensors (a device-to-host copy) would wait behind the hung
collective forever, and the worker would be killed with no snapshot. So the state is copied
to the host while the group is still healthy, at step boundaries, and the snapshot is
written from that copy without touching the device.

- On a GPU: pinned host buffers, filled by a non-blocking copy on a side stream that starts
  when the step's work is done on the device, so the copy overlaps the next step's forward
  and backward passes. The next optimizer update waits (on the device, not the host) until
  the copy has read the parameters it would change. Two slots: the copy of step k is only
  whole once the device has finished step k; if step k's all-reduce hangs, the slot of step
  k-1 is the newest whole one (`latest` asks the copy's CUDA event, which does not wait).
- On a CPU there is no device to hang: the live tensors are host memory already, and the
  snapshot is written from them (no copy, no cost per step) unless the optimizer is
  updating them at that moment (`before_update` until the next `capture`). A failed
  collective inside a step (DDP's gradient all-reduce) comes before the update, so the
  state is then still the last completed step's. `copy=True` takes real copies on a CPU
  too (the tests of the copy itself).
- `every` K steps: a copy every K steps costs 1/K as much, and a snapshot then holds the
  step of the last copy (at most K-1 steps older than the last completed one).
"""

from __future__ import annotations

import copy
import threading
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

    def whole(self) -> bool:
        return self.state is not None and (self.done is None or bool(self.done.query()))


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


class HostCopy:
    """The newest whole host copy of the training state (see the module docstring).

    :param device: where training runs (a CUDA device: pinned buffers, side stream, two slots).
    :param every: take a copy every this many steps.
    :param copy: copy the tensors (default: on a CUDA device only; on a CPU the live state is kept).
    """

    def __init__(self, device: torch.device, every: int = 1, *, copy: bool | None = None) -> None:
        if every < 1:
            raise ValueError(f"a host copy every {every} steps: expected at least 1")
        self.device = device
        self.every = every
        self.cuda = device.type == "cuda"
        self.copying = self.cuda or bool(copy)
        self._live: Callable[[], dict[str, Any]] | None = None
        """Without copies: what builds the live state, set at the last boundary."""
        self._updating = False
        self._slots = [_Slot(), _Slot()] if self.cuda else [_Slot()]
        self._next = 0
        self._lock = threading.Lock()
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.copies = 0

    def due(self, step: int) -> bool:
        """True when `capture` at this step would take a copy."""
        return step % self.every == 0

    def capture(self, step: int, build: Callable[[], dict[str, Any]]) -> None:
        """Copy the state `build()` returns (the live one: device tensors) to the host, if a copy is
        due at `step`. Without copies, keep `build` to call when a snapshot is written: nothing
        is built or copied per step.

        Call at a step boundary, from the training loop's thread."""
        if not self.copying:
            with self._lock:
                self._live, self._updating = build, False
            return
        if not self.due(step):
            return
        state = build()
        live = _tensors(state)
        with self._lock:  # a snapshot being written from a slot keeps it until done
            slot = self._slots[self._next]
            if [(b.shape, b.dtype) for b in slot.buffers] != [(t.shape, t.dtype) for t in live]:
                slot.buffers = [
                    torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda) for t in live
                ]  # the first copy, or the optimizer's state appeared (after its first step)
            slot.state = None  # not whole while the copy runs
            if self.cuda:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    for buffer, tensor in zip(slot.buffers, live, strict=True):
                        buffer.copy_(tensor.detach(), non_blocking=True)
                    slot.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    slot.done.record(self._stream)
            else:
                for buffer, tensor in zip(slot.buffers, live, strict=True):
                    buffer.copy_(tensor.detach())
            slot.state, slot.step = _replace(state, slot.buffers), step
            self._next = (self._next + 1) % len(self._slots)
            self.copies += 1

    def before_update(self) -> None:
        """Make the device wait, before the optimizer changes the parameters, until the last copy
        has read them (GPU; a CPU copy is done already; does not block the host). Without copies,
        mark the live state as changing until the next `capture` (and wait for a snapshot being
        written from it)."""
        if not self.copying:
            with self._lock:
                self._updating = True
            return
        if not self.cuda:
            return
        last = self._slots[(self._next - 1) % len(self._slots)]
        if last.done is not None:
            torch.cuda.current_stream(self.device).wait_event(last.done)

    def latest(self) -> dict[str, Any] | None:
        """The newest whole copy (its "step" says which), without touching the device; None before
        the first. Held under the lock while `write` runs (see `write_from`)."""
        if not self.copying:
            return None if self._updating or self._live is None else self._live()
        whole = [slot for slot in self._slots if slot.whole()]
        return max(whole, key=lambda s: s.step).state if whole else None

    def write_from(self, write: Callable[[dict[str, Any] | None], T]) -> T:
        """`write(state)` with the newest whole copy (or None), no copy starting meanwhile."""
        with self._lock:
            return write(self.latest())
