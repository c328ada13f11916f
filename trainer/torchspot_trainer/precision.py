"""Mixed precision: `--precision fp32|bf16|fp16`, and the GPU settings that go with it.

- fp32: no autocast; the reference.
- bf16: forward passes under autocast to bfloat16 (its float32 range needs no loss scaling).
  What ResNet-50 on current GPUs wants, with channels_last.
- fp16: autocast to float16 with a GradScaler (float16 gradients underflow without one);
  the scaler's state is part of the checkpoint, so a resumed run keeps its scale.

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
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """How a step runs forward and backward, and how the optimizer steps, at one precision."""

    def __init__(self, name: str, device: torch.device) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"--precision {name!r}: choose one of {', '.join(PRECISIONS)}")
        self.name = name
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
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

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the optimizer (fp16: unscaled, skipped on inf/NaN gradients, the scale updated)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model in the memory format its inputs use; cuDNN's algorithm search on GPUs."""
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        return model.to(memory_format=torch.channels_last) if self.channels_last else model  # type: ignore[call-overload]

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else dict(self.scaler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
