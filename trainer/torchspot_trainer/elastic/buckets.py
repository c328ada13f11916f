"""A step's DDP buckets in place: each bucket's average over the current generation, started as DDP's
communication hook hands it over, and the outcomes the commit rule reads (the manager's module docstring,
steps 2 and 3).

The first step of each generation goes whole: its buckets are held until the last one comes, then every
gradient travels in one all-reduce, laid out by the parameters' order in the model, the same on every
rank. DDP lays its buckets out by the parameters' order the first time it runs, and again, after its
first backward pass, by the order their gradients became ready; a rank that joins a generation has run no
backward pass yet, so its layout is the first one while the others' is the second. Every rank that shares
a step with it takes that step whole, and from the next one on every rank's DDP has rebuilt alike.

A bucket's all-reduce runs on a staging copy (recovery/live.py says why); the last one carries the
riders (riders.py) beside its gradients. Its future completes when the all-reduce ended, however it
ended: on gloo's thread as it ends (`LiveGroup.post_told`), when a newer round breaks the generation
(`give_up`), or, on a device plane, when a waiting thread sees it end (`LiveGroup.post`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import Outcome

__all__ = ["Bucket", "StepBuckets"]


class Bucket(Protocol):
    """What a step's gradients are posted as: DDP's `GradBucket`, or a sharded run's one flat bucket."""

    def buffer(self) -> torch.Tensor: ...

    def is_last(self) -> bool: ...

    def parameters(self) -> list[torch.Tensor]: ...


@dataclass
class _Held:
    """A bucket of a whole step (module docstring), held until the step's last bucket: DDP's bucket, its
    parameters' places in the model's order (`StepBuckets.order`), and the future DDP waits for."""

    tensor: torch.Tensor
    places: list[int]
    """Each of the bucket's parameters' place in the model's order, as the bucket lays them out."""
    future: torch.futures.Future[torch.Tensor] = field(default_factory=torch.futures.Future)


@dataclass
class _Bucket:
    """One DDP bucket's all-reduce in a step: what it sends (the average's staging copy, with the riders
    on the last one), DDP's bucket, and the future DDP waits for."""

    staging: torch.Tensor
    tensor: torch.Tensor
    last: bool
    outcome: Outcome | None = None
    future: torch.futures.Future[torch.Tensor] = field(default_factory=torch.futures.Future)
    whole: list[_Held] | None = None
    """A whole step's (module docstring): DDP's buckets it carries, each given its part as it ends."""


class StepBuckets:
    """The buckets of the step in flight, posted so far, and what the last one brought back."""

    def __init__(self) -> None:
        self.whole = True
        """The next step goes whole (module docstring): the generation's first. Set as one begins."""
        self._order: dict[int, int] = {}
        """Each parameter's place in the model's order, by its id (`order`)."""
        self._sizes: list[int] = []
        """Each parameter's number of elements, by its place."""
        self._refused: Outcome | None = None
        """Why a bucket of the step was not sent (`refuse`): a whole step then sends nothing either."""
        self._held: list[_Held] = []
        self._posted: list[_Bucket] = []
        self._lock = threading.Lock()
        """Guards `_posted` and each bucket's end, which gloo's threads and the watcher's reach."""
        self._ride: torch.Tensor | None = None
        """The riders the last bucket brought back, once its all-reduce completed."""
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchspot-buckets")

    def order(self, parameters: list[torch.Tensor]) -> None:
        """The model's parameters under DDP, in its order: a whole step's layout."""
        self._order = {id(parameter): place for place, parameter in enumerate(parameters)}
        self._sizes = [parameter.numel() for parameter in parameters]

    def clear(self) -> None:
        """A step begins: no bucket of it posted yet."""
        with self._lock:
            self._posted, self._held, self._ride, self._refused = [], [], None, None

    def posted(self) -> bool:
        """Whether a bucket of the step was posted or held (its backward pass ran)."""
        return bool(self._posted or self._held)

    def post(
        self,
        bucket: Bucket,
        live: LiveGroup,
        computing: int,
        *,
        riders: Callable[[torch.dtype, torch.device], torch.Tensor],
        deadline: float,
        zeros: bool = False,
    ) -> torch.futures.Future[torch.Tensor]:
        """Start `bucket`'s average over `live`'s current generation, in which `computing` ranks computed
        the step (every rank, but after a heal beside the step: heal.py), the last bucket with
        `riders(dtype, device)` beside its gradients; `zeros`: this rank sat the step out, and sends
        zeros for its gradients. On a device plane the wait gives up at `deadline`."""
        if self.whole:
            held = _Held(bucket.buffer(), [self._order[id(p)] for p in bucket.parameters()])
            self._held.append(held)
            if not bucket.is_last():
                return held.future
            tensor = self._in_model_order()
            last = True
        else:
            tensor = bucket.buffer()
            last = bucket.is_last()
        if last:  # one copy, its gradients' part then divided in place
            staging = torch.cat([tensor.reshape(-1), riders(tensor.dtype, tensor.device)])
            gradients = staging[: tensor.numel()]
            if zeros:
                gradients.zero_()
            else:
                gradients.div_(computing)
        else:
            staging = torch.zeros_like(tensor).reshape(-1) if zeros else tensor.reshape(-1) / computing
        posted = _Bucket(staging, tensor, last, whole=list(self._held) if self.whole else None)
        with self._lock:
            self._posted.append(posted)
        if self._refused is not None and self.whole:  # (the step's first bucket was not sent: nor is this)
            self._end(posted, self._refused)
        elif live.plane.separate:
            finish = live.post(posted.staging, control=False, owned=True)
            self._waiter.submit(lambda: self._end(posted, finish(deadline)))
        elif live.broken.is_set():  # a newer round came before this bucket: nothing to start
            self._end(posted, Outcome.BROKEN)
        else:
            live.post_told(posted.staging, partial(self._end, posted))
        return self._held[-1].future if self.whole else posted.future

    def _in_model_order(self) -> torch.Tensor:
        """A whole step's gradients, every held bucket's, laid out in the model's order (one copy)."""
        parts: dict[int, torch.Tensor] = {}
        for held in self._held:
            parts.update(self._by_place(held.tensor, held.places))
        return torch.cat([parts[place] for place in sorted(parts)])

    def _by_place(self, flat: torch.Tensor, places: list[int]) -> dict[int, torch.Tensor]:
        """`flat`, which holds the gradients of the parameters at `places` one after another, as a view of
        each by its place."""
        sizes = [self._sizes[place] for place in places]
        return dict(zip(places, torch.split(flat.reshape(-1), sizes), strict=True))

    def refuse(self, bucket: Bucket, outcome: Outcome) -> torch.futures.Future[torch.Tensor]:
        """`bucket` not sent: the step failed before its first collective (`outcome`). No staging copy:
        nothing is sent, and DDP gets its own bucket back (the step's update is not applied)."""
        tensor = bucket.buffer()
        posted = _Bucket(tensor.reshape(-1), tensor, bucket.is_last())
        with self._lock:
            self._posted.append(posted)
            self._refused = outcome
        self._end(posted, outcome)
        return posted.future

    def _end(self, posted: _Bucket, outcome: Outcome) -> None:
        """A bucket's all-reduce ended (or was given up): complete its future, once, with the average (a
        staging copy nobody reads again unless the outcome is DONE)."""
        with self._lock:
            if posted.outcome is not None:
                return
            posted.outcome = outcome
        numel = posted.tensor.numel()
        if posted.last and outcome is Outcome.DONE:
            self._ride = posted.staging[numel:].clone()
        average = posted.staging[:numel].view_as(posted.tensor)
        if posted.whole is not None:
            self._give_back(posted.whole, average if outcome is Outcome.DONE else None)
        posted.future.set_result(average)

    def _give_back(self, whole: list[_Held], average: torch.Tensor | None) -> None:
        """A whole step's average (None: it did not complete), each held bucket its part in its layout."""
        if average is None:  # (the update is not applied: DDP gets its own buckets back)
            for held in whole:
                held.future.set_result(held.tensor)
            return
        parts = self._by_place(average, sorted(place for held in whole for place in held.places))
        for held in whole:
            held.future.set_result(torch.cat([parts[place] for place in held.places]).view_as(held.tensor))

    def give_up(self) -> None:
        """A newer round broke the generation (the watcher's thread): give up the step's buckets in
        flight, whose all-reduce may now wait for a peer that moved on (a frozen one, or one re-forming)."""
        with self._lock:
            pending = [posted for posted in self._posted if posted.outcome is None]
        for posted in pending:
            self._end(posted, Outcome.BROKEN)

    def take(self) -> tuple[list[Outcome], torch.Tensor | None]:
        """The step's buckets' outcomes (each ended when the backward pass returned: DDP waited for every
        one) and the riders the last brought, if its all-reduce completed; the step's buckets are let go."""
        with self._lock:
            posted, self._posted = self._posted, []
        for bucket in posted:
            bucket.future.wait()
        return [bucket.outcome or Outcome.BROKEN for bucket in posted], self._ride
