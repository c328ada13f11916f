"""What only a CUDA GPU can show: the step and the state it hands the host copy make no host sync,
an NCCL group bound to its device, the host copy on its side stream, batches handed over on
DeviceAhead's stream, and the batched crop-resize on the device. Marked `cuda`: skipped (reported
as not run) without a GPU, as in CI. They passed on an NVIDIA H200 (torch 2.11.0+cu130) on
2026-11-27: `pytest -m cuda tests/trainer/test_cuda.py tests/trainer/test_live.py`."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchspot_trainer.data.loader import DeviceAhead, crop_resize, to_device
from torchspot_trainer.optim import build_optimizer
from torchspot_trainer.precision import Precision
from torchspot_trainer.recovery.group import group_device
from torchspot_trainer.recovery.hostcopy import HostCopy, with_frozen
from torchspot_trainer.run import node_device, probe_device

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
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
        try:  # the mode is the process's: it must be reset whatever happens, or every later CUDA test fails
            torch.cuda.set_sync_debug_mode("error")
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


def test_the_host_copy_on_a_side_stream_is_the_boundarys_state() -> None:
    """The copy runs on a side stream while the next step's work is queued: once its event has
    passed it holds the boundary's weights and BatchNorm statistics, in pinned host memory."""
    device = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32)).to(device)
    copy = HostCopy(device)
    at_boundary = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    copy.capture(1, with_frozen(list(model.buffers()), lambda: {"model": model.state_dict(), "step": 1}))
    model.train()
    model(torch.randn(256, 64, device=device) + 3)  # the next forward, queued behind the copy
    held = copy.with_copy_of(1, lambda state: state)
    assert held is not None
    for name, tensor in at_boundary.items():
        assert held["model"][name].is_pinned()
        assert torch.equal(held["model"][name], tensor), name


def test_batches_decoded_or_copied_ahead_are_whole_on_the_consumers_stream() -> None:
    """DeviceAhead's side stream: the training stream waits for each batch's event, so a kernel on
    it reads the whole batch."""
    device = torch.device("cuda", 0)
    batches = [(torch.full((64, 3, 32, 32), i, dtype=torch.uint8).pin_memory(), torch.arange(64)) for i in range(5)]
    ahead = DeviceAhead(iter(batches), partial(to_device, device), device)
    seen = [(int(images.float().mean().item()), labels.device.type) for images, labels in ahead]
    assert seen == [(i, "cuda") for i in range(5)]


def test_the_batched_crop_resize_on_a_gpu_matches_the_cpu() -> None:
    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 300 + i, 400 - i), dtype=torch.uint8, generator=generator) for i in range(8)]
    boxes = [(10 * i, 5 * i, 10 * i + 250, 5 * i + 200) for i in range(8)]
    flips = [i % 2 == 0 for i in range(8)]
    on_cpu = crop_resize(images, boxes, flips, 224)
    on_gpu = crop_resize([i.cuda() for i in images], boxes, flips, 224).cpu()
    assert (on_gpu.int() - on_cpu.int()).abs().max() <= 1  # float rounding only


def test_a_healthy_gpu_passes_the_start_up_probe_and_is_chosen() -> None:
    """`node_device` on a GPU node: CUDA usable, the probe's computation runs, NCCL is the backend (a GPU
    that fails the probe is a node fault: the worker exits 75, and the probe's failure path is what
    test_data_models_config.py checks without a GPU)."""
    device, backend = node_device("cuda", 0, torch.cuda.is_available())
    assert (device, backend) == (torch.device("cuda", 0), "nccl")
    probe_device(device)
