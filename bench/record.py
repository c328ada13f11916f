"""A benchmark's results as data: one JSON file under bench/results/ holding the trials and their summary with
what produced them (the command, the commit, torch, the machine, the date), so that a table can be traced to
its run and read again without the prose around it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def commit() -> str:
    """The checkout's commit (short), with `+` where files differ from it; `unknown` outside git."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, check=False)  # fmt: skip
    return (head.stdout.strip() or "unknown") + ("+" if dirty.stdout.strip() else "")


def write(path: Path, bench: str, trials: list[dict[str, Any]], summary: list[str], *, at: str | None = None) -> None:
    """Write `trials` and `summary` to `path` with the run's provenance; say where. `at`: the commit the run
    began at (`commit()` then: a long run's checkout may move on meanwhile), else now."""
    import torch  # noqa: PLC0415  (the benchmarks that call this have it loaded already)

    script = Path(sys.argv[0]).resolve()
    command = " ".join([str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0], *sys.argv[1:]])
    record = {
        "bench": bench, "command": command, "commit": at or commit(), "torch": torch.__version__,
        "machine": f"{platform.node()} ({os.cpu_count()} cores)", "date": time.strftime("%Y-%m-%d"),
        "trials": trials, "summary": summary,
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nraw results: {path}")
