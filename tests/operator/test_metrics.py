"""The operator's Prometheus metrics and its liveness rule: the pure rules, then the real operator
against the emulator, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.operator.cluster import Cluster, wait_for
from tests.operator.conftest import operator_running
from tests.operator.jobs import good_job
from tests.operator.test_operator import _phase, _start
from torchspot_lab.etcd import free_port
from torchspot_operator import handlers, metrics
from torchspot_operator.controller import Controller


def test_a_stall_needs_active_jobs_and_silence() -> None:
    assert not metrics.stalled(0, last_reconcile=0.0, now=10_000.0)  # idle is not stalled
    assert not metrics.stalled(3, last_reconcile=100.0, now=100.0 + metrics.STALL_SECONDS)
    assert metrics.stalled(3, last_reconcile=100.0, now=100.0 + metrics.STALL_SECONDS + 1)


def test_recovery_runs_from_the_eviction_to_the_next_round() -> None:
    clocks, job = metrics.Recoveries(), ("default", "clocked")
    running = {"evictions": 0, "rendezvousRound": 4}
    evicted = {"evictions": 1, "rendezvousRound": 4}
    assert clocks.update(job, running, evicted, now=100.0) is None
    assert clocks.update(job, evicted, {**evicted, "evictions": 2}, now=103.0) is None  # the clock keeps its start
    assert clocks.update(job, evicted, {"evictions": 2, "rendezvousRound": 5}, now=107.5) == 7.5
    assert clocks.update(job, evicted, {"evictions": 2, "rendezvousRound": 6}, now=120.0) is None  # stopped
    observed = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for m in metrics.RECOVERY.collect() for s in m.samples
    }
    assert observed[("torchspot_recovery_seconds_sum", (("job", "clocked"), ("namespace", "default")))] == 7.5
    metrics.forget_job(*job)  # deleted: its series go
    assert not [s for m in metrics.RECOVERY.collect() for s in m.samples if s.labels.get("job") == "clocked"]


def _scrape() -> dict[str, float]:
    port = wait_for("/metrics served", handlers.metrics_port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(torchspot_[^ ]+) ([0-9.e+-]+)", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def test_metrics_count_what_the_operator_does(cluster: Cluster) -> None:
    before = _scrape()
    cluster.add_node("spot-1")
    cluster.create(good_job("measured", minReplicas=1, maxReplicas=2))
    names = _start(cluster, "measured", ["spot-1", "spot-1"])
    _phase(cluster, "measured", "Running")
    victim = cluster.pods("measured")[0]["metadata"]["uid"]
    cluster.delete("v1", "Pod", names[0])  # deleted by someone else: an eviction, replaced at once

    def replaced() -> bool:
        uids = {p["metadata"]["uid"] for p in cluster.pods("measured")}
        return len(uids) == 2 and victim not in uids

    wait_for("the replacement", replaced)

    labels = '{job="measured",namespace="default"}'  # (each job's own series; the exposition sorts labels)

    def counted() -> dict[str, float] | None:
        now = _scrape()
        return now if now.get(f"torchspot_evictions_total{labels}", 0) > 0 else None

    after = wait_for("evictions counted", counted)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta(f"torchspot_evictions_total{labels}") == 1
    assert delta(f"torchspot_replacements_total{labels}") == 1
    assert delta(f"torchspot_worker_failures_total{labels}") == 0
    assert delta(f"torchspot_pending_seconds_count{labels}") == 1  # the wait for minReplicas, once
    assert delta("torchspot_reconcile_seconds_count") >= 3
    assert after['torchspot_jobs{phase="Scaling"}'] + after.get('torchspot_jobs{phase="Running"}', 0) >= 1


def test_liveness_fails_while_reconciles_stall(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reconcile that hangs (here: one made to wait for ever) with a job active: kopf's liveness
    endpoint answers 500, so the kubelet restarts the operator."""
    monkeypatch.setattr(metrics, "STALL_SECONDS", 1.0)
    port = free_port()
    with operator_running(f"--liveness=http://127.0.0.1:{port}/healthz"):
        api.add_node("spot-1")
        api.create(good_job("stuck", minReplicas=1, maxReplicas=1))
        _start(api, "stuck", ["spot-1"])
        _phase(api, "stuck", "Running")

        async def hang(*_: Any, **__: Any) -> None:
            await asyncio.Event().wait()

        monkeypatch.setattr(Controller, "_observe", hang)
        api.patch("elasticjobs", "stuck", {"spec": {"template": {"metadata": {"labels": {"poke": "1"}}}}})

        def refused() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                    return None
            except urllib.error.HTTPError as exc:
                return str(exc.code)

        assert wait_for("the liveness probe to fail", refused, timeout=40) == "500"
        monkeypatch.undo()  # let the operator stop cleanly
