"""A loop under float16's loss scaling (`elastic.GradScaler`) whose scaler skips one step's update, as it
does where the gradients hold inf: `python scaler_loop.py OUT` under torchspot-run (in place), or `run(OUT)`
in a process that has torchrun's environment (the restart path). OUT gets the model's weight as each
step began, by the steps counted then (a .pt file), and the manager's records (OUT.jsonl)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from torchspot import elastic

STEPS = 10
SKIPPED = 3
"""The step whose loss is made inf: its gradients too, so the scaler skips its update."""
SAMPLES, GLOBAL_BATCH = 40, 8


def run(out: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = elastic.Manager(
        state_dict=lambda: {"model": model.state_dict(), "optimizer": inner.state_dict()},
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optimizer"])),
        events_file=out.with_suffix(".jsonl"), device=torch.device("cpu"),
    )  # fmt: skip
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, inner)
    scaler = elastic.GradScaler(manager, "cpu")
    sampler = elastic.ElasticSampler(manager, SAMPLES, global_batch=GLOBAL_BATCH)
    inputs = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(SAMPLES) % 2
    weights: dict[int, torch.Tensor] = {}
    while manager.current_step() < STEPS:
        optimizer.zero_grad()
        weights[manager.current_step()] = model.weight.detach().clone()
        batch = sampler.indices()
        loss = F.cross_entropy(ddp(inputs[batch]), labels[batch])
        if manager.current_step() + 1 == SKIPPED:
            loss = loss * float("inf")
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        scaler.step(optimizer)
        scaler.update()
    weights[manager.current_step()] = model.weight.detach().clone()
    manager.close()
    torch.save(weights, out)


if __name__ == "__main__":
    run(Path(sys.argv[1]))
