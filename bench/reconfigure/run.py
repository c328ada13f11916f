"""torch 2.14's experimental `dist._reconfigure` (gloo) against torchspot's generation groups, on one harness.

Three ranks (worker.py) all-reduce 1 MiB every 20 ms; rank 2 is lost at a random point of the step, and the
harness hands the two others the new membership at once (as torchspot's agent hands its workers a round).
Each method re-forms its way; the recovery is the fault to the later survivor's first all-reduce completed
in the new group. Scenarios:

- `kill`: rank 2 SIGKILLed (its sockets close).
- `freeze`: rank 2 SIGSTOPped (its sockets stay open, a collective with it never completes: the abandoned
  collective); after the re-form and 20 steps it is thawed (SIGCONT), and the survivors go on 30 steps more:
  every all-reduce after the thaw must still be right.
- `storeloss`: rank 2's node also hosted the store the group was made with (torchspot: the round's store
  lives in its rank-0 agent), and goes with it; the new membership comes with a new store.

Needs torch >= 2.14 (the reconfigure API): run it from a virtual environment that has it, e.g.

    python3 -m venv /tmp/torch214 && /tmp/torch214/bin/pip install torch==2.14.1 numpy
    /tmp/torch214/bin/python bench/reconfigure/run.py --reps 10

Prints each trial and a summary (p50 and max per method and scenario; trials that did not recover within
the harness's limit counted apart), and writes bench/results/reconfigure/DATE-COMMIT.json.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.record

from bench import record

HERE = Path(__file__).resolve().parent
METHODS = ("generations", "reconfigure")
SCENARIOS = ("kill", "freeze", "storeloss")
LIMIT = 30.0
"""Seconds after the fault within which both survivors must have completed a step in the new group."""
PACE = 0.02
LOGS = Path(os.environ.get("TMPDIR", "/tmp")) / "torchspot-bench-reconfigure"
"""Each worker's stderr, for the trial that went wrong (overwritten by the next of its kind)."""

STORE_HOST = """
import sys, time
from datetime import timedelta
from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports
store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""


def _wait(condition: Any, timeout: float) -> bool:
    """Whether `condition()` came true within `timeout` seconds. Not torchspot_lab's `wait_for`: this bench
    runs in a scratch venv with torch 2.14, where the project (pinned to torch 2.13) is not installed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def _start(rank: int, address: str, method: str, scenario: str) -> subprocess.Popen[str]:
    command = [sys.executable, str(HERE / "worker.py"), "--rank", str(rank), "--world", "3", "--harness", address,
               "--method", method, "--pace", str(PACE)]  # fmt: skip
    with (LOGS / f"{method}-{scenario}-{rank}.log").open("w") as log:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)


def trial(method: str, scenario: str, rng: random.Random) -> dict[str, Any]:
    harness = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    address = f"127.0.0.1:{harness.port}"
    helper = None
    if scenario == "storeloss":  # the first generation's store, in a process that goes with rank 2
        helper = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
        assert helper.stdout is not None
        harness.set("store/1", f"127.0.0.1:{helper.stdout.readline().strip()}")
    else:
        harness.set("store/1", address)
    harness.set("store/2", address)  # the new membership's store (the harness's, which stays)
    workers = [_start(rank, address, method, scenario) for rank in range(3)]
    result: dict[str, Any] = {"method": method, "scenario": scenario}
    try:
        started = _wait(lambda: all(harness.add(f"steps/{r}", 0) >= 20 for r in range(3)), 120)
        if not started:
            result["error"] = "the three ranks never trained 20 steps together"
            return result
        time.sleep(rng.uniform(0, PACE))
        if scenario == "freeze":
            workers[2].send_signal(signal.SIGSTOP)
        else:
            workers[2].kill()
            if helper is not None:
                helper.kill()
        fault = time.time()
        harness.set("members/2", "0,1")
        recovered = _wait(lambda: harness.check(["recovered/0", "recovered/1"]), LIMIT)
        if not recovered:
            result["error"] = f"no step in the new group within {LIMIT:g} s"
            return result
        result["recovery_s"] = max(float(harness.get(f"recovered/{r}")) for r in (0, 1)) - fault
        result["formed_s"] = max(
            float(harness.get(f"formed/{r}").decode().split(",")[1])
            - float(harness.get(f"formed/{r}").decode().split(",")[0])
            for r in (0, 1)
        )
        if scenario == "freeze":  # thaw it once the survivors trained on, then 30 steps more
            at = harness.add("steps/0", 0)
            _wait(lambda: harness.add("steps/0", 0) >= at + 20, 20)
            workers[2].send_signal(signal.SIGCONT)
            at = harness.add("steps/0", 0)
            result["after_thaw"] = _wait(lambda: harness.add("steps/0", 0) >= at + 30, 20)
        harness.set("stop", "1")
        if not _wait(lambda: harness.check(["done/0", "done/1"]), 20):
            result["error"] = "the survivors did not finish"
            return result
        result["wrong"] = sum(int(harness.get(f"done/{r}").decode().split(",")[1]) for r in (0, 1))
        return result
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGCONT)
            worker.kill()
            worker.communicate()
        if helper is not None:
            helper.kill()
            helper.communicate()


def summary(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for scenario in SCENARIOS:
        for method in METHODS:
            rows = [r for r in results if r["method"] == method and r["scenario"] == scenario]
            if not rows:
                continue
            times = sorted(r["recovery_s"] for r in rows if "recovery_s" in r)
            failed = [r["error"] for r in rows if "error" in r]
            wrong = sum(r.get("wrong", 0) for r in rows)
            text = (
                f"p50 {statistics.median(times):.3f} s, max {times[-1]:.3f} s over {len(times)}"
                if times
                else "never recovered"
            )
            thaw = [r["after_thaw"] for r in rows if "after_thaw" in r]
            extra = f", trained on after the thaw {sum(thaw)}/{len(thaw)}" if thaw else ""
            counts = f"failed {len(failed)}/{len(rows)}; wrong all-reduces {wrong}{extra}"
            lines.append(f"{scenario:10s} {method:12s} {text}; {counts}")
            lines.extend(f"{'':24s}failed: {error}" for error in sorted(set(failed)))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/reconfigure/...)")
    args = parser.parse_args()
    recording = record.Run("reconfigure", args.out)
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if "reconfigure" in args.methods and (major, minor) < (2, 14):
        raise SystemExit(f"torch {torch.__version__}: the reconfigure method needs torch 2.14 or newer (see --help)")
    rng = random.Random(args.seed)
    LOGS.mkdir(parents=True, exist_ok=True)
    results = []
    for rep in range(args.reps):
        for scenario in args.scenarios:
            for method in args.methods:  # interleaved: the same load for both
                result = trial(method, scenario, rng)
                results.append(result)
                said = result.get("error") or f"recovery {result['recovery_s']:.3f} s, wrong {result['wrong']}"
                print(f"[{rep + 1}/{args.reps}] {scenario:10s} {method:12s} {said}", flush=True)
    print()
    for line in summary(results):
        print(line)
    recording.write(results, summary=summary(results))


if __name__ == "__main__":
    main()
