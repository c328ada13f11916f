"""Mixed precision: `--precision fp32|bf16|fp16`, and the GPU settings that go with it.

- fp32: no autocast; the reference.
- bf16: forward passes under autocast to bfloat16 (its float32 range needs no loss scaling).
  What ResNet-50 on current GPUs wants, with channels_last.
- fp16: autocast to float16 with a GradScaler (float16 gradients underflow without one);
  the scaler's state is part of the checkpoint, so a resumed run keeps its scale. With the
  fused optimizer a GPU uses (optim.optimizer_kernels) neither its step nor its state
  (`state_dict`) reads the device from the host.

The loss is computed from the autocast logits in float32 (autocast's policy for
cross-entropy), and the loss and accuracy sums stay float32 and int64.

On a GPU the model and its inputs also use channels_last, and cuDNN picks its fastest
convolution algorithms for the input shapes (`cudnn.benchmark`; the first steps of a new
shape are slower). On a CPU these are left off: autocast to bf16 runs there, slowly, and
is tested there. None of it has been measured on a GPU here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

PRECISIONS = ("fp32", "bf16", "fp16")


class Stepper(Protocol):
    """What a step's update goes through: a torch optimizer, or the recovery API's `OptimizerWrapper`
    (whose `step` says whether the update was applied)."""

    param_groups: list[dict[str, Any]]

    def step(self) -> Any: ...


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """How a step runs forward and backward, and how the optimizer steps, at one precision."""

    def __init__(self, name: str, device: torch.device, *, scaler: torch.amp.GradScaler | None = None) -> None:
        """`scaler`: fp16's gradient scaler (default torch's; the trainer's tells the recovery API of each
        update it skips: elastic.GradScaler)."""
        if name not in PRECISIONS:
            raise ValueError(f"--precision {name!r}: choose one of {', '.join(PRECISIONS)}")
        self.name = name
        self.device = device
        self.scaler = (scaler or torch.amp.GradScaler(device.type)) if name == "fp16" else None
        self.channels_last = device.type == "cuda"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass's context: autocast to this precision (nothing for fp32)."""
        if self.name == "fp32":
            yield
            return
        with torch.autocast(self.device.type, dtype=_DTYPES[self.name]):
            yield

    def inputs(self, batch: torch.Tensor) -> torch.Tensor:
        """A batch of images in the model's memory format (channels_last on GPUs)."""
        if self.channels_last and batch.dim() == 4:
            return batch.contiguous(memory_format=torch.channels_last)
        return batch

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()  # type: ignore[no-untyped-call]

    def step(self, optimizer: Stepper) -> bool:
        """Step the optimizer (fp16: unscaled, skipped on inf/NaN gradients, the scale updated). False where
        the step was refused (the recovery API's `OptimizerWrapper.step`: its all-reduce did not complete);
        a torch optimizer's step, or one the scaler skipped, counts as taken."""
        if self.scaler is None:
            return optimizer.step() is not False
        taken = self.scaler.step(optimizer)  # type: ignore[arg-type]  # (it calls `step`, reads `param_groups`)
        self.scaler.update()
        return taken is not False

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model in the memory format its inputs use; cuDNN's algorithm search on GPUs."""
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        return model.to(memory_format=torch.channels_last) if self.channels_last else model  # type: ignore[call-overload]

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (GradScaler.state_dict's keys), its scale and growth tracker as copies
        of the device tensors: GradScaler.state_dict reads both with `.item()`, two host syncs at
        every host copy of the state, which would stall the host's lead over the device. The copies
        are queued after the step's scale update and nothing writes them after, so the host copy's
        side stream reads them whole. Reads the scaler's private `_get_scale_async` and
        `_growth_tracker` (torch's own checkpointing code does); a test pins them."""
        scaler = self.scaler
        if scaler is None:
            return {}
        scale, tracker = scaler._get_scale_async(), scaler._growth_tracker
        return {
            "scale": scaler.get_scale() if scale is None else scale.detach().clone(),  # None: no step yet (no sync)
            "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
            "growth_interval": scaler.get_growth_interval(),
            "_growth_tracker": scaler._init_growth_tracker if tracker is None else tracker.detach().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state of `state_dict`'s (tensors) or of GradScaler's own (numbers, older checkpoints)."""
        if self.scaler is not None and state:
            numbers = {key: value.item() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
            self.scaler.load_state_dict(numbers)
