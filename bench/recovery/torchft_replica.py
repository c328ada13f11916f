"""One TorchFT replica group (one process) for bench/recovery, under TorchFT's Manager with
`ProcessGroupGloo` and `torchft.Optimizer`, doing one of two kinds of work a step, so the peer is
measured on the same work as ours:

- `--work sleep` (the lab toy's step): `step_time` seconds of sleep, then a 32-weight linear model's
  forward and backward;
- `--work trainer` (our trainer's step in `bench/recovery`'s `trainer-inplace*` backends): the same
  small CNN (`small_cnn`) on the same digits, the global batch of 48 shared among the participants
  (`48 // participants` samples each, in micro-batches of at most 16, as our trainer cuts them at a
  largest world of 3), Nesterov SGD at lr 0.03: compute, not a sleep, which a process starting on
  the same cores slows as it slows ours.

The gradient goes through `Manager.allreduce` (what TorchFT's DDP comm hook calls), flattened into
one tensor as our trainer's in-place all-reduce is: in 0.2.0 its `torchft.DistributedDataParallel`
ends the survivors when a peer dies mid-all-reduce (the hook's `assert fut._fut` fails on the errored
work: seen in this bench's first runs), where the Manager's own call turns the error into a skipped
commit, its documented behaviour.

Each step: the optimizer's `zero_grad` starts the quorum, the work (as in real training it comes
before the gradients' all-reduce, so a peer frozen in it leaves the others waiting inside the
collective), the all-reduce across the live replicas through the Manager, and the commit vote
(`should_commit`, then the inner optimizer's step, as `torchft.Optimizer.step` does), which commits
only if every replica agrees. A replica that joins heals the whole state (model and optimizer) from a
live peer. One JSON line per step to `--events`: wall time, replica, the Manager's step,
participants, whether it committed.

Usage: torchft_replica.py --replica N --lighthouse ADDR --events FILE [--work sleep|trainer]
       [--step-time 0.05] [--gloo-timeout S] [--manager-timeout S] [--quorum-timeout S]
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
GLOBAL_BATCH = 48
MICRO_BATCH = 16
LR = 0.03
"""Our trainer's step in bench/recovery (its TRAINER): the global batch, the micro-batch at a largest
world of 3, the configuration's learning rate."""


class Work:
    """One replica's model, optimizer and step (the module docstring's two kinds)."""

    def __init__(self, kind: str, replica: int, step_time: float) -> None:
        self.kind, self.step_time = kind, step_time
        self.generator = torch.Generator().manual_seed(replica)
        if kind == "trainer":
            from torchspot_trainer.data.datasets import load_digits  # noqa: PLC0415 - only for this work
            from torchspot_trainer.models import SmallCNN  # noqa: PLC0415

            train, _ = load_digits()
            self.images = (train.images.float() / 255.0 - 0.5) / 0.5
            self.labels = train.labels
            torch.manual_seed(0)
            self.model: torch.nn.Module = SmallCNN(10, 1)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9, nesterov=True)
        else:
            self.model = torch.nn.Linear(_DIM, 1, bias=False)
            torch.nn.init.zeros_(self.model.weight)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.target = torch.linspace(-1.0, 1.0, _DIM)

    def backward(self, participants: int) -> None:
        """The step's work up to its gradients (zeroed before by the caller's `zero_grad`)."""
        if self.kind != "trainer":
            time.sleep(self.step_time)  # the step's compute, before its gradients are all-reduced
            x = torch.randn(8, _DIM, generator=self.generator)
            loss = ((self.model(x).squeeze(1) - x @ self.target) ** 2).mean()
            loss.backward()
            return
        share = max(1, GLOBAL_BATCH // max(participants, 1))
        picked = torch.randint(len(self.labels), (share,), generator=self.generator)
        for part in torch.split(picked, MICRO_BATCH):
            summed: torch.Tensor = torch.nn.functional.cross_entropy(
                self.model(self.images[part]), self.labels[part], reduction="sum"
            )
            (summed / share).backward()  # type: ignore[no-untyped-call]  # the share's mean, as our trainer's

    def gradient(self) -> torch.Tensor:
        """Every gradient in one tensor, as our trainer all-reduces them in place."""
        return torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None])

    def set_gradient(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.copy_(flat[offset : offset + p.grad.numel()].view_as(p.grad))
                offset += p.grad.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--work", choices=("sleep", "trainer"), default="sleep", help="a step's work (docstring)")
    parser.add_argument("--gloo-timeout", type=float, default=60.0, help="ProcessGroupGloo's (its default: 60 s)")
    parser.add_argument("--manager-timeout", type=float, default=60.0, help="Manager's timeout (its default: 60 s)")
    parser.add_argument("--quorum-timeout", type=float, default=60.0, help="Manager's quorum_timeout (60 s)")
    args = parser.parse_args()

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's own
    work = Work(args.work, args.replica, args.step_time)

    def state_dict() -> dict[str, object]:
        return {"model": work.model.state_dict(), "optim": work.optimizer.state_dict()}

    def load_state_dict(state: dict[str, dict[str, object]]) -> None:
        work.model.load_state_dict(state["model"])
        work.optimizer.load_state_dict(state["optim"])

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
    optimizer = Optimizer(manager, work.optimizer)
    participants = 1
    with args.events.open("a") as out:
        while True:
            optimizer.zero_grad()  # starts the quorum, which runs beside the work
            # The share follows the last step's quorum: asking for this one's would wait for it before
            # the work instead of beside it. A step at a new size is computed at the old one's share.
            work.backward(participants)
            flat = work.gradient()
            manager.allreduce(flat).wait()  # averaged over the participants; an error skips the commit
            work.set_gradient(flat)
            committed = manager.should_commit()  # what torchft.Optimizer.step does, keeping the vote
            if committed:
                work.optimizer.step()
            participants = manager.num_participants()
            record = {
                "t": time.time(),
                "replica": args.replica,
                "step": manager.current_step(),
                "participants": participants,
                "committed": committed,
                "quorum": manager._quorum_id,  # private in 0.2.0, which has no accessor: the step's quorum
            }
            out.write(json.dumps(record) + "\n")  # one short O_APPEND write: lines never interleave
            out.flush()


if __name__ == "__main__":
    main()
