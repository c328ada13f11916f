"""A heal's state sent point to point beside a step: its source packs and posts the sends on its group's
sending thread while it trains the step (`send_beside`); a receiver gets it on a thread of its own
(`StateArrival`) while its trainers compute. The recovery API's heals (elastic/heal.py) use both; live.py
holds the sends' buffers with the generation.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from torchspot_trainer.recovery.live import POLL_SECONDS, LiveGroup
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome
from torchspot_trainer.recovery.wire import pack, unpack

__all__ = ["SIZES_TAG", "STATE_TAG", "StateArrival", "send_beside", "send_state"]

log = logging.getLogger("torchspot_trainer.recovery.live")

SIZES_TAG, STATE_TAG = 1, 2
"""The tags of a heal's two sends to a receiver (`send_state`, `StateArrival`): the state's sizes, then
its buffer. A generation's group is new, so its tags are too."""


def send_state(live: LiveGroup, state: Any, receivers: list[int], device: torch.device) -> None:
    """A heal's source: `state` (`wire.pack`) to each of `receivers` (`StateArrival`), without waiting
    for it to arrive (`LiveGroup.post_send`): the source trains its next step meanwhile."""
    sizes, buffer = pack(state, device)
    for rank in receivers:  # a send's buffer is its own until it completes (one per receiver)
        live.post_send(sizes.clone(), rank, SIZES_TAG)
        live.post_send(buffer if rank == receivers[0] else buffer.clone(), rank, STATE_TAG)


class StateArrival:
    """A heal's state on its way from rank `source` (`send_state`), received on a thread of its own
    while the training thread goes on (elastic/heal.py: a receiver waits for it only before its first collective,
    its trainers computing meanwhile). `result()` waits for it, giving up when the generation breaks.

    The thread receives in the data group current at construction, into buffers of its own held with
    that generation (a gloo receive's work completes only in its blocking `wait()`, which nothing can
    cancel: one given up on ends with gloo's op timeout, and its buffers stay held until then)."""

    def __init__(self, live: LiveGroup, source: int, device: torch.device, deadline: float) -> None:
        self._live, self._deadline = live, deadline
        self._done = threading.Event()
        self._state: Any = None
        self._error: Exception | None = None
        self._failed = False
        threading.Thread(
            target=self._run, args=(*live.receiving(), source, device), name="torchspot-arrival",
            daemon=True,
        ).start()  # fmt: skip

    def _run(self, group: Any, held: dict[int, torch.Tensor], source: int, device: torch.device) -> None:
        try:
            sizes = torch.zeros(2, dtype=torch.long, device=device)
            held[id(sizes)] = sizes
            group.recv([sizes], source, SIZES_TAG).wait()
            buffer = torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
            held[id(buffer)] = buffer
            group.recv([buffer], source, STATE_TAG).wait()
            held.pop(id(sizes)), held.pop(id(buffer))  # both received whole: nothing writes into them later
            self._state = unpack(sizes, buffer)
        except RuntimeError as exc:  # gloo: the source's socket closed, or the op timed out
            log.warning("the state from rank %d did not arrive (%s)", source, exc)
            self._failed = True
        except Exception as exc:  # a malformed state (WireError): the caller raises it
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> Any:
        """The state; GroupChanged if it did not arrive (the receive failed, a newer round broke the
        generation, or the deadline passed)."""
        while not self._done.wait(POLL_SECONDS * 5):
            if self._live.broken.is_set() or time.monotonic() > self._deadline:
                raise GroupChanged(Outcome.BROKEN)
        if self._error is not None:
            raise self._error
        if self._failed:
            raise GroupChanged(Outcome.FAILED)
        return self._state


def send_beside(live: LiveGroup, state: Any, receivers: list[int], device: torch.device) -> Future[None]:
    """`send_state` on `live`'s sending thread, beside the caller's forward and backward passes of the step
    its receivers sit out: packed first, the state would keep the others waiting on busy cores before it
    left. `state` is built at the boundary, its tensors ones that no pass writes (the model's buffers
    copied: `hostcopy.with_frozen`); the step's update cannot come before the state is packed, as its
    receivers join the step's all-reduce only once they have it. The caller waits for the future before
    the generation's next collective (`LiveGroup.on_sending_thread`); the future raises what stopped the
    sends (a state that cannot be sent)."""
    return live.on_sending_thread(partial(send_state, live, state, receivers, device))
