"""The gradient all-reduce overlapped with the backward pass, for a worker that re-forms in place.

DDP reduces its gradients in buckets while the backward pass still computes the rest; the in-place
worker cannot use DDP (its group is replaced between two steps: live.py), and it reduced its
gradients in one all-reduce after the last backward pass. On 2 CPU cores, 3 ranks training
ResNet-18 that all-reduce took 0.6-0.8 s of a 3.1 s step, and DDP's run trained 12% faster
(17.3 against 15.1 samples/s, bench/README.md): the goodput benchmark's in-place runs trained below
their calibration between events by about that much.

`GradientBuckets` does what DDP's reducer does, on the live group: the parameters are dealt into
buckets in the reverse of their registration order (about the order backward produces their
gradients), a small first one and then up to `BUCKET_BYTES` each, as DDP's defaults; each
parameter's post-accumulate hook copies its gradient, divided by the world, into its bucket's flat
buffer, and a bucket whose gradients are all in is posted as an all-reduce, in bucket order, so
every rank posts the same collectives in the same order. The step's update waits for all of them
(`LiveCollectives.average_gradients`), so a step whose collectives did not all complete is not
applied, as before. A bucket that the backward pass did not fill (a parameter without a gradient,
a receiver that sat the step out and computed nothing) is posted at the update with zeros for what
is missing.

Each step's buffers are new and given to their collectives (`LiveGroup.post(owned=True)`): an
abandoned gloo collective writes into its buffer when a frozen peer thaws, so no buffer is reused.
Only on the host plane (gloo carries the gradients): on a device plane the hooks would run on
autograd's device threads and the collectives on NCCL's streams, which is not built or measured yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from torchspot_trainer.recovery.outcome import Outcome

FIRST_BUCKET_BYTES = 1024 * 1024
"""The first bucket's cap (DDP's `dist._DEFAULT_FIRST_BUCKET_BYTES`): the last layers' gradients come
first, and a small bucket starts the reduction early."""
BUCKET_BYTES = 25 * 1024 * 1024
"""The other buckets' cap (DDP's `bucket_cap_mb` default, 25 MiB)."""

Finish = Callable[[float], Outcome]
"""A posted collective: waits for it until the deadline (`LiveGroup.post`)."""
Post = Callable[[torch.Tensor], Finish]


def plan_buckets(numels: Sequence[int], element_bytes: Sequence[int], *, first: int, cap: int) -> list[list[int]]:
    """The parameters' indices dealt into buckets: in reverse order, each bucket closed once it holds
    `cap` bytes or more (the first one `first`), a parameter never split. Pure."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(numels))):
        current.append(index)
        size += numels[index] * element_bytes[index]
        if size >= (first if not buckets else cap):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class _Step:
    """One step's reduction: its buffers, what each still waits for, and what was posted."""

    post: Post
    world: int
    before_first: Callable[[], None]
    flats: list[torch.Tensor]
    missing: list[int]
    posted: list[Finish] = field(default_factory=list)


class GradientBuckets:
    """The model's parameters in buckets, their hooks, and the step being reduced (module docstring).

    :param parameters: the parameters whose gradients are averaged, in the model's order.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], *, first: int = FIRST_BUCKET_BYTES,
                 cap: int = BUCKET_BYTES) -> None:  # fmt: skip
        self.parameters = list(parameters)
        self.buckets = plan_buckets(
            [p.numel() for p in self.parameters], [p.element_size() for p in self.parameters], first=first, cap=cap
        )
        self._place: dict[int, tuple[int, int]] = {}
        """Parameter index -> (its bucket, its offset in the bucket's buffer)."""
        for number, bucket in enumerate(self.buckets):
            offset = 0
            for index in bucket:
                self._place[index] = (number, offset)
                offset += self.parameters[index].numel()
        self._step: _Step | None = None
        self._hooks = [  # held for the run: the model's parameters keep their buckets to the end
            p.register_post_accumulate_grad_hook(partial(self._accumulated, index))  # type: ignore[no-untyped-call]
            for index, p in enumerate(self.parameters)
        ]

    def arm(self, post: Post, world: int, before_first: Callable[[], None] = lambda: None) -> None:
        """Before the step's last backward pass: each bucket is posted with `post` once its gradients
        are in. `before_first` runs before the first is posted (a heal's sends are posted by then)."""
        flats = [
            torch.empty(sum(self.parameters[i].numel() for i in bucket), dtype=self.parameters[bucket[0]].dtype,
                        device=self.parameters[bucket[0]].device)
            for bucket in self.buckets
        ]  # fmt: skip
        self._step = _Step(post, world, before_first, flats, [len(bucket) for bucket in self.buckets])

    def disarm(self) -> None:
        """Drop the step being reduced (its collectives, if any were posted, are the group's now)."""
        self._step = None

    def complete(self, post: Post, world: int) -> list[tuple[torch.Tensor, Finish]]:
        """At the update: every bucket's buffer and posted collective, in bucket order, the ones the
        backward pass did not post (or all, unarmed) posted now with what gradients there are."""
        step = self._step or _Step(post, world, lambda: None, [torch.empty(0)] * len(self.buckets),
                                   [len(bucket) for bucket in self.buckets])  # fmt: skip
        self._step = None
        for number in range(len(step.posted), len(self.buckets)):
            if step.missing[number]:
                step.flats[number] = self._gathered(number, step.world)
            step.posted.append(step.post(step.flats[number]))
        return list(zip(step.flats, step.posted, strict=True))

    def assign(self, flats: Sequence[torch.Tensor]) -> None:
        """Each parameter's gradient, a view of its bucket's reduced buffer."""
        for number, bucket in enumerate(self.buckets):
            for index in bucket:
                parameter = self.parameters[index]
                offset = self._place[index][1]
                parameter.grad = flats[number][offset : offset + parameter.numel()].view_as(parameter)

    def _gathered(self, number: int, world: int) -> torch.Tensor:
        """Bucket `number`'s buffer from the gradients as they are (zeros where there is none)."""
        parts = []
        for index in self.buckets[number]:
            parameter = self.parameters[index]
            grad = parameter.grad
            parts.append(torch.zeros(parameter.numel(), dtype=parameter.dtype, device=parameter.device)
                         if grad is None else grad.reshape(-1) / world)  # fmt: skip
        return torch.cat(parts)

    def _accumulated(self, index: int, parameter: torch.Tensor) -> None:
        """A parameter's gradient is in (its post-accumulate hook): into its bucket; the buckets that
        are full and whose predecessors were posted, posted."""
        step = self._step
        if step is None or parameter.grad is None:
            return
        number, offset = self._place[index]
        target = step.flats[number][offset : offset + parameter.numel()]
        torch.div(parameter.grad.reshape(-1), step.world, out=target)
        step.missing[number] -= 1
        while len(step.posted) < len(self.buckets) and step.missing[len(step.posted)] == 0:
            if not step.posted:
                step.before_first()
            step.posted.append(step.post(step.flats[len(step.posted)]))
