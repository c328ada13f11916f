"""What only a CUDA GPU can show: the step and the state it hands the host copy make no host sync,
and an NCCL group bound to its device. Marked `cuda`: skipped (reported as not run) without a GPU,
as in CI; GPU claims elsewhere stay "not measured" until these have run on one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchspot_trainer.optim import build_optimizer
from torchspot_trainer.precision import Precision
from torchspot_trainer.recovery.group import group_device

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_an_fp16_step_and_its_state_make_no_host_sync(name: str) -> None:
    """torch raises on any host-device sync in sync-debug mode "error": GradScaler.step on an
    unfused optimizer reads found-inf on the host, and GradScaler.state_dict reads two scalars."""
    device = torch.device("cuda", 0)
    model = torch.nn.Linear(64, 8).to(device)
    optimizer = build_optimizer(model, name, lr=0.1, weight_decay=1e-4, device=device)
    precision = Precision("fp16", device)
    inputs = torch.randn(32, 64, device=device)
    for _ in range(2):  # the first step creates the scaler's and the optimizer's state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with precision.autocast():
                loss = model(inputs).float().square().mean()
            precision.backward(loss)
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            state = precision.state_dict()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert isinstance(state["scale"], torch.Tensor)
    assert state["scale"].device == device


def test_an_nccl_group_bound_to_its_device_forms_in_init(tmp_path: Path) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=group_device(device)
    )
    try:
        ones = torch.ones(4, device=device)
        dist.all_reduce(ones)
        assert torch.equal(ones.cpu(), torch.ones(4))
    finally:
        dist.destroy_process_group()
