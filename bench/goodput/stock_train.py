"""The stock recipe's training program, for bench/goodput: how the AKS TorchElastic lab trains.

The lab (../shared/seeds/002) runs pytorch/elastic's ImageNet example under plain
`torchrun` with the `etcd` rendezvous. What this program does as that example does:
plain DDP; at every (re)start each rank loads the checkpoint file from the shared
folder, if there is one, and starts over the epoch it was written at; rank 0 writes
it synchronously (`torch.save` to a temporary file, then a rename) at the end of each
epoch; SIGTERM is not handled (a worker told to stop dies at once).

What it shares with torchspot's trainer, so that the benchmark compares the recipes
and not the models: the data (the same synthetic CIFAR-10 tarball), the model
(ResNet-18 from `torchspot_trainer.models`), batch size, optimizer and learning rate,
one evaluation at the end of each epoch. Instrumentation only: rank 0 prints the same
JSON event lines as torchspot's trainer (start, progress, checkpoint, eval), so one
report reads both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from torchspot_trainer.data.datasets import CIFAR_TARBALL, TensorImages, load_cifar10
from torchspot_trainer.models import MODELS


def _emit(rank: int, record: dict[str, Any]) -> None:
    if rank == 0:
        print(json.dumps({"t": time.time(), **record}), flush=True)


def _evaluate(model: nn.Module, test_set: TensorImages, rank: int, world: int) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        indices = list(range(rank, len(test_set), world))
        for start in range(0, len(indices), 256):
            items = [test_set[i] for i in indices[start : start + 256]]
            inputs = torch.stack([x for x, _ in items])
            labels = torch.tensor([y for _, y in items])
            correct += int((model(test_set.normalize(inputs)).argmax(1) == labels).sum())
            total += len(items)
    counts = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(counts)
    model.train()
    return float(counts[0] / counts[1])


def main() -> None:
    """Train until --epochs, resuming from --checkpoint-file at the start of its epoch."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, required=True, help=f"folder holding {CIFAR_TARBALL}")
    parser.add_argument("--checkpoint-file", type=Path, required=True, help="in a folder every node shares")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torch's default timeout (30 minutes for gloo), as in the example
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    train_set, test_set = load_cifar10(args.data / CIFAR_TARBALL)
    model = MODELS["resnet18"](10, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    epoch = step = 0
    if args.checkpoint_file.exists():
        saved = torch.load(args.checkpoint_file, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        epoch, step = int(saved["epoch"]), int(saved["step"])
    ddp = DistributedDataParallel(model)
    sampler: DistributedSampler[tuple[torch.Tensor, int]] = DistributedSampler(
        train_set, num_replicas=world, rank=rank, shuffle=True, seed=0
    )
    per_epoch = len(train_set)
    _emit(rank, {"event": "start", "step": step, "epoch": epoch, "world_size": world,
                 "trained_samples": epoch * per_epoch})  # fmt: skip
    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        done = 0
        for inputs, labels in DataLoader(train_set, batch_size=args.batch_size, sampler=sampler):
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(ddp(train_set.normalize(inputs)), labels)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step += 1
            done = min(done + len(labels) * world, per_epoch)
            _emit(rank, {"event": "progress", "step": step, "epoch": epoch, "world_size": world,
                         "loss": float(loss.detach()), "samples_per_s": len(labels) / (time.perf_counter() - began),
                         "trained_samples": epoch * per_epoch + done})  # fmt: skip
        epoch += 1
        accuracy = _evaluate(model, test_set, rank, world)
        _emit(rank, {"event": "eval", "step": step, "epoch": epoch, "accuracy": accuracy})
        if rank == 0:
            began = time.perf_counter()
            partial = args.checkpoint_file.with_suffix(".tmp")
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
            torch.save(state, partial)
            os.replace(partial, args.checkpoint_file)
            _emit(rank, {"event": "checkpoint", "step": step, "ok": True, "seconds": time.perf_counter() - began})
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
