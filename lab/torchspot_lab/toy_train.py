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

With `--in-place` it re-forms in place instead (handover.py, live.py): it registers with
its agent, every membership change hands it the next round, and it rebuilds only its gloo group;
at each generation's start the ranks agree on the newest step and take the weights from the lowest
rank holding it (a joiner, or a worker its agent restarted, is healed from a live peer). Each
generation writes `start` (the step it goes on from) and every rank `joined`, as a restart does;
`generation` then names the group. At the end every rank writes `finished` with its weights.

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

from torchspot_trainer import NODE_FAULT_EXIT
from torchspot_trainer.handover import Handover
from torchspot_trainer.recovery.live import LiveGroup, wait_for_assignment
from torchspot_trainer.recovery.outcome import Outcome

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
    parser.add_argument("--in-place", action="store_true", help="re-form in place at a membership change")
    parser.add_argument("--stop-file", type=Path, help="stop at the step this file names, once it exists")
    parser.add_argument(
        "--deaf-node",
        default="",
        help="with --in-place: on this node never acknowledge a round (its agent restarts it)",
    )
    parser.add_argument(
        "--bad-node",
        default="",
        help="on this node exit at once with the node-fault code, as the trainer does on a GPU it cannot use",
    )
    args = parser.parse_args(argv)
    if args.bad_node and os.environ.get("TORCHSPOT_NODE") == args.bad_node:
        _emit(args.events, "node-fault", pid=os.getpid())
        raise SystemExit(NODE_FAULT_EXIT)
    if args.in_place:
        _InPlace(args).run()
        return

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
    _emit(args.events, "joined", rank=rank, world=world, nccl=nccl, pid=os.getpid())
    if rank == 0:
        _emit(args.events, "start", step=step, world=world,
              restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))  # fmt: skip

    target = torch.linspace(-1.0, 1.0, _DIM)
    generator = torch.Generator().manual_seed(rank)
    while step < _last_step(args):
        x = torch.randn(_DIM, generator=generator)
        grad = (w - target) + 0.01 * x
        dist.all_reduce(grad)
        w -= 0.1 * grad / world
        time.sleep(args.step_time)
        step += 1
        if rank == 0:
            _emit(args.events, "step", step=step, world=world)
            if step % args.ckpt_every == 0 or step == _last_step(args):
                _save(args.ckpt_dir, step, w)
                _emit(args.events, "ckpt", step=step)
    if rank == 0:
        _emit(args.events, "done", step=step, world=world, loss=float((w - target).norm()))
    dist.destroy_process_group()


def _last_step(args: argparse.Namespace) -> int:
    """`--steps`, or the step `--stop-file` names once it exists (every rank reads the same)."""
    if args.stop_file is not None:
        try:
            return min(int(args.steps), int(args.stop_file.read_text()))
        except (OSError, ValueError):
            pass
    return int(args.steps)


KEEP: list[object] = []
"""The live group and its graveyard, referenced until the process ends (fork_server.run_program says why)."""
DEADLINE = 30.0
"""Seconds a collective or a wait for the next round may take before the worker takes the restart path."""


class _Deaf(Handover):
    """`--deaf-node`: a worker that never acknowledges a round (as one stuck holding the GIL would
    not), for the tests of its agent's fallback to the restart path."""

    def _acknowledge(self, generation: int) -> None:
        pass


class _InPlace:
    """The loop of `--in-place` (module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        deaf = os.environ.get("TORCHSPOT_NODE", "?") == args.deaf_node
        self.handover = _Deaf.from_environment() if deaf else Handover.from_environment()
        self.live = LiveGroup()
        KEEP.append(self.live)

    def heal(self, step: int, w: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """The newest step and its weights, from the lowest rank holding it; None if the group failed."""
        healed = w.clone()
        newest_step = self.live.heal(step, healed, time.monotonic() + DEADLINE)
        return None if newest_step is None else (newest_step, healed)

    def next_generation(self, step: int, w: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Enter the first round newer than the current one that forms; the state healed in it."""
        while True:
            assignment = wait_for_assignment(self.handover.read, self.live.generation, time.monotonic() + DEADLINE)
            if assignment is None:
                raise SystemExit(f"no round handed over within {DEADLINE:g} s")  # the restart path
            if self.handover.enter(self.live, assignment, time.monotonic() + DEADLINE):
                healed = self.heal(step, w)
                if healed is not None:
                    break
            # It did not form, or failed at once (a peer restarted, a newer round came): the next one.
        os.environ["MASTER_PORT"] = str(self.live.generation)  # names the group in _emit's records
        _emit(self.args.events, "joined", rank=self.live.rank, world=self.live.world, pid=os.getpid())
        if self.live.rank == 0:
            _emit(self.args.events, "start", step=healed[0], world=self.live.world, generation=self.live.generation)
        return healed

    def run(self) -> None:
        args, live = self.args, self.live
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.handover.register()
        found = _newest_checkpoint(args.ckpt_dir)
        step, w = self.next_generation(*(found if found else (0, torch.zeros(_DIM))))
        self.handover.watch(live)
        target = torch.linspace(-1.0, 1.0, _DIM)
        generator = torch.Generator().manual_seed(live.rank)
        while step < _last_step(args):
            x = torch.randn(_DIM, generator=generator)
            grad = (w - target) + 0.01 * x
            outcome = live.all_reduce(grad, time.monotonic() + DEADLINE)
            if outcome is not Outcome.DONE:
                if outcome is Outcome.FAILED:
                    self.handover.report_failure()
                step, w = self.next_generation(step, w)
                continue
            w -= 0.1 * grad / live.world
            time.sleep(args.step_time)
            step += 1
            if live.rank == 0:
                _emit(args.events, "step", step=step, world=live.world)
                if step % args.ckpt_every == 0:
                    _save(args.ckpt_dir, step, w)
                    _emit(args.events, "ckpt", step=step)
        self.handover.stop()
        _emit(args.events, "finished", rank=live.rank, step=step, w=w.tolist())
        if live.rank == 0:
            _emit(args.events, "done", step=step, world=live.world, loss=float((w - target).norm()))


if __name__ == "__main__":
    main()
