"""The operator's Prometheus metrics, and the liveness rule that fails when reconciles stall.

Served on `METRICS_PORT_ENV` (default `DEFAULT_METRICS_PORT`) at /metrics by
prometheus_client's own HTTP server; the chart exposes it through a Service (and, if
asked, a ServiceMonitor). What they answer:

- `torchspot_jobs{phase}`: jobs this operator handles, by phase (read at scrape time);
- `torchspot_evictions_total`, `torchspot_worker_failures_total`,
  `torchspot_replacements_total`: counted as the operator counts them into job statuses;
- `torchspot_recovery_seconds`: from the reconcile that counted an eviction until the
  job's run reports a new rendezvous round (its group trains again);
- `torchspot_pending_seconds`: from a job's start (or resume) until minReplicas was first
  reached (time spent waiting for capacity);
- `torchspot_reconcile_seconds` and `torchspot_reconcile_errors_total`: each reconcile's
  duration, and those that raised (kopf retries them).

A job's own figures (evictions, failures, replacements, recovery and pending seconds) carry its
`namespace` and `job` labels, as kube-state-metrics labels a Job's, so that one job's evictions can
be told from another's; a deleted job's series go with it (`forget_job`).

The operator is alive while reconciles make progress: `stalled` is true when some job
is active and no reconcile or tick has finished for `STALL_SECONDS`, and kopf's
liveness endpoint (`--liveness`) then answers 500, so the kubelet restarts the pod.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

METRICS_PORT_ENV: Final = "TORCHSPOT_METRICS_PORT"
DEFAULT_METRICS_PORT: Final = 8081
STALL_SECONDS: Final = 180.0
"""No finished reconcile or tick for this long, with a job active, is a stall. The timer ticks
every active job every 5 s, and one request may take its 30 s deadline times a few retries:
three minutes is past anything a healthy operator does."""

_RECOVERY_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
_PENDING_BUCKETS = (5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)

JOB_LABELS: Final = ("namespace", "job")
EVICTIONS = Counter(
    "torchspot_evictions_total", "Worker pods lost to evictions (never counted against maxRestarts)", JOB_LABELS
)
FAILURES = Counter(
    "torchspot_worker_failures_total", "Worker pods that failed (OOMKilled, non-zero exits, refused)", JOB_LABELS
)
REPLACEMENTS = Counter("torchspot_replacements_total", "Worker pods created to replace lost ones", JOB_LABELS)
RECOVERY = Histogram(
    "torchspot_recovery_seconds",
    "Seconds from an eviction until the job's group trains again (a new rendezvous round)",
    JOB_LABELS,
    buckets=_RECOVERY_BUCKETS,
)
PENDING = Histogram(
    "torchspot_pending_seconds",
    "Seconds a job waited for capacity before reaching minReplicas",
    JOB_LABELS,
    buckets=_PENDING_BUCKETS,
)
_PER_JOB: Final = (EVICTIONS, FAILURES, REPLACEMENTS, RECOVERY, PENDING)
RECONCILE = Histogram("torchspot_reconcile_seconds", "Duration of one reconcile of one job")
RECONCILE_ERRORS = Counter("torchspot_reconcile_errors_total", "Reconciles that raised (kopf tries them again)")


class Jobs(Collector):
    """`torchspot_jobs{phase}`, from the phases the controller last wrote (read at each scrape)."""

    def __init__(self, phases: Callable[[], Mapping[Any, str]]) -> None:
        self._phases = phases

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("torchspot_jobs", "ElasticJobs this operator handles, by phase", labels=["phase"])
        counts: dict[str, int] = {}
        for phase in self._phases().values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in sorted(counts.items()):
            family.add_metric([phase], count)
        yield family


def forget_job(namespace: str, job: str) -> None:
    """A deleted job's series go (a scrape would otherwise keep reporting it for the operator's life)."""
    for metric in _PER_JOB:
        with contextlib.suppress(KeyError):  # (never measured)
            metric.remove(namespace, job)


class Recoveries:
    """Eviction-to-training clocks per job (pure bookkeeping; `update` feeds `RECOVERY`)."""

    def __init__(self) -> None:
        self._since: dict[tuple[str, str], tuple[float, int]] = {}

    def update(
        self, job: tuple[str, str], old: Mapping[str, Any], new: Mapping[str, Any], now: float | None = None
    ) -> float | None:
        """Start a clock when the eviction count rises, stop it when the round moves past where it was;
        the seconds of a finished recovery (None otherwise)."""
        now = time.monotonic() if now is None else now
        evicted = int(new.get("evictions", 0)) > int(old.get("evictions", 0))
        round_now = int(new.get("rendezvousRound", -1))
        if evicted and job not in self._since:
            self._since[job] = (now, round_now)
            return None
        started = self._since.get(job)
        if started is not None and round_now > started[1]:
            del self._since[job]
            RECOVERY.labels(*job).observe(now - started[0])
            return now - started[0]
        return None

    def forget(self, job: tuple[str, str]) -> None:
        self._since.pop(job, None)


def stalled(active: int, last_reconcile: float, now: float | None = None) -> bool:
    """Whether reconciles have stalled: jobs wait for them, and none finished for `STALL_SECONDS`."""
    now = time.monotonic() if now is None else now
    return active > 0 and now - last_reconcile > STALL_SECONDS
