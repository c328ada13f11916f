"""The real operator against the API emulator playing a busy, shared cluster: a namespace quota that
refuses pods, a node controller that marks nodes Unknown (one, then all), a watch cut with a 410 while
a worker is deleted, graceful deletion, and a job whose rendezvous never forms.

What the emulator adds for these (a ResourceQuota, `nodes_unknown`, `cut_watches`, `graceful`) is in
torchspot_lab/kubeapi/emulator.py. Every wait is on a condition read back from the API.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.operator.cluster import NS, Cluster, count_ticks, reconciles, wait_for
from tests.operator.conftest import operator_running
from tests.operator.jobs import good_job
from torchspot_lab.kubeapi.emulator import Emulator
from torchspot_operator import constants, handlers
from torchspot_operator.handlers import RECONCILE_INTERVAL

GRACE = 3
"""Seconds a worker may stay on a NotReady node in these tests."""


def _status(cluster: Cluster, job: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.job(job).get("status") or {}
    return found


def _condition(cluster: Cluster, job: str, kind: str) -> dict[str, Any]:
    return next((c for c in _status(cluster, job).get("conditions", []) if c["type"] == kind), {})


def _running_on_two_nodes(cluster: Cluster, job: str) -> tuple[str, str]:
    """A job of two workers, one on spot-1 and one on spot-2 (the test adds the nodes), Running; its workers."""
    cluster.create(good_job(job, maxReplicas=2))
    wait_for("two workers", lambda: len(cluster.pods(job)) == 2)
    first, second = cluster.names(job)
    cluster.run_pod(first, "spot-1")
    cluster.run_pod(second, "spot-2")
    wait_for("Running", lambda: _status(cluster, job).get("phase") == "Running")
    return first, second


def _emulator(cluster: Cluster) -> Emulator:
    assert cluster.api.emulator is not None
    return cluster.api.emulator


@pytest.fixture
def operator(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """The operator with short clocks: refusals back off from 1 s, a NotReady node's grace is 3 s (a real
    cluster's is 300 s: long enough for a wave of NotReady nodes to show whole), and nodes are admitted at
    10 a second."""
    monkeypatch.setattr(constants, "REFUSAL_BACKOFF_BASE", 1.0)
    monkeypatch.setenv(constants.NODE_GRACE_ENV, str(GRACE))
    monkeypatch.setenv(constants.NODE_EVICTION_RATE_ENV, "10")
    with operator_running():
        yield api


def test_refused_creates_back_off_per_job_and_resume_when_the_quota_allows(operator: Cluster) -> None:
    cluster = operator
    cluster.create({
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus", "namespace": NS},
        "spec": {"hard": {"requests.nvidia.com/gpu": "0"}},
    })  # fmt: skip
    cluster.create(good_job("quota", maxReplicas=4))
    refused = wait_for("the refusal in the status", lambda: _condition(cluster, "quota", "ReplicaFailure"))
    started = time.monotonic()
    posts = cluster.requests("POST", "v1/pods")
    time.sleep(8)  # what matters is how few requests a while brings: there is no condition to poll
    tries = cluster.requests("POST", "v1/pods") - posts
    # Backed off (1, 2, 4 s ... from the first refusal) and one pod per try (the first refusal stops the rest):
    # at most 4 tries in 8 s, where the hot loop made 4 pods every 5 s tick.
    assert 1 <= tries <= 4, tries
    said = _condition(cluster, "quota", "ReplicaFailure")
    assert said["reason"] == "FailedCreate"
    assert "create(s) refused in a row" in said["message"]
    assert "exceeded quota: gpus" in said["message"]
    assert set(re.findall(r"quota-worker-\d+", said["message"])) == {"quota-worker-0"}  # a count, not a list
    assert len(said["message"]) < 400, refused
    events = [e for e in cluster.events("FailedCreate") if "exceeded quota" in e.get("message", "")]
    assert len(events) == 1  # one Event per distinct refusal per backoff period
    assert cluster.events("ScaledUp") == []  # no "created" Event for a pod that was not
    assert cluster.pods("quota") == []
    assert _status(cluster, "quota")["phase"] == "Pending"

    # The quota grows: the next try succeeds, and the rest follow one by one,
    # under the indices that were refused (no name is burnt).
    cluster.patch("resourcequotas", "gpus", {"spec": {"hard": {"requests.nvidia.com/gpu": "8"}}})
    wait_for("four workers", lambda: len(cluster.pods("quota")) == 4, timeout=40)
    assert cluster.names("quota") == [f"quota-worker-{n}" for n in range(4)]
    wait_for("ReplicaFailure cleared", lambda: _condition(cluster, "quota", "ReplicaFailure").get("status") == "False")
    assert time.monotonic() - started < 60


def test_nodes_going_unknown_together_keep_their_workers_one_alone_loses_its(operator: Cluster) -> None:
    cluster = operator
    for node in ("spot-1", "spot-2", "spot-3", "spot-4"):
        cluster.add_node(node)
    cluster.create(good_job("storm", maxReplicas=4))
    wait_for("four workers", lambda: len(cluster.pods("storm")) == 4)
    for name, node in zip(cluster.names("storm"), ("spot-1", "spot-2", "spot-3", "spot-4"), strict=True):
        cluster.run_pod(name, node)
    wait_for("Running", lambda: _status(cluster, "storm").get("phase") == "Running")
    workers = cluster.names("storm")

    # An API-server blip: the node controller marks every node Unknown. Past the grace, only the
    # full-disruption guard stands between the job and the loss of all four workers.
    seen = reconciles()
    cluster.api.run(_emulator(cluster).nodes_unknown())
    wait_for("the operator to look", lambda: reconciles() > seen)
    time.sleep(GRACE + RECONCILE_INTERVAL + 1)  # past the grace, a timer round: absence has no condition to poll
    assert cluster.names("storm") == workers
    assert _status(cluster, "storm").get("evictions", 0) == 0

    # An admin cordons a node to stop new scheduling: nothing more (cordon handling is opt-in).
    cluster.api.run(_emulator(cluster).nodes_ready())
    cluster.patch("nodes", "spot-4", {"spec": {"unschedulable": True}}, None)
    # One node alone goes Unknown: past its grace its worker is moved off and replaced.
    cluster.api.run(_emulator(cluster).nodes_unknown(["spot-1"]))
    wait_for(
        "the worker on spot-1 deleted",
        lambda: workers[0] not in cluster.names("storm"),
        timeout=RECONCILE_INTERVAL + 10,
    )
    wait_for("its replacement", lambda: len(cluster.live("storm")) == 4)
    status = wait_for("the eviction counted", lambda: (s := _status(cluster, "storm")).get("evictions") == 1 and s)
    assert status["failures"] == 0
    assert workers[3] in cluster.names("storm")  # the cordoned node's worker stays

    # A fresh spot VM whose device plugin is not ready refuses the replacement: the node's fault, an
    # eviction, not one of the job's maxRestarts.
    fresh = next(n for n in cluster.live("storm") if n not in workers)
    cluster.patch("pods", fresh, {"spec": {"nodeName": "spot-2"}, "status": {
        "phase": "Failed", "reason": "UnexpectedAdmissionError", "message": "Allocate failed due to no healthy devices",
    }})  # fmt: skip
    status = wait_for("counted as an eviction", lambda: (s := _status(cluster, "storm")).get("evictions") == 2 and s)
    assert status["failures"] == 0


def test_a_worker_deleted_while_the_watch_was_cut_is_replaced(
    operator: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = operator
    cluster.add_node("spot-1")
    others = [f"other-{n}" for n in range(6)]
    for other in others:  # jobs of the same namespace, checked after the relist too
        cluster.create(good_job(other, maxReplicas=1))
    cluster.create(good_job("ghost"))
    wait_for("three workers", lambda: len(cluster.pods("ghost")) == 3)
    wait_for("the others' workers", lambda: all(cluster.pods(other) for other in others))
    for name in cluster.names("ghost"):
        cluster.run_pod(name, "spot-1")
    wait_for("Running", lambda: _status(cluster, "ghost").get("phase") == "Running")

    # The API server restarts: the pod watch ends with a 410; meanwhile a worker is deleted. The watch
    # lists again, which shows no deletion event: the cache would keep the deleted pod as Ready for ever
    # unless the listing's own contents say it is gone (informer.py: as client-go's informers do).
    emulator = _emulator(cluster)
    ghost = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods("ghost")}["ghost-worker-1"]
    cluster.api.run(emulator.cut_watches("pods"))
    cluster.delete("v1", "Pod", "ghost-worker-1")
    budgets = "policy/v1/poddisruptionbudgets"  # read by the operator's checks alone (this test reads pods)
    lists = cluster.requests("GET", budgets)
    emulator.resume_watches("pods")
    replaced = lambda: any(  # noqa: E731 - its free name is used again
        p["metadata"]["name"] == "ghost-worker-1" and p["metadata"]["uid"] != ghost for p in cluster.pods("ghost")
    )
    wait_for("a replacement", replaced, timeout=RECONCILE_INTERVAL + 15)
    status = wait_for("counted as an eviction", lambda: (s := _status(cluster, "ghost")).get("evictions") == 1 and s)
    assert status["replicas"]["ready"] == 2  # the ghost does not count as Ready
    ticks = count_ticks(monkeypatch)
    wait_for(
        "every job's timer", lambda: all(ticks[job] for job in ["ghost", *others]), timeout=RECONCILE_INTERVAL + 15
    )
    # The pod watch's own listing found the deletion: no job read the namespace again (seven jobs; before
    # the operator's own watches, one shared list of the namespace's five kinds).
    assert cluster.requests("GET", budgets) - lists == 0


def test_the_first_jobs_are_checked_against_the_watches_own_listing(operator: Cluster) -> None:
    """A job new to the operator is checked against the API before it is planned; at a start (or in a
    namespace's first job) the watches' own first listings are that check: the namespace is not listed a
    second time beside them (at 1,000 jobs that was 12,000 objects listed twice)."""
    cluster = operator
    for n in range(3):
        cluster.create(good_job(f"first-{n}"))
    wait_for("their workers", lambda: all(len(cluster.pods(f"first-{n}")) == 3 for n in range(3)))
    wait_for("reconciled", lambda: all(_status(cluster, f"first-{n}").get("phase") == "Pending" for n in range(3)))
    # PodDisruptionBudgets: read by the operator's watch and checks alone. One list, one watch.
    assert cluster.requests("GET", "policy/v1/poddisruptionbudgets") == 2


def test_a_node_deleted_while_the_node_watch_was_cut_has_its_workers_moved(operator: Cluster) -> None:
    """The node watch's listing after a 410 finds a node deleted meanwhile (no DELETED event came): the
    node leaves the cache and its job is reconciled at once. Without that the cache would keep the node
    Ready for ever and its worker would never be moved off (reconciles read the cache, not the API)."""
    cluster = operator
    for node in ("spot-1", "spot-2"):
        cluster.add_node(node)
    first, second = _running_on_two_nodes(cluster, "stranded")

    emulator = _emulator(cluster)
    cluster.api.run(emulator.cut_watches("nodes"))
    cluster.delete("v1", "Node", "spot-2", None)
    emulator.resume_watches("nodes")
    wait_for("the worker of the deleted node gone", lambda: second not in cluster.names("stranded"), timeout=10)
    assert first in cluster.names("stranded")
    assert wait_for("counted as an eviction", lambda: _status(cluster, "stranded").get("evictions") == 1)


def test_the_etcd_stays_until_the_stopped_workers_have_left_and_a_stall_fails_the_job(operator: Cluster) -> None:
    cluster = operator
    _emulator(cluster).graceful = 2.0  # a deleted pod stays Terminating for 2 s
    cluster.add_node("spot-1")
    cluster.create(good_job("leaving", maxReplicas=2))
    wait_for("two workers", lambda: len(cluster.pods("leaving")) == 2)
    for name in cluster.names("leaving"):
        cluster.run_pod(name, "spot-1")
    wait_for("Running", lambda: _status(cluster, "leaving").get("phase") == "Running")
    cluster.patch(constants.PLURAL, "leaving", {"spec": {"suspend": True}})
    wait_for(
        "the workers Terminating", lambda: all(p["metadata"].get("deletionTimestamp") for p in cluster.pods("leaving"))
    )
    assert cluster.etcd_kinds("leaving") == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    wait_for("the workers gone", lambda: not cluster.pods("leaving"))
    wait_for("then the etcd", lambda: not cluster.etcd_kinds("leaving"))

    # A job whose rendezvous never forms: its workers run, its etcd never becomes available (no pod of it
    # runs here: as with an image an egress firewall blocks). Stalled names the cause, then the job fails.
    cluster.create(good_job("stuck", maxReplicas=1, failurePolicy={"stallTimeoutSeconds": 2}))
    wait_for("a worker", lambda: len(cluster.pods("stuck")) == 1)
    cluster.run_pod(cluster.names("stuck")[0], "spot-1")
    wait_for("Failed", lambda: _status(cluster, "stuck").get("phase") == "Failed", timeout=30)
    stalled = _condition(cluster, "stuck", "Stalled")
    assert stalled["status"] == "True"
    assert "the managed etcd is not serving: its Deployment has no available pod" in stalled["message"]
    assert _condition(cluster, "stuck", "Failed")["reason"] == "Stalled"


def test_refused_secret_and_etcd_objects_back_off_and_hold_the_workers(
    operator: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = operator
    monkeypatch.setattr(constants, "REFUSAL_BACKOFF_CAP", 4.0)  # waits of 1, 2, 4, 4 ... s: the test's clock
    quota = {"count/secrets": "0", "count/deployments.apps": "0"}
    cluster.create({
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "objects", "namespace": NS},
        "spec": {"hard": quota},
    })  # fmt: skip
    cluster.create(good_job("counted", maxReplicas=2))
    said = wait_for("the Secret's refusal", lambda: _condition(cluster, "counted", "ReplicaFailure").get("message"))
    assert "exceeded quota: objects" in said, said
    assert "count/secrets" in said, said
    wait_for(  # tried again after the backoff, counted in the job's one refusal record
        "a second refusal",
        lambda: (
            "2 create(s) refused in a row" in (m := _condition(cluster, "counted", "ReplicaFailure")["message"]) and m
        ),
    )
    assert cluster.requests("POST", "apps/v1/deployments") == 0  # nothing of the etcd without its certificates
    assert cluster.pods("counted") == []  # no worker without its rendezvous

    # Secrets allowed: the etcd's Deployment is refused next, and still no worker is made.
    cluster.patch("resourcequotas", "objects", {"spec": {"hard": {**quota, "count/secrets": "5"}}})
    said = wait_for(
        "the Deployment's refusal",
        lambda: "count/deployments.apps" in _condition(cluster, "counted", "ReplicaFailure").get("message", "") and
        _condition(cluster, "counted", "ReplicaFailure")["message"],
        timeout=30,
    )  # fmt: skip
    assert "Deployment default/counted-etcd was refused" in said, said
    assert cluster.pods("counted") == []
    events = [e for e in cluster.events("FailedCreate") if "count/deployments.apps" in e.get("message", "")]
    assert len(events) == 1, events

    cluster.patch("resourcequotas", "objects", {"spec": {"hard": {"count/deployments.apps": "5"}}})
    wait_for("the etcd", lambda: "Deployment" in cluster.etcd_kinds("counted"), timeout=30)
    wait_for("two workers", lambda: len(cluster.pods("counted")) == 2)
    wait_for(
        "ReplicaFailure cleared", lambda: _condition(cluster, "counted", "ReplicaFailure").get("status") == "False"
    )


def test_cordon_handling_on_moves_workers_off_and_kubelet_evictions_exhaust_the_budget(
    api: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = api
    monkeypatch.setenv(constants.CORDON_HANDLING_ENV, "on")
    monkeypatch.setenv(constants.NODE_EVICTION_RATE_ENV, "10")
    for node in ("spot-1", "spot-2"):
        cluster.add_node(node)
    with operator_running():
        first, second = _running_on_two_nodes(cluster, "cordoned")

        # An admin cordons spot-1 to retire it: with cordon handling on, its worker is moved off at once.
        cluster.patch("nodes", "spot-1", {"spec": {"unschedulable": True}}, None)
        wait_for("the cordoned node's worker deleted", lambda: first not in cluster.names("cordoned"), timeout=15)
        assert second in cluster.names("cordoned")
        wait_for("counted", lambda: _status(cluster, "cordoned").get("evictions") == 1)
        assert _status(cluster, "cordoned")["failures"] == 0

        # The kubelet of spot-2 evicts the job's worker for node pressure, again and again (the job's own
        # memory, most likely): the third in a row exhausts the eviction budget and replacements back off.
        for counted in (2, 3, 4):
            wait_for("two live workers", lambda: len(cluster.live("cordoned")) == 2)
            victim = sorted(cluster.live("cordoned"))[0]
            cluster.run_pod(victim, "spot-2")
            cluster.evict(victim, "TerminationByKubelet")
            wait_for("the eviction counted", lambda: _status(cluster, "cordoned").get("evictions") == counted)  # noqa: B023
        said = wait_for("EvictionBudgetExceeded", lambda: _condition(cluster, "cordoned", "EvictionBudgetExceeded"))
        assert said["status"] == "True"
        assert "last TerminationByKubelet x3" in said["message"], said
        assert wait_for("a BackOff Event", lambda: cluster.events("BackOff"))


def test_a_node_selector_keeps_other_pools_out_of_the_node_cache(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHSPOT_NODE_SELECTOR (the chart's nodes.watchSelector): the node watch keeps only the spot pool;
    a worker that runs elsewhere has its node read by a GET, at most once per UNWATCHED_NODE_SECONDS."""
    monkeypatch.setenv(constants.NODE_SELECTOR_ENV, f"{constants.SPOT_LABEL}={constants.SPOT_VALUE}")
    api.add_node("spot-1")
    api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1", "labels": {"pool": "system"}},
                "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})  # fmt: skip
    with operator_running():
        api.create(good_job("pooled", minReplicas=1, maxReplicas=2))
        wait_for("two workers", lambda: len(api.pods("pooled")) == 2)
        first, second = api.names("pooled")
        api.run_pod(first, "spot-1")
        api.run_pod(second, "cpu-1")
        wait_for("Running", lambda: _status(api, "pooled").get("phase") == "Running")
        ours = handlers.controller()
        wait_for("cpu-1 read by a GET", lambda: "cpu-1" in ours.node_view.read_nodes)
        assert set(ours.node_view.nodes) == {"spot-1"}  # the watch's
        reads = api.requests("GET", "v1/nodes")
        seen = reconciles()
        for n in range(1, 4):  # three more reconciles of the job
            api.patch("pods", first, {"metadata": {"labels": {"poke": str(n)}}})
            wanted = seen + n
            wait_for(f"reconcile {n}", lambda: reconciles() >= wanted)  # noqa: B023 - awaited in this turn
        assert api.requests("GET", "v1/nodes") == reads  # cpu-1 is not read again within 30 s
