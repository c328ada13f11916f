"""Goodput benchmark: torchspot against the AKS TorchElastic lab's stock recipe, one spot market, one run.

    .venv/bin/python bench/goodput/run.py [--out DIR] [--calibrate 400] [--images 3000] [--in-place]

In the lab sandbox (real operator, etcd, torchrun agents, workers, Azurite), in this order:
1. calibration: torchspot's job without interruptions on k spot nodes, for every k the
   market's capacity takes; each gives the samples per second k nodes make. Each trains
   its first epoch and one step past it, so the reference also pays for the evaluation every
   epoch ends with (2-9 s here), as the market's runs do;
2. torchspot's restart path (bench/goodput/torchspot.yaml, the trainer with `--no-in-place`) through
   bench/goodput/market.yaml; with --in-place, the same job with the trainer's `--in-place` (the
   calibrations stay the restart path's job: an uninterrupted run's speed with DDP is the reference
   either way);
3. the calibration again: the reference is the mean of the two, because a shared
   machine's speed drifts by several percent in the minutes between them, as much as
   the gap the benchmark measures (run 13 trained slower between events than its
   calibration had measured; runs 11-12 faster);
4. the stock recipe (bench/goodput/stock.yaml: plain torchrun, `etcd-v2` on an etcd
   started with --enable-v2, stock_train.py's synchronous checkpoint once per epoch to a
   shared folder, no notice handling) through the same market, with the operator's node
   handling off (TORCHSPOT_NODE_HANDLING=off).
Then goodput (lab/torchspot_lab/goodput.py) for both over the same window, their ratio,
work lost per resumption and recovery per market event; results in DIR/goodput.json,
the plot in DIR/goodput.png. Azurite's blobs (every checkpoint of every run, 4-6 GB)
are deleted at the end unless --keep-blobs. Both recipes train the same model on the same synthetic
data with the same batch size; the reference for both is torchspot's uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.record

from bench import record
from torchspot_lab import goodput
from torchspot_lab.datasets import write_synthetic_cifar10
from torchspot_lab.etcd import EtcdServer
from torchspot_lab.report import read_pod_events
from torchspot_lab.sandbox import run_sandbox
from torchspot_lab.scenario import Pool, Scenario, load_scenario
from torchspot_operator import constants
from torchspot_trainer.data.datasets import CIFAR_TARBALL

HERE = Path(__file__).resolve().parent
BATCH = 16
"""Per-worker batch size of both job files."""
MAX_NODES = 3
"""maxReplicas of both job files."""


def _say(line: str) -> None:
    print(line, flush=True)


def _events(job: Path, scenario: Scenario, folder: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Run one job through one market in the sandbox; the trainer's event lines, times since submission."""
    started = time.monotonic()
    report = run_sandbox(job, scenario, folder, say=lambda line: None, **kwargs)
    _say(f"  {folder.name}: {report.phase}, {time.monotonic() - started:.0f} s, final step {report.final_step}")
    return read_pod_events(folder / "pods", report.submitted)


def _calibrate(sizes: list[int], seconds: float, images: int, out: Path, suffix: str) -> dict[int, float]:
    """Samples per second of torchspot's job without interruptions on each number of nodes, over its
    first epoch, the evaluation at its end included (`_calibration_job`); `seconds` caps each run."""
    rates: dict[int, float] = {}
    for nodes in sizes:
        quiet = Scenario(spot=Pool(nodes=nodes, gpus=1), timeout=seconds)
        folder = out / f"calibrate-{nodes}{suffix}"
        job = _calibration_job(out, nodes, images)
        events = _events(job, quiet, folder, synthetic_images=images)
        if not any(e["event"] == "eval" for e in events):
            _say(f"  {nodes} nodes: no evaluation within {seconds:g} s: the rate leaves it out (raise --calibrate)")
        rates[nodes] = goodput.rate(events, seconds)
        _say(f"  {nodes} nodes: {rates[nodes]:.1f} samples/s")
    return rates


def _calibration_job(out: Path, nodes: int, images: int) -> Path:
    """torchspot.yaml trained to its first epoch's end on `nodes` nodes and one step past it
    (`--max-steps`), so that its rate pays for the evaluation every epoch ends with, as the market's
    runs do, however fast the machine: with 120 s a run, the slower machine's calibrations (17
    samples/s) ended before the epoch's end and left its evaluation (4-9 s there) out."""
    job = yaml.safe_load((HERE / "torchspot.yaml").read_text())
    steps = math.ceil(images / (BATCH * nodes)) + 1
    job["spec"]["template"]["spec"]["containers"][0]["args"].append(f"--max-steps={steps}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"torchspot-calibrate-{nodes}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _drop_blobs(out: Path) -> int:
    """Delete what Azurite stored for each sandbox run under `out`; the bytes freed.

    Every checkpoint of the calibrations, the market runs and the stock recipe, 4-6 GB
    a benchmark: ten runs filled this machine's disk. The results need none of it.
    """
    freed = 0
    for folder in sorted(out.glob("*/azurite")):
        freed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder)
    return freed


def _stock_job(folder: Path, etcd: EtcdServer, images: int) -> Path:
    """stock.yaml with this run's paths: the interpreter, the script, the shared data and checkpoint folder."""
    data = folder / "shared" / "data"
    write_synthetic_cifar10(data / CIFAR_TARBALL, n_train=images, n_test=300)
    text = (HERE / "stock.yaml").read_text()
    for key, value in {
        "python": sys.executable,
        "etcd": etcd.endpoint,
        "script": str(HERE / "stock_train.py"),
        "data": str(data),
        "checkpoint": str(folder / "shared" / "checkpoint.pt"),
    }.items():
        text = text.replace("{" + key + "}", value)
    job = folder / "stock-job.yaml"
    job.write_text(text)
    return job


def _summary(name: str, events: list[dict[str, Any]], market: Scenario, rates: dict[int, float]) -> dict[str, Any]:
    end = market.timeout
    start = goodput.first_start(events)
    if start is None:
        return {"recipe": name, "goodput": 0.0, "error": "never trained"}
    points = goodput.capacity(market, MAX_NODES)
    expected = goodput.expected_samples(points, rates, start, end)
    useful = goodput.useful_samples(events, end)
    return {
        "recipe": name,
        "window": [round(start, 1), end],
        "useful_samples": useful,
        "expected_samples": round(expected),
        "goodput": round(useful / expected, 4) if expected else 0.0,
        "resumptions": [vars(r) for r in goodput.resumptions(events, end, BATCH)],
        "recoveries": goodput.recoveries(market, events, end),
        "curve": goodput.progress_curve(events, end),
    }


def _plot(results: list[dict[str, Any]], market: Scenario, rates: dict[int, float], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - the `lab` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axis = plt.subplots(figsize=(9, 4.8))
    start = min(r["window"][0] for r in results if "window" in r)
    ideal = goodput.expected_curve(goodput.capacity(market, MAX_NODES), rates, start, market.timeout)
    axis.plot([t for t, _ in ideal], [v for _, v in ideal], color="grey", linestyle=":", label="uninterrupted")
    colours = {"torchspot": "tab:blue", "in place": "tab:green", "stock": "tab:red"}
    for result in results:
        curve = [*(result.get("curve") or [(0.0, 0)])]
        curve.append((market.timeout, curve[-1][1]))  # flat to the end: no progress after the last line
        label = f"{result['recipe']} (goodput {result['goodput']:.0%})"
        axis.step(
            [t for t, _ in curve], [v for _, v in curve], where="post", color=colours[result["recipe"]], label=label
        )
    for event in market.events:
        colour = "tab:olive" if event.action == "addSpot" else "tab:purple" if event.action == "freeze" else "black"
        axis.axvline(event.at, color=colour, linestyle="--", linewidth=0.8)
        text = f"+{event.count} node" if event.action == "addSpot" else f"{event.action} {event.node}"
        if event.action == "evict":
            text += " (notice)" if event.notice else " (hard)"
        axis.annotate(text, (event.at, 0), rotation=90, fontsize=7, va="bottom", ha="right")
    axis.set_xlabel("seconds since the job was submitted")
    axis.set_ylabel("useful samples trained")
    axis.set_title("Goodput on a spot market: torchspot vs the stock TorchElastic recipe")
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _in_place_job(out: Path, *more: str, name: str = "goodput-inplace") -> Path:
    """torchspot.yaml with the trainer's `--in-place` and `more` of its flags, named `name`, written under `out`."""
    job = yaml.safe_load((HERE / "torchspot.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"]["template"]["spec"]["containers"][0]["args"] += ["--in-place", *more]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"torchspot-{name.removeprefix('goodput-')}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _report(results: list[dict[str, Any]], ratio: float) -> None:
    """Each recipe's goodput, resumptions and recoveries, then the ratio: the run's summary."""
    for result in results:
        _say(f"{result['recipe']:<10} goodput {result['goodput']:6.1%}  useful {result.get('useful_samples', 0)}"
             f" of {result.get('expected_samples', 0)} samples an uninterrupted run makes")  # fmt: skip
        for r in result.get("resumptions", []):
            _say(f"  t={r['t']:6.1f}s resumed on {r['world_size']} node(s), {r['lost_samples']} samples"
                 f" ({r['lost_steps']:.1f} steps) redone")  # fmt: skip
        for at, what, took in result.get("recoveries", []):
            _say(f"  t={at:6.1f}s {what:<26} training again after " + (f"{took:.1f} s" if took is not None else "-"))
    _say(f"ratio torchspot / stock: {ratio:.2f}x   (targets: torchspot >= 90%, ratio >= 1.5x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("goodput-%Y%m%d-%H%M%S"))
    parser.add_argument("--market", type=Path, default=HERE / "market.yaml")
    parser.add_argument(
        "--calibrate", type=float, default=400.0, help="seconds a calibration run may take (it trains one epoch)"
    )
    parser.add_argument("--images", type=int, default=3000, help="training images (an epoch: ~2 min on 3 nodes)")
    parser.add_argument(
        "--keep-blobs", action="store_true", help="keep Azurite's data (every checkpoint, 4-6 GB) under --out"
    )
    parser.add_argument("--in-place", action="store_true", help="torchspot's market run re-forms in place")
    parser.add_argument("--results", type=Path, default=None, help="the results (default: bench/results/goodput/...)")
    args = parser.parse_args()
    recording = record.Run("goodput", args.results)
    out: Path = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out}: not empty; pick a new folder")
    market = load_scenario(args.market)
    sizes = sorted({nodes for _, nodes in goodput.capacity(market, MAX_NODES) if nodes > 0})
    _say(f"calibration: torchspot without interruptions on {', '.join(map(str, sizes))} nodes, an epoch each")
    before = _calibrate(sizes, args.calibrate, args.images, out, "")
    _say(f"market {args.market}: {len(market.events)} events, {market.timeout:g} s; torchspot first")
    ours_job = _in_place_job(out) if args.in_place else HERE / "torchspot.yaml"
    ours = _events(ours_job, market, out / "torchspot", synthetic_images=args.images)
    _say("calibration again, after torchspot's market run")
    after = _calibrate(sizes, args.calibrate, args.images, out, "-after")
    rates = {nodes: (before[nodes] + after[nodes]) / 2 for nodes in sizes}
    for nodes in sizes:
        _say(f"  {nodes} nodes: {rates[nodes]:.1f} samples/s, the mean of {before[nodes]:.1f} and {after[nodes]:.1f}")
    _say("the stock recipe")
    with EtcdServer(out / "stock-etcd", enable_v2=True) as etcd:
        job = _stock_job(out, etcd, args.images)
        stock = _events(job, market, out / "stock", operator_env={constants.NODE_HANDLING_ENV: "off"})
    name = "in place" if args.in_place else "torchspot"
    results = [_summary(name, ours, market, rates), _summary("stock", stock, market, rates)]
    ratio = results[0]["goodput"] / results[1]["goodput"] if results[1]["goodput"] else float("inf")
    out.mkdir(parents=True, exist_ok=True)
    calibrations = {"before": before, "after": after}
    data = {"rates": rates, "calibrations": calibrations, "ratio": ratio, "results": results}
    (out / "goodput.json").write_text(json.dumps(data, indent=2) + "\n")
    _plot(results, market, rates, out / "goodput.png")
    _say("")
    with recording.captured():
        _report(results, ratio)
    recording.write(results, figures={"rates": rates, "calibrations": calibrations, "ratio": ratio})
    _say(f"results {out / 'goodput.json'}, plot {out / 'goodput.png'}")
    if not args.keep_blobs:
        _say(f"deleted {_drop_blobs(out) / 2**30:.1f} GB of Azurite blobs (--keep-blobs keeps them)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
