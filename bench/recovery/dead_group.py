"""A killed peer's gloo group in the survivors: looked at only at the next re-form (the graveyard
before a9054e3) against LiveGroup's reaper as it is, in the same run, trials alternating (issue 28;
recovery/live.py's module docstring says why such a group's event loop spins).

Each trial forks three ranks that train a toy step on `LiveGroup` as the trainer does: gradient
buckets posted between slices of compute (the backward pass), then the update's all-reduce waited
for first and the buckets after it. The parent SIGKILLs rank 0 at a random point, then hands the
survivors the next generation (world 2, as the agents would), in which they train on for `WINDOW`
seconds while each reads the CPU of the killed generation's gloo loop (its thread, gone once the
group is freed; the current generation's loop, busy with the step's data, is not counted).

- `held`: graves dug as before a9054e3, looked at only at the next re-form (none comes in the window);
- `released`: the reaper lets a grave go at once, or first closes its connections where a collective
  of it still runs (`close_connections`).

Reported per mode: the trials in which a survivor's old loop was still there at the window's end
(its group not freed), those in which it used more than `SPIN` of a core, its mean CPU, and the
survivors' steps in the window (a spin takes its CPU from the training beside it on these 2 cores).

Usage: python bench/recovery/dead_group.py [--trials 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore

from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import Outcome

BUCKETS = (250_000, 6_000_000, 5_500_000, 3_000_000)
"""Elements of each step's buckets (float32): a small first bucket, then about 25 MB ones, as DDP's
for ResNet-18 (46 MB of gradients)."""
WINDOW = 3.0
"""Seconds the survivors train in the next generation while their threads are read."""
SPIN = 0.2
"""A survivor's old gloo loop above this share of a core over the window: spinning (an idle loop used
0.005-0.02 here)."""
MODES = ("held", "released")


def _threads() -> dict[tuple[str, str], float]:
    """CPU seconds of each of this process's threads, by (thread id, name)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[tuple[str, str], float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        found[(task.name, name)] = (int(fields[11]) + int(fields[12])) / ticks
    return found


def _step(live: LiveGroup, compute: torch.Tensor, deadline: float) -> bool:
    """One toy step: buckets posted between slices of compute, the update's all-reduce, the buckets."""
    finishes = []
    for size in BUCKETS:
        torch.tanh(compute @ compute, out=compute)
        finishes.append(live.post(torch.randn(size), control=False, owned=True))
    if live.all_reduce(torch.zeros(1000), deadline) is not Outcome.DONE:
        return False
    return all(finish(deadline) is Outcome.DONE for finish in finishes)


def _rank(rank: int, port: int, mode: str, events: Any, orders: Any) -> None:
    torch.set_num_threads(1)
    live = LiveGroup(op_timeout=timedelta(seconds=30))
    assert live.reconfigure(Assignment(0, rank, 3, "127.0.0.1", port), time.monotonic() + 30)
    compute = torch.randn(300, 300) / 300
    events.put(("ready", rank))
    while _step(live, compute, time.monotonic() + 30):
        pass
    if mode == "held":  # the graveyard before a9054e3: a grave is looked at only at the next re-form
        live.graveyard.dig = live.graveyard._graves.append  # type: ignore[method-assign,assignment]
    old = {key for key in _threads() if key[1] == "gloo_tcp_loop"}  # the killed generation's loop
    generation = orders.get(timeout=60)
    assert live.reconfigure(Assignment(generation, rank - 1, 2, "127.0.0.1", port), time.monotonic() + 30)
    before, began, steps = _threads(), time.monotonic(), 0
    while time.monotonic() - began < WINDOW and _step(live, compute, time.monotonic() + 30):
        steps += 1
    after, seconds = _threads(), time.monotonic() - began
    loops = sum(after[key] - before.get(key, after[key]) for key in after if key in old) / seconds
    events.put(("done", rank, loops, steps / seconds, any(key in old for key in after)))
    events.close()
    events.join_thread()
    os._exit(0)  # the survivors' groups are not torn down: the other may still be in a collective


def trial(mode: str, context: Any) -> dict[str, Any]:
    """One kill: the survivors' loops' CPU and steps per second in the next generation."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    events, orders = context.Queue(), context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, store.port, mode, events, orders)) for rank in range(3)]
    for process in ranks:
        process.start()
    for _ in ranks:
        assert events.get(timeout=60)[0] == "ready"
    time.sleep(0.3 + random.random() * 1.2)  # a random point of a step: compute, buckets or the update
    assert ranks[0].pid is not None
    os.kill(ranks[0].pid, signal.SIGKILL)
    for _ in range(2):
        orders.put(1)
    done = [events.get(timeout=120) for _ in range(2)]
    for process in ranks:
        process.join(10)
        if process.is_alive():
            process.kill()
    loops = [float(item[2]) for item in done]
    return {"mode": mode, "loops": loops, "steps_per_s": sum(float(item[3]) for item in done) / 2,
            "spun": max(loops) > SPIN, "alive": any(bool(item[4]) for item in done)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=30, help="trials per mode (default 30)")
    parser.add_argument("--json", type=Path, help="write every trial here")
    args = parser.parse_args()
    if args.trials < 1:
        parser.error(f"--trials must be at least 1, not {args.trials}")
    # Forked from a server with no threads of its own (torch imported once): a fork of this process,
    # with its stores' and queues' threads, once left all three ranks unable to form their group.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torchspot_trainer.recovery.live"])
    results: list[dict[str, Any]] = []
    for number in range(args.trials):
        for mode in MODES:
            results.append(trial(mode, context))
            last = results[-1]
            print(f"trial {number + 1}/{args.trials} {mode:8}: old loop {max(last['loops']):.2f} core, "
                  f"{last['steps_per_s']:.2f} steps/s", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"\n{'mode':10} {'old loop alive':>15} {'spun':>8} {'old loop (core, mean)':>22} {'in those spun':>14} "
          f"{'steps/s':>8}")  # fmt: skip
    summary: dict[str, tuple[float, float]] = {}
    for mode in MODES:
        mine = [r for r in results if r["mode"] == mode]
        spun = [r for r in mine if r["spun"]]
        loops = statistics.mean(max(r["loops"]) for r in mine)
        in_spun = statistics.mean(max(r["loops"]) for r in spun) if spun else 0.0
        steps = statistics.mean(r["steps_per_s"] for r in mine)
        spun_steps = statistics.mean(r["steps_per_s"] for r in spun) if spun else float("nan")
        summary[mode] = (steps, spun_steps)
        alive = sum(r["alive"] for r in mine)
        print(f"{mode:10} {alive:>10}/{len(mine):<4} {len(spun):>3}/{len(mine):<4} {loops:>22.3f} {in_spun:>14.2f} "
              f"{steps:>8.2f}")  # fmt: skip
    held, released = summary["held"], summary["released"]
    print(f"\nsteps/s, released / held: {released[0] / held[0]:.3f} over all trials; "
          f"{released[0] / held[1]:.3f} against the held trials that spun")  # fmt: skip


if __name__ == "__main__":
    main()
