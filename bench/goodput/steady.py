"""The in-place trainer's training rate between events, against DDP's, in the same run.

    .venv/bin/python bench/goodput/steady.py [--out DIR] [--reps 2] [--seconds 180] [--nodes 3] [--pair ddp|saver]

The goodput benchmark's reference is torchspot's job as shipped (DDP) without interruptions;
its in-place runs trained 10-20% below that reference between events (runs 18-22), whatever
their recoveries cost. This measures that gap alone: bench/goodput/torchspot.yaml as shipped and
with `--in-place`, on the same number of quiet sandbox nodes (no market event), alternating which
runs first, `--reps` times each. For each run: samples per second from the first start line
(`goodput.rate`, the calibration's measure) and the steady rate, from the tenth progress line to
the last (start-up and first steps left out). Prints each run, the means and their ratio;
deletes the runs' Azurite blobs (their checkpoints) at the end.

`--pair saver` compares instead the in-place job as shipped (rank 0's checkpoints serialized and
uploaded by a saver process) with the same job saving them on a thread of rank 0's training process
(`--checkpoint-saver thread`): what every rank 0 after a lost one did until the saver followed rank
0 (train.py's `_ranks_changed`), for the rest of the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as goodput_run  # type: ignore[import-not-found]  # a sibling, found through the path above

from bench import record  # (the repository: on the path since run.py put it there)
from torchspot_lab import goodput
from torchspot_lab.scenario import Pool, Scenario

STEADY_FROM = 10
"""Progress lines (one a step: `--log-every=1`) left out before the steady rate: the start-up, the
first steps' one-off costs."""


def steady_rate(events: Sequence[Mapping[str, Any]]) -> float | None:
    """Samples per second between the STEADY_FROM-th whole progress line and the last; None when the
    run made too few. Pure."""
    lines = [e for e in events if e.get("event") == "progress" and not e.get("partial")]
    if len(lines) <= STEADY_FROM + 1:
        return None
    first, last = lines[STEADY_FROM], lines[-1]
    return (float(last["trained_samples"]) - float(first["trained_samples"])) / (float(last["t"]) - float(first["t"]))


PAIRS = ("ddp", "saver")
"""`--pair`'s choices (the module docstring)."""


def _jobs(pair: str, out: Path) -> dict[str, Path]:
    """`--pair`'s two jobs, the reference first: name -> job file."""
    if pair == "saver":
        thread = goodput_run._in_place_job(out, "--checkpoint-saver", "thread", name="goodput-inplace-thread")
        return {"saves in a process": goodput_run._in_place_job(out), "saves on a thread": thread}
    return {"DDP": goodput_run.HERE / "torchspot.yaml", "in place": goodput_run._in_place_job(out)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("steady-%Y%m%d-%H%M%S"))
    parser.add_argument("--reps", type=int, default=2, help="runs of each job")
    parser.add_argument(
        "--seconds", type=float, default=180.0, help="each run's length, from the submission (90 s: 24 steps, noisy)"
    )
    parser.add_argument("--nodes", type=int, default=3, help="spot nodes, all of them training")
    parser.add_argument("--images", type=int, default=3000, help="training images")
    parser.add_argument(
        "--pair", choices=PAIRS, default="ddp",
        help="ddp: the job as shipped (DDP) against in place; saver: in place with checkpoints saved in a process "
        "against on a thread",
    )  # fmt: skip
    parser.add_argument("--results", type=Path, default=None, help="the results (default: bench/results/steady-PAIR/)")
    args = parser.parse_args()
    recording = record.Run(f"steady-{args.pair}", args.results)
    out: Path = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out}: not empty; pick a new folder")
    if args.reps < 1 or args.nodes < 1:
        parser.error("--reps and --nodes: at least 1")
    jobs = _jobs(args.pair, out)
    (reference, _), (candidate, _) = jobs.items()
    rates: dict[str, list[tuple[float, float | None]]] = {name: [] for name in jobs}
    print(f"{args.nodes} quiet nodes, {args.seconds:g} s a run, {args.reps} runs of each job, alternating", flush=True)
    for rep in range(args.reps):
        for name in list(jobs) if rep % 2 == 0 else list(jobs)[::-1]:
            quiet = Scenario(spot=Pool(nodes=args.nodes, gpus=1), timeout=args.seconds)
            folder = out / f"{name.replace(' ', '-')}-{rep}"
            events = goodput_run._events(jobs[name], quiet, folder, synthetic_images=args.images)
            rate, steady = goodput.rate(events, args.seconds), steady_rate(events)
            rates[name].append((rate, steady))
            said = "-" if steady is None else f"{steady:.2f}"
            print(f"  {name} run {rep}: {rate:.2f} samples/s from the first start, steady {said}", flush=True)
    means = {}
    with recording.captured():
        for name, found in rates.items():
            steadies = [s for _, s in found if s is not None]
            means[name] = (statistics.mean(r for r, _ in found), statistics.mean(steadies) if steadies else None)
            steady_text = "-" if means[name][1] is None else f"{means[name][1]:.2f}"
            print(f"{name}: mean {means[name][0]:.2f} samples/s, steady {steady_text}")
        ours, theirs = means[candidate][1], means[reference][1]
        if ours is not None and theirs is not None:
            print(f"steady ratio {candidate} / {reference}: {ours / theirs:.3f}")
    trials = [{"job": name, "rate": rate, "steady": steady} for name, found in rates.items() for rate, steady in found]
    recording.write(trials, figures={name: list(mean) for name, mean in means.items()})
    print(f"runs under {out}; deleted {goodput_run._drop_blobs(out) / 2**30:.1f} GB of Azurite blobs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
