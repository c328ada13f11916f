"""A benchmark's results as data: one JSON file under bench/results/ holding the trials and their summary with
what produced them (the command, the commit, torch, the machine, the date), so that a table can be traced to
its run and read again without the prose around it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
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


def dated(bench: str, at: str) -> Path:
    """Where a run's results go unless told: bench/results/<bench>/<date>-<commit>.json, a file a run, kept
    in git (the history of a benchmark is its folder's; the docs' results pages show the newest)."""
    return RESULTS / bench / f"{time.strftime('%Y-%m-%d')}-{at.replace('+', '-modified')}.json"


def write(
    path: Path,
    bench: str,
    trials: list[dict[str, Any]],
    summary: list[str],
    *,
    at: str | None = None,
    figures: dict[str, Any] | None = None,
) -> None:
    """Write `trials` and `summary` (the lines the run printed) to `path` with the run's provenance; say
    where. `at`: the commit the run began at (`commit()` then: a long run's checkout may move on
    meanwhile), else now. `figures`: the run's computed results beside the lines (for a table to read)."""
    import torch  # noqa: PLC0415  (the benchmarks that call this have it loaded already)

    script = Path(sys.argv[0]).resolve()
    command = " ".join([str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0], *sys.argv[1:]])
    record = {
        "bench": bench, "command": command, "commit": at or commit(), "torch": torch.__version__,
        "machine": f"{platform.node()} ({os.cpu_count()} cores)", "date": time.strftime("%Y-%m-%d"),
        "summary": summary, "figures": figures or {}, "trials": trials,
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nraw results: {path}")


class _Tee(io.StringIO):
    """Text written to both the terminal and this buffer."""

    def __init__(self, terminal: Any) -> None:
        super().__init__()
        self.terminal = terminal

    def write(self, text: str) -> int:
        self.terminal.write(text)
        return super().write(text)


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    """The lines printed inside the block, still printed: a run's summary as it says it, for `write`."""
    lines: list[str] = []
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield lines
    lines.extend(line for line in tee.getvalue().splitlines() if line.strip())


class Run:
    """One benchmark run's record as it goes, what each benchmark's `main` keeps: the commit it began at
    (taken now: a long run's checkout may move on before it ends), the lines it prints inside
    `captured()`, and its file, `out` or bench/results/<bench>/<date>-<commit>.json (`dated`)."""

    def __init__(self, bench: str, out: Path | None = None) -> None:
        self.bench = bench
        self.at = commit()
        self.out = out or dated(bench, self.at)
        self.lines: list[str] = []
        """The summary so far: every line printed inside `captured()` blocks."""

    @contextlib.contextmanager
    def captured(self) -> Iterator[list[str]]:
        """The module's `captured`, its lines added to the run's summary as the block ends."""
        with captured() as lines:
            yield lines
        self.lines.extend(lines)

    def write(
        self, trials: list[dict[str, Any]], *, figures: dict[str, Any] | None = None, summary: list[str] | None = None
    ) -> None:
        """The run's file (`write`): its `trials`, `figures` and summary (the captured lines unless given)."""
        write(self.out, self.bench, trials, self.lines if summary is None else summary, at=self.at, figures=figures)
