"""A worker's Prometheus metrics: served at /metrics where TORCHSPOT_TRAINER_METRICS_PORT names a port
(each worker on that port plus its LOCAL_RANK, so a node's workers do not meet), in Prometheus' text
format, from the standard library: a training image needs no client library for them.

- `torchspot_trainer_step`: the last committed step; `torchspot_trainer_world_size`: the group's size;
- `torchspot_trainer_step_seconds_sum` and `_count`: committed steps' time from their start to their
  commit (the rate of one over the other: the mean step time);
- `torchspot_trainer_samples_total`: samples the group trained in this worker's committed steps (its
  rate: samples per second);
- `torchspot_trainer_reforms_total`: groups this worker entered after its first (in place: each
  recovery and join it went through without a restart);
- `torchspot_trainer_checkpoint_step` and `torchspot_trainer_checkpoint_timestamp_seconds`: the newest
  checkpoint this worker saw committed (its age: `time() - torchspot_trainer_checkpoint_timestamp_seconds`).

Off unless asked: a port taken (two local workers of a sandbox on one machine) is said in one line and
training goes on without them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from torchspot_trainer import ENV_PREFIX
from torchspot_trainer.elastic.settings import Refused

__all__ = ["METRICS_PORT_ENV", "WorkerMetrics", "exposition", "metrics_port", "serve_metrics", "served_metrics"]

log = logging.getLogger("torchspot.elastic")

METRICS_PORT_ENV = f"{ENV_PREFIX}TRAINER_METRICS_PORT"
"""The port of local rank 0's /metrics (unset or 0: none served)."""

_FAMILIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    # (family, type, help, its samples)
    ("torchspot_trainer_step", "gauge", "The last committed step", ("",)),
    ("torchspot_trainer_world_size", "gauge", "Ranks in this worker's current group", ("",)),
    ("torchspot_trainer_step_seconds", "summary", "Committed steps' seconds from their start to their commit",
     ("_sum", "_count")),
    ("torchspot_trainer_samples_total", "counter", "Samples the group trained in committed steps", ("",)),
    ("torchspot_trainer_reforms_total", "counter", "Groups this worker entered after its first", ("",)),
    ("torchspot_trainer_checkpoint_step", "gauge", "The step of the newest committed checkpoint", ("",)),
    ("torchspot_trainer_checkpoint_timestamp_seconds", "gauge", "Unix time the newest checkpoint committed", ("",)),
)  # fmt: skip
_NAMES = tuple(family + suffix for family, _, _, suffixes in _FAMILIES for suffix in suffixes)


class WorkerMetrics:
    """The figures, updated by the manager's records (records.py) and read at each scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(_NAMES, 0.0)
        self._groups = 0

    def stepped(self, step: int, *, world: int, seconds: float, samples: int) -> None:
        with self._lock:
            values = self._values
            values["torchspot_trainer_step"] = step
            values["torchspot_trainer_world_size"] = world
            values["torchspot_trainer_step_seconds_sum"] += seconds
            values["torchspot_trainer_step_seconds_count"] += 1
            values["torchspot_trainer_samples_total"] += samples

    def entered(self, *, step: int, world: int) -> None:
        """A group entered (the first, or a re-form's)."""
        with self._lock:
            self._groups += 1
            self._values["torchspot_trainer_reforms_total"] = self._groups - 1
            self._values["torchspot_trainer_step"] = step
            self._values["torchspot_trainer_world_size"] = world

    def checkpointed(self, step: int, *, at: float | None = None) -> None:
        with self._lock:
            self._values["torchspot_trainer_checkpoint_step"] = step
            self._values["torchspot_trainer_checkpoint_timestamp_seconds"] = time.time() if at is None else at

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)


def exposition(values: Mapping[str, float]) -> str:
    """Prometheus' text format of `values` (by sample name), each family with its HELP and TYPE lines. Pure."""
    lines = []
    for family, kind, text, suffixes in _FAMILIES:
        lines += [f"# HELP {family} {text}", f"# TYPE {family} {kind}"]
        lines += [f"{family}{suffix} {float(values.get(family + suffix, 0.0))!r}" for suffix in suffixes]
    return "\n".join(lines) + "\n"


def metrics_port(environ: Mapping[str, str]) -> int:
    """This worker's metrics port from the environment (METRICS_PORT_ENV plus LOCAL_RANK), 0 for none;
    raises Refused naming the variable where it is not a port."""
    said = environ.get(METRICS_PORT_ENV, "").strip()
    if not said or said == "0":
        return 0
    if not said.isdigit() or not 0 < int(said) < 65536:
        raise Refused(f"{METRICS_PORT_ENV}={said!r}: must be a port number (1-65535), or 0 for no metrics")
    return int(said) + int(environ.get("LOCAL_RANK", "0"))


def serve_metrics(metrics: WorkerMetrics, port: int) -> ThreadingHTTPServer | None:
    """Serve `metrics` at http://<any address>:`port`/metrics on a daemon thread; None (said in one line)
    where the port cannot be had."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = exposition(metrics.snapshot()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:  # (no line per scrape)
            return

    try:
        server = ThreadingHTTPServer(("", port), Handler)
    except OSError as exc:
        log.warning("the worker's metrics are not served: port %d: %s", port, exc)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="torchspot-metrics", daemon=True).start()
    return server


def served_metrics(environ: Mapping[str, str]) -> WorkerMetrics | None:
    """This worker's metrics, served where the environment names a port (`metrics_port`), else None."""
    port = metrics_port(environ)
    if not port:
        return None
    metrics = WorkerMetrics()
    serve_metrics(metrics, port)  # (its thread holds the server)
    return metrics
