"""One TorchFT replica group (one process) for bench/recovery: the lab toy's step under TorchFT's
Manager with `ProcessGroupGloo` and `torchft.Optimizer`, so the peer is measured on the same work as
ours. The gradient goes through `Manager.allreduce` (what TorchFT's DDP comm hook calls): in 0.2.0
its `torchft.DistributedDataParallel` ends the survivors when a peer dies mid-all-reduce (the hook's
`assert fut._fut` fails on the errored work: seen in this bench's first runs), where the Manager's
own call turns the error into a skipped commit, its documented behaviour.

Each step: the optimizer's `zero_grad` starts the quorum, `step_time` seconds of work (the step's
compute: as in real training it comes before the gradients' all-reduce, so a peer frozen in it
leaves the others waiting inside the collective), a 32-weight linear model's forward and backward,
its gradient all-reduced across the live replicas through the Manager, and the commit vote
(`should_commit`, then the inner optimizer's step, as `torchft.Optimizer.step` does), which commits
only if every replica agrees. One JSON line per step to `--events`: wall time, replica, the
Manager's step, participants, whether it committed.

Usage: torchft_replica.py --replica N --lighthouse ADDR --events FILE [--step-time 0.05]
       [--gloo-timeout S] [--manager-timeout S] [--quorum-timeout S]
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch._C._distributed_c10d import TCPStore
from torchft import Manager, Optimizer, ProcessGroupGloo

_DIM = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--gloo-timeout", type=float, default=60.0, help="ProcessGroupGloo's (its default: 60 s)")
    parser.add_argument("--manager-timeout", type=float, default=60.0, help="Manager's timeout (its default: 60 s)")
    parser.add_argument("--quorum-timeout", type=float, default=60.0, help="Manager's quorum_timeout (60 s)")
    args = parser.parse_args()

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's own
    model = torch.nn.Linear(_DIM, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer_inner = torch.optim.SGD(model.parameters(), lr=0.1)

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": optimizer_inner.state_dict()}

    def load_state_dict(state: dict[str, dict[str, object]]) -> None:
        model.load_state_dict(state["model"])
        optimizer_inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.gloo_timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timedelta(seconds=args.manager_timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
    )
    optimizer = Optimizer(manager, optimizer_inner)
    target = torch.linspace(-1.0, 1.0, _DIM)
    generator = torch.Generator().manual_seed(args.replica)
    with args.events.open("a") as out:
        while True:
            optimizer.zero_grad()
            time.sleep(args.step_time)  # the step's compute, before its gradients are all-reduced
            x = torch.randn(8, _DIM, generator=generator)
            loss = ((model(x).squeeze(1) - x @ target) ** 2).mean()
            loss.backward()
            assert model.weight.grad is not None
            manager.allreduce(model.weight.grad).wait()  # averaged over the participants; an error skips the commit
            committed = manager.should_commit()  # what torchft.Optimizer.step does, keeping the vote
            if committed:
                optimizer_inner.step()
            record = {
                "t": time.time(),
                "replica": args.replica,
                "step": manager.current_step(),
                "participants": manager.num_participants(),
                "committed": committed,
            }
            out.write(json.dumps(record) + "\n")  # one short O_APPEND write: lines never interleave
            out.flush()


if __name__ == "__main__":
    main()
