"""One optimizer step over a worker's micro-batches: the gradient is the exact mean over
the step's samples, whatever the world size and however the share is cut.

DDP averages gradients over ranks (divides the all-reduced sum by the ranks that computed the step), so
a rank's micro-batch contributes `sum of its losses x ranks / samples in the step`; summed over
micro-batches and averaged over ranks that is the mean over the step's samples even when they do not
divide evenly (a short last step, uneven shares). Gradients of all but the last micro-batch accumulate
locally under `no_sync`, and the last backward pass all-reduces them once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchspot_trainer.precision import Precision, Stepper


def model_inputs(
    batch: torch.Tensor,
    device: torch.device,
    precision: Precision,
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A loaded batch as the model's input: copied to the device, in the model's memory format
    while still uint8 (a quarter of the bytes to permute), then normalised (data.Normalize).
    Training and evaluation both prepare their batches here."""
    inputs = precision.inputs(batch.to(device, non_blocking=True))
    return inputs if normalize is None else normalize(inputs)


def train_step(
    ddp: nn.Module,
    optimizer: Stepper,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    passes: int,
    step_samples: int,
    among: int,
    device: torch.device,
    precision: Precision | None = None,
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Run `passes` micro-batches from `batches` forward and backward, then step the optimizer (the step
    has begun: the caller zeroed the gradients).

    `among`: the ranks whose gradients the step averages over (the world, or after a heal beside the step
    its trainers). Returns this rank's summed loss and correct predictions as device tensors (read them
    at log time: no host synchronisation per step), and whether the update was applied (counted: the
    recovery API's `OptimizerWrapper.step` refuses a step whose all-reduce did not complete).
    `precision` (default fp32) runs the forward passes under its autocast and steps through its gradient
    scaler. `normalize` turns the loader's uint8 batch into the model's float input after the copy to the
    device (data.Normalize).
    """
    precision = precision or Precision("fp32", device)
    ddp.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    scale = among / max(step_samples, 1)
    for index in range(passes):
        inputs, labels = next(batches)
        inputs = model_inputs(inputs, device, precision, normalize)
        labels = labels.to(device, non_blocking=True)
        last = index == passes - 1
        with ddp.no_sync() if isinstance(ddp, DistributedDataParallel) and not last else contextlib.nullcontext():
            with precision.autocast():
                logits = ddp(inputs)
            summed = nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
            precision.backward(summed * scale)
        loss_sum += summed.detach()
        correct += (logits.detach().argmax(1) == labels).sum()
    applied = precision.step(optimizer)
    return loss_sum, correct, applied


def warm_up(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    device: torch.device,
    precision: Precision,
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """One forward and backward pass of `model` on a loader-shaped batch, its effects undone: the
    buffers (BatchNorm's running statistics and counts) restored, the gradients dropped. Nothing of
    the model's state changes; what stays is what a process's first pass pays once (the autograd
    engine's start, oneDNN's or cuDNN's kernels for these shapes, the allocator's pools).

    A worker that joins a group training in place takes its first step with the others waiting for
    it in the gradient all-reduce. Cold, that step cost the small CNN 22 ms on these CPU cores
    against 5 ms warm; on GPUs cudnn.benchmark's search made ResNet-50's first step 3-11 s on an
    H200 (docs/recovery.md, "Recovery on GPUs"). Paid here, during its set-up, the others never wait for it.
    The caller keeps the random number generators' states around it (dropout draws from them)."""
    kept = [buffer.detach().clone() for buffer in model.buffers()]
    model.train()
    with precision.autocast():
        logits = model(model_inputs(inputs, device, precision, normalize))
    nn.functional.cross_entropy(logits.float(), labels.to(device)).backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for buffer, value in zip(model.buffers(), kept, strict=True):
            buffer.copy_(value)
    for parameter in model.parameters():
        parameter.grad = None
