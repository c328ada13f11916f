"""What the optimizer does per step: the data sets' reference recipes, the batch rule, the
learning-rate schedule, and the optimizer itself. Pure, except `build_optimizer`.

The batch rule decides whether a run computes the same model whatever happens to its
nodes. With `--global-batch-size` every optimizer step averages the gradient over the
same number of samples at any world size, so the peak learning rate is one number for
the whole run. With `--batch-size` per worker the group's batch follows the world size,
and `--lr-scaling` says how the learning rate follows it (Goyal et al. 2017's linear
rule, or the square-root rule); the rule is recorded in every checkpoint, and a resumed
run keeps the recorded one (`BatchRule.from_state`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

LR_SCALINGS = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class Recipe:
    """A data set's reference hyper-parameters: the peak learning rate for a global batch of
    `lr_batch` samples, and the weight decay, with where they come from."""

    lr: float
    lr_batch: int
    weight_decay: float
    source: str


RECIPES: dict[str, Recipe] = {
    "imagenet": Recipe(
        lr=0.1,
        lr_batch=256,
        weight_decay=1e-4,
        source="ResNet-50: Goyal et al. 2017, 'Accurate, Large Minibatch SGD' (0.1 x batch/256, "
        "weight decay 1e-4); torchvision's classification reference uses the same",
    ),
    "cifar10": Recipe(
        lr=0.1,
        lr_batch=128,
        weight_decay=5e-4,
        source="Zagoruyko and Komodakis 2016, 'Wide Residual Networks' (SGD with Nesterov momentum "
        "0.9, batch 128, learning rate 0.1, weight decay 5e-4)",
    ),
    "digits": Recipe(
        lr=0.05,
        lr_batch=48,
        weight_decay=5e-4,
        source="ours: small_cnn on scikit-learn's digits reaches over 90% test accuracy in 8 epochs",
    ),
}
"""Defaults of --lr, --lr-batch and --weight-decay per --dataset (documented in docs/trainer.md)."""


@dataclass(frozen=True)
class BatchRule:
    """How many samples an optimizer step averages over, and the peak learning rate for it."""

    global_batch_size: int
    """Samples per step for the whole group (0: `batch_size` per worker)."""
    batch_size: int
    lr: float
    lr_batch: int
    lr_scaling: str

    def step_batch(self, world: int) -> int:
        """Samples a full optimizer step averages over at this world size."""
        return self.global_batch_size or self.batch_size * world

    def peak_lr(self, world: int) -> float:
        """The peak learning rate at this world size: `lr` scaled from `lr_batch` to the step's
        batch by the rule (a constant when the global batch is fixed)."""
        ratio = self.step_batch(world) / self.lr_batch
        if self.lr_scaling == "linear":
            return self.lr * ratio
        if self.lr_scaling == "sqrt":
            return self.lr * math.sqrt(ratio)
        return self.lr

    def state_dict(self) -> dict[str, Any]:
        """For a checkpoint: plain numbers and a string (weights_only loads accept them)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BatchRule:
        """The rule a checkpoint recorded."""
        return cls(**{item.name: state[item.name] for item in fields(cls)})

    def resumed(self, recorded: dict[str, Any] | None) -> tuple[BatchRule, dict[str, tuple[Any, Any]]]:
        """The rule a resumed run follows, and {field: (flag's value, recorded value)} for the
        flags it ignores. The recorded rule wins: it is what makes the resumed run the same
        run. A checkpoint from before rules were recorded (None) leaves the flags' rule."""
        if recorded is None:
            return self, {}
        kept = BatchRule.from_state(recorded)
        ours, theirs = self.state_dict(), kept.state_dict()
        return kept, {key: (ours[key], theirs[key]) for key in ours if ours[key] != theirs[key]}


def learning_rate(peak: float, *, schedule: str, warmup: float, progress: float) -> float:
    """The learning rate at `progress` (fraction of the run's samples consumed). Pure.

    A function of samples, not steps, so it does not jump when the step count per epoch
    changes with the world size (per-worker batches)."""
    if warmup and progress < warmup:
        return peak * progress / warmup
    if schedule == "constant":
        return peak
    if schedule == "step":
        return peak * (0.1 ** sum(progress >= m for m in (0.5, 0.75)))
    span = (progress - warmup) / (1 - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(span, 1.0)))


def optimizer_kernels(device: torch.device) -> bool | None:
    """The optimizer's `fused` for parameters on `device`: True on a GPU, None (torch's choice) on a CPU. Pure.

    On a GPU the fused one: each step's update is a few kernels for all parameters instead of
    several per tensor, and a GradScaler (fp16) hands it the scale and the found-inf flag on the
    device rather than reading the flag on the host, which is a sync per step otherwise (torch's
    `_step_supports_amp_scaling`). On a CPU torch's default (foreach), which every CPU test and
    the equivalence bench were measured with."""
    return True if device.type == "cuda" else None


def build_optimizer(
    model: nn.Module, name: str, *, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum 0.9 (the recipes' optimizer), or AdamW; fused on a GPU
    (`optimizer_kernels`)."""
    fused = optimizer_kernels(device)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused)
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay, fused=fused
    )
