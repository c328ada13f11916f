"""An operator process's /metrics as a Prometheus server reads them: how the lab's tests and benchmarks
tell what an operator running as its own process has done (jobs reported, reconciles finished)."""

from __future__ import annotations

import urllib.request


def metric_sum(port: int, name: str) -> float:
    """The sum of a metric's samples over every label set, from 127.0.0.1:`port`/metrics (0 when the
    process serves none of them); -1 while nothing answers there (not started yet, or gone)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return -1.0
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((f"{name}{{", f"{name} "))
    )
