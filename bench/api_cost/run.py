"""The recovery API's steady-state cost: the DDP example's loop on torchspot.elastic (in place) against the
same loop under plain DDP, in the same run, trials interleaved.

Each trial is a local job of 2 nodes under torchspot-run (etcd-v3, real agents, gloo), one process per
node, the loop timed in-process after a warm-up (worker.py): plain DDP on torch's default group, then
the API, then plain again... Rates are steps per second; the ratio is the API's median over plain's,
and, trial by trial, the median (quartiles) of each trial's ratio to the plain run beside it.
Widths: the example's MLP (64 hidden units, a step of about 3 ms on 2 cores, where a fixed per-step cost
shows most) and a wider one (4096 hidden units over a global batch of 480: a step of tens of milliseconds).

Usage: python bench/api_cost/run.py [--trials 5] [--steps 1000] [--widths 64 1024] [--modes plain plain-hook elastic]
    [--out FILE (default: bench/results/api_cost/DATE-COMMIT.json)]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.record

from bench import record
from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import JobConfig, LocalNode

WORKER = Path(__file__).resolve().with_name("worker.py")
MODES = ("plain", "plain-hook", "elastic")
"""Plain DDP, plain DDP with torch's Python all-reduce hook (the floor of any comm-hook design), the API."""
SMALL = 64
"""Widths up to this train the example's global batch (48); wider ones ten times as many samples a step."""


def trial(root: Path, etcd: EtcdServer, mode: str, width: int, steps: int) -> float:
    """Steps per second of one 2-node job of `mode`."""
    workdir = root / f"{mode}-{width}-{uuid.uuid4().hex[:6]}"
    batch = 48 if width <= SMALL else 480
    program = [str(WORKER), "--mode", mode, "--steps", str(steps), "--width", str(width), "--global-batch", str(batch)]
    job = JobConfig(workdir=workdir, backend="etcd-v3", endpoint=etcd.endpoint, run_id=workdir.name, nnodes="2:2",
                    program=program)  # fmt: skip
    nodes = [LocalNode(f"n{i}", job) for i in range(2)]
    for node in nodes:
        node.start()
    try:
        codes = [node.wait(300) for node in nodes]
    finally:
        for node in nodes:
            node.stop()
    if codes != [0, 0]:
        raise SystemExit(f"{mode} width {width}: exit codes {codes}\n{nodes[0].log_tail(30)}")
    for node in nodes:
        for line in node.log_path.read_text().splitlines():
            if line.startswith('{"mode"'):
                return float(json.loads(line)["steps_per_s"])
    raise SystemExit(f"{mode}: no rate printed\n{nodes[0].log_tail(30)}")


def paired(rates: dict[tuple[str, int], list[float]], mode: str, width: int) -> list[float]:
    """Each trial's `mode` rate over the plain rate of the same trial (the runs beside it): a machine whose
    speed drifts over minutes moves both alike, which the ratio of the medians does not cancel."""
    plain = rates.get(("plain", width), [])
    return [ours / theirs for ours, theirs in zip(rates.get((mode, width), []), plain, strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 4096])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/api_cost/...)")
    args = parser.parse_args()
    recording = record.Run("api_cost", args.out)
    rates: dict[tuple[str, int], list[float]] = {}
    trials: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="torchspot-api-cost-") as tmp, EtcdServer(Path(tmp) / "etcd") as etcd:
        for number in range(args.trials):
            for width in args.widths:
                for mode in args.modes if number % 2 == 0 else reversed(args.modes):
                    rate = trial(Path(tmp), etcd, mode, width, args.steps)
                    rates.setdefault((mode, width), []).append(rate)
                    trials.append({"trial": number + 1, "width": width, "mode": mode, "steps_per_s": rate})
                    print(f"[{number + 1}/{args.trials}] width {width:5} {mode:8} {rate:8.1f} steps/s", flush=True)
    figures: dict[str, dict[str, float]] = {}
    with recording.captured():
        print("\nSteady state, 2 nodes x 1 process, gloo: steps per second (median, min-max), ratio to plain DDP")
        for width in args.widths:
            plain = statistics.median(rates[("plain", width)]) if ("plain", width) in rates else None
            for mode in args.modes:
                found = rates[(mode, width)]
                median = statistics.median(found)
                figures[f"{mode}-{width}"] = {"median": median} | ({} if plain is None else {"ratio": median / plain})
                ratio = "" if plain is None else f": ratio {median / plain:.3f}"
                pairs = paired(rates, mode, width)
                if pairs and mode != "plain":
                    quartiles = (
                        statistics.quantiles(pairs, n=4, method="inclusive") if len(pairs) > 1 else [pairs[0]] * 3
                    )
                    figures[f"{mode}-{width}"] |= {"paired_median": quartiles[1], "paired_p25": quartiles[0],
                                                   "paired_p75": quartiles[2]}  # fmt: skip
                    ratio += f"; trial by trial {quartiles[1]:.3f} ({quartiles[0]:.3f}-{quartiles[2]:.3f})"
                print(f"  width {width:5} {mode:10}: {median:.1f} ({min(found):.1f}-{max(found):.1f}){ratio}")
    sys.stdout.flush()
    recording.write(trials, figures=figures)


if __name__ == "__main__":
    main()
