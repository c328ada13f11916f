"""Checkpoint benchmark: our asynchronous save against a synchronous torch.save + upload.

The state is ResNet-50's model and SGD momentum buffers (about 205 MB), written to a
real Azurite Blob server in one run:

1. stall: how long the training loop is blocked per checkpoint. Ours: the
   snapshot copy in `CheckpointManager.save_async` (serialization and upload happen
   on a background thread). Stock: `torch.save` to a buffer plus `upload_blob`, as a
   training script without a checkpoint library would do it.
2. overhead: the time of `--steps` training steps with a checkpoint every
   `--every` steps, relative to the same steps with no checkpoint. A "step" is a
   matrix-multiply workload calibrated to `--step-ms` (ResNet-50 itself takes
   seconds per step on this CPU), so the numbers isolate what checkpointing costs
   the loop; the background save competes with it for the same two cores.

Usage: python bench/checkpoint/run.py [--reps 3] [--steps 200] [--every 100] [--step-ms 100] [--step-kind cpu|wait]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.record

from bench import record
from torchspot_lab.azurite import Azurite
from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.checkpoint.storage import BlobStorage, open_storage
from torchspot_trainer.models import resnet50


def resnet50_state() -> dict[str, Any]:
    """Model plus optimizer state of ResNet-50 after one SGD step (momentum buffers filled)."""
    model = resnet50()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}


def stock_save(storage: BlobStorage, name: str, state: dict[str, Any]) -> None:
    """What a plain training script does: serialize, then upload, blocking the loop."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    storage.put(name, buffer.getvalue())


def fake_step(weights: torch.Tensor, rounds: int) -> None:
    """A fixed amount of compute standing in for one training step."""
    for _ in range(rounds):
        weights = torch.tanh(weights @ weights)


def calibrate(step_ms: float) -> int:
    """Matrix-multiply rounds that take about `step_ms` milliseconds here."""
    weights = torch.randn(384, 384) * 0.05
    fake_step(weights, 10)
    started = time.perf_counter()
    fake_step(weights, 50)
    per_round = (time.perf_counter() - started) / 50
    return max(1, round(step_ms / 1000 / per_round))


def timed_loop(steps: int, every: int, rounds: int, save: Any) -> float:
    """Seconds for `steps` steps, calling `save(step)` every `every` steps (0: never).

    `rounds` > 0: a CPU step of that many matrix-multiply rounds; `rounds` < 0: a step
    that waits -rounds microseconds without using the CPU, as a host thread does while
    its GPU computes.
    """
    torch.manual_seed(0)
    weights = torch.randn(384, 384) * 0.05
    started = time.perf_counter()
    for step in range(1, steps + 1):
        if rounds < 0:
            time.sleep(-rounds / 1e6)
        else:
            fake_step(weights, rounds)
        if every and step % every == 0:
            save(step)
    return time.perf_counter() - started


def cpu_seconds(pid: int | None) -> float:
    """User plus system CPU time of a process and its children so far (0 if it is gone)."""
    if pid is None:
        return 0.0
    try:
        proc = psutil.Process(pid)
        total = 0.0
        for each in [proc, *proc.children(recursive=True)]:
            times = each.cpu_times()
            total += times.user + times.system
    except psutil.NoSuchProcess:
        return 0.0
    return total


def _save_from(manager: CheckpointManager, state: dict[str, Any], first: int, step: int) -> float:
    """Ours at `step` of a loop whose steps are numbered from `first`."""
    return manager.save_async(first + step, state, {})


def main() -> None:
    """Measure stall and overhead for both ways of saving; print ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement")
    parser.add_argument("--steps", type=int, default=200, help="steps in the overhead loop")
    parser.add_argument("--step-ms", type=float, default=100.0, help="time per step in milliseconds")
    parser.add_argument(
        "--step-kind",
        choices=("cpu", "wait"),
        default="cpu",
        help="cpu: the step computes on the CPU (all cores); wait: the step waits like a host thread whose GPU "
        "computes, leaving the CPU to the background save",
    )
    parser.add_argument(
        "--saver",
        choices=("process", "thread"),
        default="process",
        help="where ours serializes and uploads: a saver process (the trainer's default) or a thread",
    )
    parser.add_argument(
        "--blob-nice",
        type=int,
        default=0,
        help="niceness for Azurite: it stands in for a Blob service that on Azure does not run on the training "
        "node; 19 lets it use only CPU the training step leaves idle",
    )
    parser.add_argument("--every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/checkpoint-KIND/)")
    args = parser.parse_args()
    recording = record.Run(f"checkpoint-{args.step_kind}", args.out)

    state = resnet50_state()
    size = sum(t.numel() * t.element_size() for t in state["model"].values())
    size += sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values() for t in s.values())
    print(f"state: ResNet-50 model + SGD momentum = {size / 2**20:.0f} MiB", flush=True)

    with (
        tempfile.TemporaryDirectory(prefix="torchspot-ckpt-bench-") as tmp,
        Azurite(Path(tmp) / "azurite") as blob,
    ):
        if args.blob_nice:
            for proc in [psutil.Process(blob.pid), *psutil.Process(blob.pid).children(recursive=True)]:
                proc.nice(args.blob_nice)
        reopen = partial(open_storage, "az://bench/ckpt", blob.env(), timeout=60)
        storage = reopen()
        assert isinstance(storage, BlobStorage)
        manager = CheckpointManager(storage, reopen=None if args.saver == "thread" else reopen)

        stock_stalls, ours_stalls, ours_total = [], [], []
        for rep in range(args.reps):
            started = time.perf_counter()
            stock_save(storage, f"stock/{rep}.pt", state)
            stock_stalls.append(time.perf_counter() - started)
            ours_stalls.append(manager.save_async(rep, state, {}))
            report = manager.wait()
            assert report is not None
            assert report.ok
            ours_total.append(report.seconds)
            print(f"[{rep + 1}/{args.reps}] stall: stock {stock_stalls[-1]:.2f} s, ours {ours_stalls[-1]:.3f} s "
                  f"(background save {report.seconds:.2f} s)", flush=True)  # fmt: skip

        rounds = calibrate(args.step_ms) if args.step_kind == "cpu" else -round(args.step_ms * 1000)
        baseline, stock_loop, ours_loop, azurite_cpu, saver_cpu = [], [], [], [], []
        for rep in range(args.reps):
            baseline.append(timed_loop(args.steps, 0, rounds, lambda step: None))
            stock_loop.append(
                timed_loop(
                    args.steps,
                    args.every,
                    rounds,
                    lambda step: stock_save(storage, f"loop/{step}.pt", state),
                )
            )
            azurite_before, saver_before = cpu_seconds(blob.pid), cpu_seconds(manager.saver_pid)
            first = args.reps + rep * args.steps  # (steps of their own: a step's checkpoint commits once)
            ours_loop.append(timed_loop(args.steps, args.every, rounds, partial(_save_from, manager, state, first)))
            manager.wait()
            azurite_cpu.append(cpu_seconds(blob.pid) - azurite_before)
            saver_cpu.append(cpu_seconds(manager.saver_pid) - saver_before)
            times = f"none {baseline[-1]:.2f} s, stock {stock_loop[-1]:.2f} s, ours {ours_loop[-1]:.2f} s"
            cpu = f"CPU during ours: Azurite {azurite_cpu[-1]:.1f} s, saver process {saver_cpu[-1]:.1f} s"
            print(f"[{rep + 1}/{args.reps}] {args.steps} steps: {times} ({cpu})", flush=True)
        manager.close()

    stall_stock, stall_ours = statistics.median(stock_stalls), statistics.median(ours_stalls)
    base = statistics.median(baseline)
    over_stock = statistics.median(stock_loop) / base - 1
    over_ours = statistics.median(ours_loop) / base - 1
    with recording.captured():
        print("\nCheckpoint of ResNet-50 state to Azurite (medians)")
        print(f"  stall per checkpoint: stock {stall_stock:.2f} s, ours {stall_ours:.3f} s "
              f"-> ours is {100 * stall_ours / stall_stock:.1f}% of stock (target <= 10%)")  # fmt: skip
        print(f"  step-time overhead ({args.step_kind} steps of {args.step_ms:g} ms), checkpoint every {args.every} "
              f"steps: stock {100 * over_stock:+.1f}%, ours {100 * over_ours:+.1f}% (target <= 3%)")  # fmt: skip
        print(f"  CPU time during our loop: Azurite {statistics.median(azurite_cpu):.1f} s (on Azure: not on this "
              f"node), our saver process {statistics.median(saver_cpu):.1f} s")  # fmt: skip
    figures = {
        "state_mib": size / 2**20, "stall_stock_s": stock_stalls, "stall_ours_s": ours_stalls,
        "background_save_s": ours_total, "loop_none_s": baseline, "loop_stock_s": stock_loop,
        "loop_ours_s": ours_loop, "steps": args.steps, "every": args.every, "step_ms": args.step_ms,
        "step_kind": args.step_kind, "saver": args.saver, "blob_nice": args.blob_nice,
        "azurite_cpu_s": azurite_cpu, "saver_cpu_s": saver_cpu,
    }  # fmt: skip
    recording.write([], figures=figures)


if __name__ == "__main__":
    main()
