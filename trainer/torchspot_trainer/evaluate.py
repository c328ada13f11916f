"""Evaluation, sharded over the group and interruptible by an eviction notice.

Each rank scores its share of the test set (every world-th sample) through the trainer's loader, and the
counts are summed over the group. Before each batch `between` runs on every rank (the trainer heeds the
eviction notices there, an all-gather: `Manager.heed_notices`), so a notice that arrives while an ImageNet
validation runs (minutes, about the length of a spot notice) has its emergency checkpoint at once
instead of after it. Every rank runs the same number of batches (sampler.split_share), which keeps those
all-gathers in step. Where the group changes meanwhile (`between` says so, or the sums do not complete)
the evaluation is void, and the caller runs it again in the next group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

from torchspot_trainer.data.sampler import split_share


def eval_batches(length: int, rank: int, world: int, batch_size: int) -> list[list[int]]:
    """`rank`'s batches of a test set of `length` samples; the same count on every rank. Pure."""
    return split_share(list(range(length)), rank, world, batch_size)


def evaluate(
    model: nn.Module,
    length: int,
    *,
    rank: int,
    world: int,
    device: torch.device,
    batch_size: int,
    load: Callable[[list[list[int]]], Iterator[tuple[torch.Tensor, torch.Tensor]]],
    prepare: Callable[[torch.Tensor], torch.Tensor],
    between: Callable[[], bool],
    sums: Callable[[torch.Tensor], bool],
    autocast: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
) -> float | None:
    """Top-1 accuracy over a test set of `length` samples (every rank gets the same value), or None where
    the group changed before it was whole (`between` returned True, or `sums` did not complete).

    `load` yields the batches of the given sample indices (the trainer's persistent test loader);
    `prepare` makes a loaded batch the model's input on the device; `sums` sums a tensor over the group
    in place, True where it completed; `autocast` is the run's precision (`Precision.autocast`). The
    forward passes run under `inference_mode` and that autocast: in fp32 a bf16 or fp16 run's evaluation
    would pay the time and memory its precision saves in training (on GPUs; not measured here).
    """
    model.eval()
    correct = torch.zeros((), dtype=torch.float64, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.inference_mode():
        for inputs, labels in load(eval_batches(length, rank, world, batch_size)):
            if between():
                return None
            with autocast():
                logits = model(prepare(inputs))
            correct += (logits.argmax(1) == labels.to(device, non_blocking=True)).sum()
            total += len(labels)
    counts = torch.stack([correct, total])
    if not sums(counts):
        return None
    right, seen = counts.tolist()
    return float(right / max(seen, 1))
