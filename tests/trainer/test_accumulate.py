"""Gradient accumulation gives the optimizer the same step as one pass over the whole batch,
and sharded evaluation counts every test sample once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torchspot_trainer.evaluate import eval_batches
from torchspot_trainer.models import SmallCNN
from torchspot_trainer.precision import Precision
from torchspot_trainer.step import train_step


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A real one-process gloo group (DDP needs one)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _step(
    inputs: torch.Tensor, labels: torch.Tensor, cuts: list[int], precision: str = "fp32"
) -> tuple[dict[str, torch.Tensor], float]:
    torch.manual_seed(0)
    model = SmallCNN(10)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    parts = [(inputs[a:b], labels[a:b]) for a, b in zip([0, *cuts], [*cuts, len(labels)], strict=True)]
    cpu = torch.device("cpu")
    optimizer.zero_grad(set_to_none=True)
    loss, _, applied = train_step(
        ddp, optimizer, iter(parts), passes=len(parts), step_samples=len(labels), among=1, device=cpu,
        precision=Precision(precision, cpu),
    )  # fmt: skip
    assert applied  # (a torch optimizer's step, or one the scaler skipped, is taken)
    return {k: v.clone() for k, v in model.state_dict().items()}, float(loss)


@pytest.mark.usefixtures("group")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_step_in_reduced_precision_is_near_the_fp32_step_and_not_equal_to_it(precision: str) -> None:
    """Autocast really ran (the step differs from fp32's) and the loss stayed float32-scaled: the
    parameters land within reduced precision's error of the fp32 step. fp16 goes through the
    gradient scaler, whose scale must be undone exactly (a wrong unscale is off by 65536x)."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(16, 1, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (16,), generator=generator)
    reference, reference_loss = _step(inputs, labels, [8])
    reduced, reduced_loss = _step(inputs, labels, [8], precision)
    assert reduced_loss == pytest.approx(reference_loss, rel=2e-2)
    assert any(not torch.equal(reduced[k], reference[k]) for k in reference)
    for name, tensor in reference.items():
        assert torch.allclose(reduced[name], tensor, atol=2e-2), name
    torch.manual_seed(0)
    untouched = SmallCNN(10).state_dict()  # the step was taken (a scaler that saw inf would skip it)
    moved = max(float((reduced[k] - untouched[k]).abs().max()) for k in untouched)
    assert moved > 10 * max(float((reduced[k] - reference[k]).abs().max()) for k in reference)


def test_precision_names_are_checked_and_fp16_keeps_its_scale_in_the_state() -> None:
    with pytest.raises(ValueError, match="--precision 'fp8'"):
        Precision("fp8", torch.device("cpu"))
    assert Precision("bf16", torch.device("cpu")).state_dict() == {}
    scaled = Precision("fp16", torch.device("cpu"))
    state = scaled.state_dict()
    assert state["scale"] == 65536.0
    resumed = Precision("fp16", torch.device("cpu"))
    resumed.load_state_dict({**state, "scale": 1024.0})  # GradScaler's own numbers: older checkpoints
    assert resumed.state_dict()["scale"] == 1024.0


def test_the_scalers_state_is_tensor_copies_not_host_reads() -> None:
    """After a step the scale and growth tracker are copies of the device tensors (GradScaler's
    state_dict reads each with .item(), a host sync on a GPU); a later update does not change
    the copy, and it loads into a fresh scaler."""
    cpu = torch.device("cpu")
    precision = Precision("fp16", cpu)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        with precision.autocast():
            loss = model(torch.ones(4, 3)).float().sum()
        precision.backward(loss)
        precision.step(optimizer)
        optimizer.zero_grad()

    step()
    state = precision.state_dict()
    assert isinstance(state["scale"], torch.Tensor)
    assert isinstance(state["_growth_tracker"], torch.Tensor)
    assert precision.scaler is not None
    assert float(state["scale"]) == precision.scaler.get_scale()
    kept = float(state["scale"]), int(state["_growth_tracker"])
    step()  # the live tracker moves on (or the scale backs off); the copy taken before does not
    assert (precision.scaler.get_scale(), precision.scaler._get_growth_tracker()) != kept
    assert (float(state["scale"]), int(state["_growth_tracker"])) == kept
    resumed = Precision("fp16", cpu)
    resumed.load_state_dict(state)
    assert resumed.scaler is not None
    assert (resumed.scaler.get_scale(), resumed.scaler._get_growth_tracker()) == kept


@pytest.mark.usefixtures("group")
def test_micro_batches_of_uneven_sizes_make_the_same_step_as_one_pass() -> None:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(11, 1, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (11,), generator=generator)
    whole, whole_loss = _step(inputs, labels, [])
    cut, cut_loss = _step(inputs, labels, [3, 4, 8])  # 3, 1, 4 and 3 samples
    assert cut_loss == pytest.approx(whole_loss, rel=1e-6)
    for name, tensor in whole.items():
        assert torch.allclose(cut[name], tensor, atol=1e-6), name
    # The step moved the parameters: an accumulation that dropped a pass would not match.
    torch.manual_seed(0)
    untouched = SmallCNN(10).state_dict()
    assert any(not torch.equal(untouched[k], whole[k]) for k in whole)
    dropped, _ = _step(inputs[:8], labels[:8], [3, 4])
    assert any(not torch.allclose(dropped[k], whole[k], atol=1e-6) for k in whole)


@pytest.mark.parametrize(("length", "world", "size"), [(450, 3, 64), (10, 4, 256), (7, 3, 2)])
def test_evaluation_shards_cover_the_test_set_once_in_equal_batch_counts(length: int, world: int, size: int) -> None:
    plans = [eval_batches(length, rank, world, size) for rank in range(world)]
    assert len({len(plan) for plan in plans}) == 1  # the notice all-gathers between batches line up
    seen = sorted(i for plan in plans for batch in plan for i in batch)
    assert seen == list(range(length))
    assert max(len(batch) for plan in plans for batch in plan) <= size
