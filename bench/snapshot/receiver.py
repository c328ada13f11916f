"""One rank of bench/snapshot's joiner measurement: `receiver.py HOW RANK STORE OUT`.

Rank 0 holds ResNet-50's training state and sends it; rank 1 (the joiner) receives it with
`wire.broadcast_state` (HOW=tensors) or `broadcast_object_list` (HOW=pickle) and writes the
seconds it took and its peak resident memory above what it had before to OUT."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.checkpoint

from bench.checkpoint.run import resnet50_state
from torchspot_trainer.recovery.wire import broadcast_state


def high_water_mib() -> float:
    """This process's peak resident memory (VmHWM: per address space, so a fork's parent does not
    count, as it does in getrusage's ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("no VmHWM in /proc/self/status")


def main(how: str, rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))  # fmt: skip
    state = resnet50_state() if rank == 0 else None
    before = high_water_mib()
    dist.barrier()
    started = time.perf_counter()
    if how == "tensors":
        got = broadcast_state(state, 0, rank, torch.device("cpu"))
    else:
        box: list[Any] = [state]
        dist.broadcast_object_list(box, src=0)
        got = box[0]
    seconds = time.perf_counter() - started
    peak = high_water_mib()
    assert got is not None
    total = sum(float(t.double().sum()) for t in got["model"].values())
    print(f"rank {rank} {how}: checksum {total:.6g}, before {before:.0f} MiB, peak {peak:.0f} MiB", flush=True)
    Path(out).write_text(json.dumps({"seconds": seconds, "peak_mib": peak - before}))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
