"""A small elastic training program for the launcher's tests, benchmark and demo.

Run under torchrun/torchspot-run (one process per "node" here). It fits a linear
model with a real gloo all-reduce every step, checkpoints to a local folder every
`--ckpt-every` steps (write to a temporary file, then rename: a reader never sees a
partial checkpoint), resumes from the newest checkpoint on every start, and rank 0
appends one JSON line per event to `--events`, which the harness reads to measure
recovery:

- `joined`: every rank, once per worker group (rank, world size, node);
- `start`: a worker group began (world size, step resumed from, node);
- `step`: a training step completed (every rank agreed on it through all-reduce);
- `ckpt`: a checkpoint was committed;
- `done`: the last step completed.

The full trainer (ResNet, exact-once data, Blob checkpoints) is a separate program;
this one stays small so an agent restart costs what torch costs, not what a model costs.
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

_DIM = 32


def _emit(path: Path, event: str, **fields: Any) -> None:
    record = {
        "event": event,
        "t": time.time(),
        "node": os.environ.get("TORCHSPOT_NODE", "?"),
        # Each round publishes a fresh master port, so it identifies the worker group.
        "group": os.environ.get("MASTER_PORT", "?"),
    }
    record.update(fields)
    with path.open("a") as out:  # one short O_APPEND write per line: lines never interleave
        out.write(json.dumps(record) + "\n")


def _newest_checkpoint(folder: Path) -> tuple[int, torch.Tensor] | None:
    steps = sorted(
        (int(p.stem.split("-")[1]) for p in folder.glob("step-*.pt") if p.stem.split("-")[1].isdigit()),
        reverse=True,
    )
    for step in steps:
        try:
            state = torch.load(folder / f"step-{step}.pt", weights_only=True)
            return int(state["step"]), state["w"]
        except (OSError, RuntimeError, KeyError, EOFError):
            continue  # unreadable: fall back to the next older one
    return None


def _save(folder: Path, step: int, w: torch.Tensor) -> None:
    tmp = folder / f".step-{step}.pt.tmp-{os.getpid()}"
    torch.save({"step": step, "w": w}, tmp)
    os.replace(tmp, folder / f"step-{step}.pt")


def main(argv: list[str] | None = None) -> None:
    """Train for `--steps` steps, resuming from the newest checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="total training steps")
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of work per step")
    parser.add_argument("--events", type=Path, required=True, help="JSON-lines event file")
    args = parser.parse_args(argv)

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)

    found = _newest_checkpoint(args.ckpt_dir)
    step, w = found if found else (0, torch.zeros(_DIM))
    # Every rank starts from rank 0's view, so a checkpoint written between two
    # ranks' reads cannot split the group.
    start = torch.tensor([float(step)])
    dist.broadcast(start, src=0)
    dist.broadcast(w, src=0)
    step = int(start.item())
    # What the launcher set for NCCL (nccl.py) reaches the worker whatever torchrun's agent would set.
    nccl = {key: os.environ.get(key) for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_RETHROW_CUDA_ERRORS")}
    _emit(args.events, "joined", rank=rank, world=world, nccl=nccl)
    if rank == 0:
        _emit(args.events, "start", step=step, world=world,
              restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))  # fmt: skip

    target = torch.linspace(-1.0, 1.0, _DIM)
    generator = torch.Generator().manual_seed(rank)
    while step < args.steps:
        x = torch.randn(_DIM, generator=generator)
        grad = (w - target) + 0.01 * x
        dist.all_reduce(grad)
        w -= 0.1 * grad / world
        time.sleep(args.step_time)
        step += 1
        if rank == 0:
            _emit(args.events, "step", step=step, world=world)
            if step % args.ckpt_every == 0 or step == args.steps:
                _save(args.ckpt_dir, step, w)
                _emit(args.events, "ckpt", step=step)
    if rank == 0:
        _emit(args.events, "done", step=step, world=world, loss=float((w - target).norm()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
