"""One worker of bench/api_cost: the DDP example's loop (examples/ddp) for `--steps` steps, either plain
(torch's DDP on torch's default group), plain with a Python comm hook (`plain-hook`: torch's own
`allreduce_hook`, DDP as the API runs it, with `find_unused_parameters=True`: what any design on a
comm hook pays, TorchFT's too) or on torchspot.elastic (in place under torchspot-run), timing the steps
after a warm-up in-process. Rank 0 prints one JSON line: steps per second."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "ddp"))
from common import CLASSES, FEATURES, synthetic_data  # type: ignore[import-not-found]

from torchspot import elastic

WARM_UP = 50
"""Steps not timed: DDP's first steps (its bucket set-up, the allocator's first sizes)."""


def build(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Linear(width, CLASSES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["plain", "plain-hook", "elastic"], required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=48)
    args = parser.parse_args()
    inputs, labels = synthetic_data()
    model = build(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    began = 0.0
    if args.mode.startswith("plain"):
        dist.init_process_group("gloo")
        hooked = args.mode == "plain-hook"
        ddp = DistributedDataParallel(model, find_unused_parameters=hooked)
        if hooked:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        rank, world = dist.get_rank(), dist.get_world_size()
        order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(0))
        for step in range(args.steps):
            if step == WARM_UP:
                began = time.perf_counter()
            optimizer.zero_grad()
            start = step * args.global_batch % len(inputs)
            batch = order[start : start + args.global_batch][rank::world]
            F.cross_entropy(ddp(inputs[batch]), labels[batch]).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    else:
        manager = elastic.Manager(
            state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            load_state_dict=lambda s: (model.load_state_dict(s["model"]), optimizer.load_state_dict(s["optimizer"])),
            checkpoint_uri="",
        )
        ddp = elastic.DistributedDataParallel(manager, model)
        wrapped = elastic.OptimizerWrapper(manager, optimizer)
        sampler = elastic.ElasticSampler(manager, len(inputs), global_batch=args.global_batch)
        while manager.current_step() < args.steps:
            if manager.current_step() == WARM_UP and not began:
                began = time.perf_counter()
            wrapped.zero_grad()
            batch = torch.tensor(sampler.indices())
            F.cross_entropy(ddp(inputs[batch]), labels[batch]).backward()  # type: ignore[no-untyped-call]
            wrapped.step()
        rank, world = manager.rank, manager.world_size
        manager.close()
    rate = (args.steps - WARM_UP) / (time.perf_counter() - began)
    if rank == 0:
        print(json.dumps({"mode": args.mode, "width": args.width, "world": world, "steps_per_s": rate}), flush=True)


if __name__ == "__main__":
    main()
