"""A loop that evaluates between steps, heeding notices at each batch as the built-in trainer's evaluation
does, for a node frozen between two steps and thawed while the other evaluates: `python thaw_loop.py OUT`
under torchspot-run, on two nodes, HOLD_NODE naming one of them.

- At world size 2, the node HOLD_NODE holds after the first step it commits whose number is 1 past a
  multiple of EVAL_EVERY, before the loop's own sum of that step's loss: it writes the step to OUT/held
  and waits (60 s at most) for OUT/go, so that the test freezes it there, between steps.
- The other node, alone, trains on to the next evaluation (at a multiple of EVAL_EVERY). Alone, after the
  hold, it holds in that evaluation (60 s at most) calling `heed_notices` until the group changes, having
  written OUT/evaluating: the test thaws the frozen node then.
- Each evaluation that completes appends {"node", "step", "world_size"} to OUT/evaluations.jsonl; the
  manager's records go to OUT/records.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchspot import elastic

STEPS = 300
EVAL_EVERY = 4
PACE = 0.1
"""Seconds a step takes at least before the hold, at world size 1: the other node joins meanwhile."""
SAMPLES, GLOBAL_BATCH = 64, 8


def main(out: Path) -> None:
    node = os.environ["TORCHSPOT_NODE"]
    holds = node == os.environ["HOLD_NODE"]
    held, go, evaluating = out / "held", out / "go", out / "evaluating"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    evaluated = [0]
    manager = elastic.Manager(
        state_dict=lambda: {"model": model.state_dict(), "optimizer": inner.state_dict(), "evaluated": evaluated[0]},
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optimizer"]),
                                   evaluated.__setitem__(0, int(s["evaluated"]))),
        checkpoint_uri="", events_file=out / "records.jsonl", device=torch.device("cpu"),
    )  # fmt: skip
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, inner)
    sampler = elastic.ElasticSampler(manager, SAMPLES, global_batch=GLOBAL_BATCH)
    inputs = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(SAMPLES) % 2

    def evaluate(step: int) -> bool:
        """True where it completed in one group (False: the group changed, and the loop begins it again)."""
        if manager.world_size == 1 and held.exists() and not evaluating.exists():
            evaluating.write_text(str(step))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if manager.heed_notices():
                    return False
                time.sleep(0.05)  # an evaluation's batch: the test thaws the other node meanwhile
        for _batch in range(3):
            if manager.heed_notices():
                return False
        if not manager.all_reduce(torch.ones(1)):
            return False
        evaluated[0] = step
        manager.state_changed()
        with (out / "evaluations.jsonl").open("a") as lines:
            lines.write(json.dumps({"node": node, "step": step, "world_size": manager.world_size}) + "\n")
        return True

    while True:
        step = manager.current_step()
        if not manager.state_arriving:  # (one that is takes the group's next step first)
            if step and step % EVAL_EVERY == 0 and evaluated[0] != step and not evaluate(step):
                continue
            if step >= STEPS:
                break
        if manager.world_size == 1 and not held.exists():
            time.sleep(PACE)  # pacing the workload until the other node joins, not waiting for a condition
        optimizer.zero_grad()
        batch = sampler.indices()
        loss = F.cross_entropy(ddp(inputs[batch]), labels[batch])
        loss.backward()  # type: ignore[no-untyped-call]
        if not optimizer.step():
            continue
        step = manager.current_step()
        if holds and manager.world_size == 2 and step % EVAL_EVERY == 1 and not held.exists():
            held.write_text(str(step))
            deadline = time.monotonic() + 60
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the test freezes this node here
        manager.all_reduce(loss.detach())  # the loop's figure, between steps
    manager.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
