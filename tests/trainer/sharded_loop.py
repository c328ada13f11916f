"""An FSDP2 training loop on the recovery API (`Manager(sharded=True)`), one rank of it: what test_sharded.py
runs at several world sizes. An MLP of fully_shard-ed layers, AdamW, a regression on fixed synthetic data,
the global batch fixed. Prints one JSON line per committed step on every rank (the samples it trained)
and, on rank 0, the step's loss over the global batch; at the end the full parameters.

Usage (torch's env:// variables set): python sharded_loop.py CHECKPOINT_URI STEPS [NOTICE_AFTER]
With NOTICE_AFTER, rank 1 sends itself SIGTERM (a spot node's notice) once that step committed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchspot_trainer.elastic import ElasticSampler, Manager, OptimizerWrapper

SAMPLES, GLOBAL_BATCH = 96, 12
"""The data set and the step's samples: 12 is divided by world sizes 1, 2 and 3."""


def model() -> nn.Sequential:
    """The model, as every world size starts it (before it is sharded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): a fixed regression."""
    inputs = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def optimizer_of(parameters: Iterator[nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameters, lr=1e-2)


def main() -> None:
    uri, steps = sys.argv[1], int(sys.argv[2])
    notice_after = int(sys.argv[3]) if len(sys.argv) > 3 else None
    model_and_optimizer: list[object] = []

    def state_dict() -> dict[str, object]:
        weights, moments = get_state_dict(*model_and_optimizer)  # type: ignore[arg-type]
        return {"model": weights, "optimizer": moments}

    def load_state_dict(state: dict[str, object]) -> None:
        set_state_dict(*model_and_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])  # type: ignore[arg-type]

    manager = Manager(state_dict, load_state_dict, checkpoint_uri=uri, checkpoint_every=3, sharded=True)
    manager.ensure_group()
    sharded = model()
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    optimizer = optimizer_of(sharded.parameters())
    model_and_optimizer.extend([sharded, optimizer])
    wrapped = OptimizerWrapper(manager, optimizer)
    sampler = ElasticSampler(manager, SAMPLES, global_batch=GLOBAL_BATCH, seed=0)
    inputs, targets = data()
    while manager.current_step() < steps:
        wrapped.zero_grad()
        ids = sampler.indices()
        loss = (sharded(inputs[ids]) - targets[ids]).pow(2).mean()
        loss.backward()
        wrapped.step()
        summed = loss.detach() * len(ids)
        dist.all_reduce(summed)
        line = {"step": manager.current_step(), "rank": manager.rank, "world": manager.world_size, "ids": ids,
                "loss": summed.item() / GLOBAL_BATCH}  # fmt: skip
        print(json.dumps(line), flush=True)
        if manager.rank == 1 and manager.current_step() == notice_after:
            os.kill(os.getpid(), signal.SIGTERM)
    manager.close()
    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).tolist() for name, p in sharded.named_parameters()}
    if manager.rank == 0:
        print(
            json.dumps({"final": full, "world": manager.world_size, "resumed_from": manager.resumed_from}), flush=True
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
