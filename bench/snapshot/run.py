"""Snapshot benchmark: what keeping a node's snapshot costs per step, and moving a state to a joiner.

The state is ResNet-50's model and SGD momentum buffers (about 205 MB), on CPU (no GPU here).

1. Host copy per step (hostcopy.py): the time `HostCopy.capture` takes at a step boundary,
   every step and every 10 steps (amortised per step). Against it, the old way: no copy
   during training, and a `torch.save` of the live state as the worker stops, which on a
   GPU would queue behind a hung collective (so it is only comparable on a CPU).
2. The snapshot write itself: `torch.save` of the host copy to local disk.
3. A joiner receiving the state from one of two gloo ranks: `wire.broadcast_state` (tensors)
   against `broadcast_object_list` (pickle), in the same run: seconds and the receiver's peak
   resident memory above its state's size.

On a GPU the copy would run on a side stream over PCIe and overlap the next step: not measured.

Usage: python bench/snapshot/run.py [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.checkpoint

from bench import record
from bench.checkpoint.run import resnet50_state
from torchspot_trainer.recovery.hostcopy import HostCopy

RECEIVER = Path(__file__).with_name("receiver.py")


def state_bytes(state: Any) -> int:
    """Bytes of the model's and the optimizer's tensors."""
    tensors = [*state["model"].values(), *(t for s in state["optimizer"]["state"].values() for t in s.values())]
    return sum(int(t.numel() * t.element_size()) for t in tensors)


def host_copy_ms(state: dict[str, Any], every: int, steps: int) -> float:
    """Mean milliseconds per step of HostCopy.capture over `steps` steps (the first copy, which
    allocates the buffers, not counted)."""
    copy = HostCopy(torch.device("cpu"), every=every, copy=True)
    copy.capture(0, lambda: state)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        copy.capture(step, lambda: state)
    return (time.perf_counter() - started) * 1000 / steps


def save_s(state: dict[str, Any], folder: Path) -> float:
    started = time.perf_counter()
    torch.save(state, folder / "snap.pt")
    return time.perf_counter() - started


def joiner(how: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        store, outs = Path(tmp) / "store", [Path(tmp) / f"out-{r}.json" for r in (0, 1)]
        procs = [
            subprocess.Popen([sys.executable, str(RECEIVER), how, str(rank), str(store), str(out)])
            for rank, out in enumerate(outs)
        ]
        for proc in procs:
            if proc.wait(timeout=300) != 0:
                raise SystemExit(f"the {how} broadcast failed")
        result: dict[str, float] = json.loads(outs[1].read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/snapshot/...)")
    args = parser.parse_args()
    recording = record.Run("snapshot", args.out)
    with recording.captured():
        state = resnet50_state()
        mib = state_bytes(state) / 2**20
        print(f"state: ResNet-50 model + SGD momentum, {mib:.0f} MiB")
        every1 = [host_copy_ms(state, 1, 10) for _ in range(args.reps)]
        every10 = [host_copy_ms(state, 10, 50) for _ in range(args.reps)]
        with tempfile.TemporaryDirectory() as tmp:
            saves = [save_s(state, Path(tmp)) for _ in range(args.reps)]
        print(f"host copy at every step:      median {statistics.median(every1):6.1f} ms per step")
        print(f"host copy every 10 steps:     median {statistics.median(every10):6.1f} ms per step (amortised)")
        print(f"snapshot write (torch.save):  median {statistics.median(saves):6.2f} s, as the worker stops")
        wire = [joiner("tensors") for _ in range(max(2, args.reps // 2))]
        pickled = [joiner("pickle") for _ in range(max(2, args.reps // 2))]
        for name, runs in (("tensors (wire.py)", wire), ("pickle (broadcast_object_list)", pickled)):
            print(
                f"joiner receives, {name:31s}: median {statistics.median(r['seconds'] for r in runs):5.2f} s, "
                f"peak memory {statistics.median(r['peak_mib'] for r in runs):5.0f} MiB above the process's start"
            )
        ratio_s = statistics.median(r["seconds"] for r in pickled) / statistics.median(r["seconds"] for r in wire)
        ratio_m = statistics.median(r["peak_mib"] for r in pickled) / statistics.median(r["peak_mib"] for r in wire)
        print(f"pickle / tensors: {ratio_s:.2f}x the time, {ratio_m:.2f}x the peak memory")
    trials = {"host_copy_every_step_ms": every1, "host_copy_every_10_ms": every10, "snapshot_write_s": saves,
              "joiner_tensors": wire, "joiner_pickle": pickled}  # fmt: skip
    figures = {"state_mib": mib, "pickle_over_tensors_time": ratio_s, "pickle_over_tensors_memory": ratio_m}
    recording.write([trials], figures=figures)


if __name__ == "__main__":
    main()
