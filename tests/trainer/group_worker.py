"""One rank of a small real gloo group for test_group_paths.py: `group_worker.py SCENARIO RANK WORLD STORE OUT`.

- broadcast: rank 1 holds a training state (a model and an SGD optimizer after one step, RNG
  states, a NaN); it is sent to every rank with wire.broadcast_state; each rank saves what it
  got to OUT.
- control: every rank makes a second (gloo) group with group.control_group's call and gathers
  [rank, 10 x rank] through it from a Group whose device is `meta` (no memory at all): the
  per-step agreement must not touch the device. Each rank writes what it gathered to OUT.
- agree: rank 1 exits (a leaving node's rank) before rank 0 reaches the notice's barrier
  (Group.agree, through a control group, device `meta`); rank 0 writes what it returned and
  the seconds it took.
- ping: rank 0 pings with a 1 s timeout while rank 1 (a frozen peer) never joins the
  collective; rank 0 writes the ping's result and the seconds it took to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchspot_trainer.recovery.group import Group
from torchspot_trainer.recovery.rng import rng_state
from torchspot_trainer.recovery.wire import broadcast_state


def training_state() -> dict[str, Any]:
    """What the trainer checkpoints, small: model, optimizer (int-keyed state), RNG, a NaN."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 7,
        "rng": rng_state(),
        "evaluated": {"step": -1, "accuracy": float("nan")},
        "pair": (1, "two"),
    }


def main(scenario: str, rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    group = Group(rank, world, torch.device("cpu"))
    if scenario == "broadcast":
        state = broadcast_state(training_state() if rank == 1 else None, 1, rank, group.device)
        torch.save(state, out)
    elif scenario == "control":
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        agreed = Group(rank, world, torch.device("meta"), control).gather_ints([rank, 10 * rank])
        with open(out, "w") as file:
            json.dump(agreed, file)
    elif scenario == "agree":
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        # Both ends of the control group connected before rank 1 goes, as in a trainer (whose groups
        # formed long before a notice): a CI run saw rank 1 leave while rank 0 was still connecting.
        dist.barrier()
        if rank == 0:
            started = time.monotonic()
            try:
                done: Any = Group(rank, world, torch.device("meta"), control).agree(1.0)
            except RuntimeError as exc:  # gloo: the peer's socket closed
                done = f"raised: {exc}"[:200]
            with open(out, "w") as file:
                json.dump({"done": done, "seconds": time.monotonic() - started}, file)
        else:
            os._exit(0)  # the leaving node's rank: gone before the barrier
    elif scenario == "ping":
        if rank == 0:
            started = time.monotonic()
            done = group.ping(1.0)
            with open(out, "w") as file:
                json.dump({"done": done, "seconds": time.monotonic() - started}, file)
        else:
            time.sleep(3)  # frozen: never joins the ping
    sys.stdout.flush()
    os._exit(0)  # no shutdown handshake with a peer that may have gone


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
