"""The real kopf operator (torchspot_operator.handlers) against the kmock API emulator.

No kubelet or scheduler runs here: the tests play them by patching pod and node
status through the API, as a real kubelet would report it. The emulator has the
ElasticJob CRD applied, so it defaults and refuses jobs as an API server does. Every
wait is on a condition read back from the API, with a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from kopf.testing import KopfRunner

from tests.lab.test_evict import exec_plugin
from tests.operator.cluster import JOBS, NS, Cluster, count_ticks, reconciles, wait_for
from tests.operator.conftest import OPERATOR_ARGS, operator_running
from tests.operator.jobs import crd, good_job, with_path
from torchspot_lab.etcd import EtcdServer, free_port
from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.scrape import metric_sum
from torchspot_operator import certs, conditions, constants
from torchspot_operator.builders import JobRef
from torchspot_operator.controller import Controller
from torchspot_operator.handlers import RECONCILE_INTERVAL
from torchspot_operator.kube import ApiError, Kube
from torchspot_operator.kube import login as kube_login
from torchspot_operator.metrics import METRICS_PORT_ENV
from torchspot_operator.reconcile import ETCD_KINDS
from torchspot_trainer.rendezvous import milestones


def _status(cluster: Cluster, job: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.job(job).get("status") or {}
    return found


def _condition(cluster: Cluster, job: str, kind: str) -> dict[str, Any] | None:
    return next((c for c in _status(cluster, job).get("conditions", []) if c["type"] == kind), None)


def _phase(cluster: Cluster, job: str, phase: str) -> dict[str, Any]:
    """Wait for a phase; the status then."""
    wait_for(f"{job} {phase}", lambda: _status(cluster, job).get("phase") == phase)
    return _status(cluster, job)


def _start(cluster: Cluster, job: str, nodes: list[str]) -> list[str]:
    """Play scheduler and kubelet: run the job's pods (one per node, in order) until all are Ready."""
    wait_for(f"{len(nodes)} workers of {job}", lambda: len(cluster.names(job)) == len(nodes))
    names = cluster.names(job)
    for name, node in zip(names, nodes, strict=True):
        cluster.run_pod(name, node)
    return names


def _uids(cluster: Cluster, job: str) -> set[str]:
    return {p["metadata"]["uid"] for p in cluster.pods(job)}


@contextlib.contextmanager
def _settles(cluster: Cluster, count: Callable[[], float] = reconciles) -> Iterator[None]:
    """Around a change the operator must ignore: after it, wait until the operator (in this process) has
    finished one more reconcile, then a moment for anything it would write. The absence of a change
    has no condition to poll."""
    seen = count()
    yield
    wait_for("the operator to reconcile the job", lambda: count() > seen)
    time.sleep(0.5)


def _quiet(cluster: Cluster) -> dict[tuple[str, str], int]:
    """Wait until the API has served no request for a second (the operator finished what it was doing);
    the request counts then."""
    assert cluster.api.emulator is not None
    emulator = cluster.api.emulator
    counts, changed = [dict(emulator.counts)], [time.monotonic()]

    def still() -> bool:
        now = dict(emulator.counts)
        if now != counts[0]:
            counts[0], changed[0] = now, time.monotonic()
        return time.monotonic() - changed[0] >= 1.0

    wait_for("the API to go quiet", still)
    return dict(emulator.counts)


def test_job_lifecycle_placement_eviction_node_loss_scale_and_success(cluster: Cluster) -> None:
    cluster.add_node("spot-1")
    cluster.add_node("spot-2")
    cluster.create(good_job("cifar"))

    # Created: managed etcd on the on-demand pool, three workers on the spot pool, waiting for capacity.
    wait_for("three worker pods", lambda: len(cluster.pods("cifar")) == 3)
    assert cluster.etcd_kinds("cifar") == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    pod = cluster.pods("cifar")[0]
    # The etcd's certificates: made once, in a Secret the job owns, mounted by its pods.
    secret = cluster.api.run(cluster.kube.get("v1", "Secret", NS, "cifar-etcd-tls"))
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == cluster.job("cifar")["metadata"]["uid"]
    assert set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key", "client.crt", "client.key"}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    assert secrets == {"etcd-tls": "cifar-etcd-tls"}
    assert pod["spec"]["nodeSelector"][constants.SPOT_LABEL] == "spot"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "ElasticJob"
    pending = _phase(cluster, "cifar", "Pending")
    assert next(c for c in pending["conditions"] if c["type"] == "WaitingForCapacity")["status"] == "True"

    # The kubelet starts them: Running, three ready.
    _start(cluster, "cifar", ["spot-1", "spot-2", "spot-2"])
    running = _phase(cluster, "cifar", "Running")
    assert running["replicas"] == {"desired": 3, "ready": 3, "pending": 0}
    assert next(c for c in running["conditions"] if c["type"] == "WaitingForCapacity")["status"] == "False"

    # A spot eviction fails one pod: it is replaced under a new name, counted as an eviction only.
    cluster.evict("cifar-worker-0")
    wait_for("a replacement pod", lambda: "cifar-worker-3" in cluster.names("cifar"))
    evicted = wait_for("eviction counted", lambda: (s := _status(cluster, "cifar")).get("evictions") == 1 and s)
    assert evicted["failures"] == 0
    assert evicted["restarts"] == 1
    assert wait_for("Evicted event", lambda: cluster.events("Evicted"))
    assert wait_for("Replaced event", lambda: cluster.events("Replaced"))
    # The replacement is Pending (no spot capacity yet); training goes on with two.
    _phase(cluster, "cifar", "Scaling")
    below = _condition(cluster, "cifar", "BelowMin")
    assert below is not None
    assert below["status"] == "False"

    # AKS drains a node before a spot preempt (its auto-drain taint): its workers are deleted at once.
    drain = {"key": "remediator.kubernetes.azure.com/unschedulable", "effect": "NoSchedule"}
    cluster.patch("nodes", "spot-2", {"spec": {"taints": [drain]}}, None)
    wait_for("workers on spot-2 gone", lambda: {"cifar-worker-1", "cifar-worker-2"}.isdisjoint(cluster.names("cifar")))
    assert wait_for("evictions counted", lambda: _status(cluster, "cifar").get("evictions") == 3)
    wait_for("replacements", lambda: len(cluster.live("cifar")) == 3)

    # A user deletes a worker (`kubectl delete pod`): an eviction, replaced at once, not a failure.
    victim = cluster.live("cifar")[0]
    cluster.delete("v1", "Pod", victim)
    assert wait_for("the deletion counted", lambda: _status(cluster, "cifar").get("evictions") == 4)
    wait_for("its replacement", lambda: len(cluster.live("cifar")) == 3)
    assert _status(cluster, "cifar")["failures"] == 0

    # Scale down through spec.replicas (what kubectl scale sets).
    cluster.patch(constants.PLURAL, "cifar", {"spec": {"replicas": 1}})
    wait_for("one worker left", lambda: len(cluster.live("cifar")) == 1)
    assert wait_for("ScaledDown event", lambda: cluster.events("ScaledDown"))

    # The run completes: the worker exits 0; the job succeeds and the managed etcd goes.
    (last,) = cluster.live("cifar")
    cluster.run_pod(last, "spot-1")
    cluster.exit(last, 0)
    done = _phase(cluster, "cifar", "Succeeded")
    assert done["completionTime"]
    wait_for("etcd deleted", lambda: not cluster.etcd_kinds("cifar"))
    succeeded = _condition(cluster, "cifar", "Succeeded")
    assert succeeded is not None
    assert succeeded["status"] == "True"


def test_a_run_that_completes_with_a_pending_replacement_succeeds_at_once_and_stays_so(cluster: Cluster) -> None:
    """No spot capacity after an eviction: the replacement stays Pending. The first worker to exit 0 ends
    the job there and then: the Pending pod goes (no spot VM bought for a finished job), so does the etcd,
    nothing is replaced, and a straggler's exit code afterwards changes nothing."""
    cluster.add_node("spot-1")
    cluster.create(good_job("done", cleanPodPolicy="None", failurePolicy={"maxRestarts": 0}))
    _start(cluster, "done", ["spot-1", "spot-1", "spot-1"])
    _phase(cluster, "done", "Running")
    cluster.evict("done-worker-0")
    wait_for("the Pending replacement", lambda: "done-worker-3" in cluster.names("done"))

    cluster.exit("done-worker-1", 0)
    finished = _phase(cluster, "done", "Succeeded")
    wait_for("the Pending replacement deleted", lambda: "done-worker-3" not in cluster.names("done"))
    wait_for("etcd deleted", lambda: not cluster.etcd_kinds("done"))
    assert cluster.live("done") == ["done-worker-1", "done-worker-2"]  # cleanPodPolicy None keeps the runner
    assert wait_for("Succeeded event", lambda: cluster.events("Succeeded"))

    with _settles(cluster):
        cluster.exit("done-worker-2", 1)  # the straggler, as its etcd went away
    assert _status(cluster, "done") == finished
    assert cluster.names("done") == ["done-worker-0", "done-worker-1", "done-worker-2"]  # nothing replaced or counted
    assert cluster.events("WorkerFailed") == []


def test_oomkilled_and_limit_evictions_count_back_off_and_fail_the_job(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OOMKilled and a kubelet limit eviction (`Evicted` with no DisruptionTarget: the pod's own emptyDir
    limit) are failures, not evictions: counted, replaced after a growing wait, kept for their logs, and the
    job fails when they exceed maxRestarts."""
    monkeypatch.setattr(constants, "BACKOFF_BASE_SECONDS", 1)  # 1 s, 2 s ... instead of 10 s, 20 s
    cluster.add_node("spot-1")
    cluster.create(good_job("crashy", minReplicas=1, maxReplicas=1, failurePolicy={"maxRestarts": 1}))
    (first,) = _start(cluster, "crashy", ["spot-1"])
    before = _uids(cluster, "crashy")
    cluster.exit(first, 137, "OOMKilled")
    failed_at = time.monotonic()
    counted = wait_for("the failure counted", lambda: (s := _status(cluster, "crashy")).get("failures") == 1 and s)
    assert counted["lastFailure"]["reason"] == "OOMKilled"
    assert counted["evictions"] == 0
    assert counted["backoff"]["consecutiveFailures"] == 1
    wait_for("the replacement", lambda: _uids(cluster, "crashy") - before, timeout=RECONCILE_INTERVAL + 10)
    assert time.monotonic() - failed_at >= 1  # not at once: after the backoff
    assert wait_for("BackOff event", lambda: cluster.events("BackOff"))

    kept = cluster.job("crashy")  # the OOMKilled pod is kept for `kubectl logs`, marked as counted
    oom = next(p for p in cluster.pods("crashy") if p["metadata"]["name"] == first)
    assert oom["metadata"]["annotations"][constants.ANNOTATION_ACCOUNTED] == "failure: OOMKilled"
    assert kept["status"]["lastFailure"]["pod"] == first

    (second,) = cluster.live("crashy")  # the kubelet evicts it for its own emptyDir's limit
    cluster.run_pod(second, "spot-1")
    assert cluster.api.emulator is not None
    cluster.api.run(
        cluster.api.emulator.limit_evict(NS, second, 'Usage of EmptyDir volume "cache" exceeds the limit "2Gi".')
    )
    failed = _phase(cluster, "crashy", "Failed")
    assert (failed["failures"], failed["evictions"]) == (2, 0)
    reason = _condition(cluster, "crashy", "Failed")
    assert reason is not None
    assert reason["reason"] == "TooManyFailures"
    assert "LimitEvicted" in reason["message"]
    assert wait_for("WorkerFailed events", lambda: len(cluster.events("WorkerFailed")) == 2)
    assert sorted(cluster.names("crashy")) == sorted([first, second])  # both kept (cleanPodPolicy Running)


def test_a_worker_whose_node_cannot_run_the_program_is_replaced_off_that_node(cluster: Cluster) -> None:
    """A worker exits 75 (its GPU refused: the trainer's node fault): not a failure, even with
    maxRestarts 0; a NodeFault event says so; its replacement avoids that node (a required node
    affinity on its name), and after a second node's fault both. Before, it was a failure: the job
    failed, and with more restarts allowed each replacement could land on the same node again."""
    for node in ("spot-1", "spot-2"):
        cluster.add_node(node)
    cluster.create(good_job("gpu-bad", minReplicas=1, maxReplicas=1, failurePolicy={"maxRestarts": 0}))
    for node, avoided in (("spot-1", ["spot-1"]), ("spot-2", ["spot-1", "spot-2"])):
        (worker,) = wait_for("a live worker", lambda: cluster.live("gpu-bad"))
        cluster.run_pod(worker, node)
        cluster.exit(worker, constants.NODE_FAULT_EXIT_CODE)

        def counted() -> dict[str, Any] | None:
            status = _status(cluster, "gpu-bad")
            return status if status.get("avoidedNodes") == avoided else None  # noqa: B023 - this iteration's

        status = wait_for("the node fault counted", counted)
        assert status["failures"] == 0
        assert status["phase"] != "Failed"
        (fresh,) = wait_for("the replacement", lambda: [n for n in cluster.live("gpu-bad") if n != worker])  # noqa: B023
        pod = next(p for p in cluster.pods("gpu-bad") if p["metadata"]["name"] == fresh)
        required = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert required["nodeSelectorTerms"][0]["matchFields"] == [
            {"key": "metadata.name", "operator": "NotIn", "values": avoided}
        ]
        said = wait_for("the NodeFault event", lambda: [e["message"] for e in cluster.events("NodeFault")])
        assert any(worker in message and node in message for message in said), said


def test_replica_groups_are_made_whole_a_lost_pod_replaced_in_its_group_and_shown(cluster: Cluster) -> None:
    """replicaGroupSize 2 at four pods: two groups of two, labelled; a pod deleted by someone else is
    replaced in its group (under the lowest free name); the status counts the ready groups."""
    cluster.add_node("spot-1")
    cluster.create(good_job("grouped", minReplicas=2, maxReplicas=4, replicaGroupSize=2))
    _start(cluster, "grouped", ["spot-1"] * 4)

    def groups() -> dict[str, str]:
        return {p["metadata"]["name"]: p["metadata"]["labels"][constants.LABEL_REPLICA_GROUP]
                for p in cluster.pods("grouped") if not p["metadata"].get("deletionTimestamp")}  # fmt: skip

    assert groups() == {f"grouped-worker-{i}": str(i // 2) for i in range(4)}
    wait_for("two ready groups", lambda: (_status(cluster, "grouped").get("replicaGroups") or {}).get("ready") == 2)
    victim = next(p["metadata"]["uid"] for p in cluster.pods("grouped") if p["metadata"]["name"] == "grouped-worker-1")
    cluster.delete("v1", "Pod", "grouped-worker-1")
    wait_for("the replacement", lambda: len(groups()) == 4 and victim not in _uids(cluster, "grouped"))
    assert sorted(groups().values()) == ["0", "0", "1", "1"]  # the replacement joined group 0
    wait_for("one ready group", lambda: _status(cluster, "grouped")["replicaGroups"]["ready"] == 1)  # 0 waits


def test_suspend_stops_the_workers_and_etcd_and_resume_starts_a_fresh_run(cluster: Cluster) -> None:
    cluster.add_node("spot-1")
    cluster.create(good_job("paused"))
    _start(cluster, "paused", ["spot-1", "spot-1", "spot-1"])
    running = _phase(cluster, "paused", "Running")
    old_pods = _uids(cluster, "paused")

    cluster.patch(constants.PLURAL, "paused", {"spec": {"suspend": True}})
    suspended = _phase(cluster, "paused", "Suspended")
    wait_for("workers stopped", lambda: cluster.pods("paused") == [])
    wait_for("etcd stopped", lambda: not cluster.etcd_kinds("paused"))
    assert suspended["evictions"] == 0  # stopping for a suspension is neither an eviction nor a failure
    assert "startTime" not in suspended  # its clocks stop
    condition = _condition(cluster, "paused", "Suspended")
    assert condition is not None
    assert condition["status"] == "True"
    assert wait_for("Suspended event", lambda: cluster.events("Suspended"))

    cluster.patch(constants.PLURAL, "paused", {"spec": {"suspend": False}})
    wait_for("workers again", lambda: len(cluster.pods("paused")) == 3)
    assert _uids(cluster, "paused").isdisjoint(old_pods)
    resumed = wait_for("a fresh run", lambda: (s := _status(cluster, "paused")).get("resumes") == 1 and s)
    assert resumed["runId"] == running["runId"] + "-r1"
    env = {e["name"]: e.get("value") for e in cluster.pods("paused")[0]["spec"]["containers"][0]["env"]}
    assert env["PET_RDZV_ID"] == resumed["runId"]  # a clean rendezvous, also on an external etcd
    assert env["TORCHSPOT_CHECKPOINT_URI"] == "az://checkpoints/cifar"  # the trainer resumes from its checkpoint
    assert cluster.etcd_kinds("paused") == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    assert resumed["phase"] == "Pending"


def test_a_job_created_suspended_is_admitted_by_flipping_suspend(cluster: Cluster) -> None:
    """Kueue's admission: the job is created suspended, nothing runs, then Kueue sets suspend to false."""
    cluster.create(good_job("queued", suspend=True))
    _phase(cluster, "queued", "Suspended")  # written by the reconcile that decided to create nothing
    assert cluster.pods("queued") == []
    assert cluster.etcd_kinds("queued") == set()
    cluster.patch(constants.PLURAL, "queued", {"spec": {"suspend": False}})
    wait_for("workers after admission", lambda: len(cluster.pods("queued")) == 3)
    assert cluster.etcd_kinds("queued") == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}


def test_ttl_deletes_a_finished_job(cluster: Cluster) -> None:
    cluster.add_node("spot-1")
    cluster.create(good_job("short", minReplicas=1, maxReplicas=1, ttlSecondsAfterFinished=1))
    (name,) = _start(cluster, "short", ["spot-1"])
    cluster.exit(name, 0)
    # With a TTL of 1 s the Succeeded status may be gone before a poll sees it: its Event stays.
    wait_for("the job deleted", lambda: cluster.api.run(
        cluster.kube.get(constants.API_VERSION, constants.PLURAL, NS, "short")) is None)  # fmt: skip
    succeeded = wait_for("Succeeded event", lambda: cluster.events("Succeeded"))
    assert succeeded[0]["involvedObject"]["name"] == "short"


def test_in_a_restricted_namespace_jobs_run_and_a_refused_pod_is_reported(cluster: Cluster) -> None:
    """Pod Security `restricted` enforced (the emulator refuses violating pods with a 403, as the API
    server does): the operator's pods pass; a template that adds a forbidden capability gets its
    refusal, with the API's message, in the job's status and Events instead of a silent Pending."""
    cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})  # fmt: skip
    cluster.add_node("spot-1")
    cluster.create(good_job("plain", minReplicas=1, maxReplicas=1))
    _start(cluster, "plain", ["spot-1"])
    _phase(cluster, "plain", "Running")
    assert _condition(cluster, "plain", "ReplicaFailure") is None
    deployment = cluster.etcd("plain")["Deployment"]
    assert "status" not in deployment  # the emulator marks a Deployment whose pods it would refuse

    ipc = with_path("template.spec.containers[0].securityContext", {"capabilities": {"add": ["IPC_LOCK"]}}, "rdma")
    cluster.create(ipc)
    refused = wait_for("ReplicaFailure", lambda: _condition(cluster, "rdma", "ReplicaFailure"))
    assert refused["reason"] == "FailedCreate"
    said = 'Pod default/rdma-worker-0 was refused: HTTP 403: pods "rdma-worker-0" is forbidden: violates PodSecurity'
    assert said in refused["message"]
    assert "capabilities (drop must include ALL, add only NET_BIND_SERVICE)" in refused["message"]
    waiting = _condition(cluster, "rdma", "WaitingForCapacity")
    assert waiting is not None
    assert "the cluster refuses the job's pods" in waiting["message"]
    events = wait_for("FailedCreate event", lambda: cluster.events("FailedCreate"))
    assert "violates PodSecurity" in events[0]["message"]
    assert cluster.pods("rdma") == []


@pytest.mark.parametrize("login", ["token-file-rotated", "exec-plugin"])
def test_the_operator_logs_in_over_https_as_users_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, login: str
) -> None:
    """An HTTPS API whose CA is inline in the kubeconfig; a token file the kubelet rewrites mid-run (the
    old token revoked: the operator's next request gets a 401, logs in again, reads the new one), or an
    exec plugin's credential (kubelogin's way)."""
    token = tmp_path / "token"
    token.write_text("first")
    user = {"tokenFile": str(token)} if login == "token-file-rotated" else exec_plugin(tmp_path, "first")
    with KubeApi(tmp_path / "api", tls=True, tokens={"first"}, user=user) as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
        info = kube_login()
        assert info is not None
        cluster = Cluster(server, Kube.from_connection(info, relogin=lambda: asyncio.to_thread(kube_login)))
        cluster.create(crd())
        with operator_running():
            cluster.add_node("spot-1")
            cluster.create(good_job("before", minReplicas=1, maxReplicas=1))
            _start(cluster, "before", ["spot-1"])
            _phase(cluster, "before", "Running")
            if login == "token-file-rotated":
                token.write_text("second")
                assert server.emulator is not None
                server.emulator.tokens = {"second"}
                cluster.create(good_job("after", minReplicas=1, maxReplicas=1))
                _start(cluster, "after", ["spot-1"])
                _phase(cluster, "after", "Running")
        server.run(cluster.kube.close())


def test_a_same_named_secret_blocks_the_etcd_and_is_left_alone(cluster: Cluster) -> None:
    """A user's Secret named `<job>-etcd-tls`: never read as the job's certificates, never deleted."""
    theirs = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "taken-etcd-tls", "namespace": NS},
              "data": {"ca.crt": "eA=="}}  # fmt: skip
    cluster.create(theirs)
    cluster.create(good_job("taken"))
    said = wait_for("ReplicaFailure", lambda: _condition(cluster, "taken", "ReplicaFailure"))
    assert said["reason"] == "NameTaken"
    assert "Secret default/taken-etcd-tls exists and this job's etcd does not" in said["message"]
    assert cluster.pods("taken") == []
    assert "Deployment" not in cluster.etcd_kinds("taken")
    assert cluster.requests("GET", "v1/secrets") == 0  # the operator reads no Secret of a job's namespace
    kept = cluster.api.run(cluster.kube.get("v1", "Secret", NS, "taken-etcd-tls"))
    assert kept is not None
    assert kept["data"] == {"ca.crt": "eA=="}


def test_the_operator_ca_lives_in_its_own_namespace_and_signs_every_etcd(
    api: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Least privilege: the operator keeps its CA in one Secret of its own namespace (made by the first
    replica, reused after a restart) and reaches every managed etcd with the client pair it signs; a
    job's Secret is only created, never read."""
    monkeypatch.setenv(constants.OPERATOR_NAMESPACE_ENV, "torchspot-system")
    with operator_running():
        api.create(good_job("signed"))
        wait_for("the job's etcd", lambda: "Deployment" in api.etcd_kinds("signed"))
    stored = api.api.run(api.kube.get("v1", "Secret", "torchspot-system", constants.OPERATOR_CA_SECRET))
    assert stored is not None
    assert stored["immutable"] is True
    ours = certs.from_operator_files({k: base64.b64decode(v) for k, v in stored["data"].items()})
    job_secret = api.api.run(api.kube.get("v1", "Secret", NS, "signed-etcd-tls"))
    assert job_secret is not None
    files = {k: base64.b64decode(v) for k, v in job_secret["data"].items()}
    assert ours.ca.cert in files[certs.CA_FILE]  # the etcd trusts the operator's client certificate
    server = x509.load_pem_x509_certificate(files[certs.SERVER_CERT_FILE])
    assert server.issuer == x509.load_pem_x509_certificate(ours.ca.cert).subject  # and the operator its server
    assert certs.OPERATOR_CA_KEY_FILE not in files  # no job holds the operator's key
    posts = api.requests("POST", "v1/secrets")
    with operator_running():  # a restart (or a second replica) uses the same CA
        api.create(good_job("again"))
        wait_for("the second job's etcd", lambda: "Deployment" in api.etcd_kinds("again"))
    assert api.requests("POST", "v1/secrets") == posts + 1  # the second job's Secret only
    again = api.api.run(api.kube.get("v1", "Secret", NS, "again-etcd-tls"))
    assert again is not None
    assert ours.ca.cert in base64.b64decode(again["data"][certs.CA_FILE])


def _with_metadata(body: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    body["metadata"].update(extra)
    return body


def test_a_job_left_behind_is_released_by_the_documented_command(api: Cluster) -> None:
    """The operator puts no finalizer on a job, and takes off the one an older operator's kopf timers put;
    a job left with it by an operator that is gone is released by docs/operator.md's one command (run
    here with the real kubectl against the emulator)."""
    older = {"finalizers": [f"{constants.GROUP}/finalizer"]}
    with operator_running():
        api.create(good_job("fresh"))
        api.create(_with_metadata(good_job("upgraded"), older))
        _phase(api, "fresh", "Pending")
        wait_for("the old finalizer taken off", lambda: not api.job("upgraded")["metadata"].get("finalizers"))
        assert not api.job("fresh")["metadata"].get("finalizers")
        _quiet(api)  # the operator stops between reconciles, not in one
    api.create(_with_metadata(good_job("orphan"), older))  # as an older operator, now gone, left it
    readme = (Path(__file__).resolve().parents[2] / "docs" / "operator.md").read_text()
    section = readme[readme.index("## Deleting jobs and uninstalling") :]
    command = section.split("```sh\n", 1)[1].split("\n```", 1)[0]
    argv = shlex.split(command.replace("NAMESPACE", NS).replace("NAME", "orphan"))
    assert argv[0] == "kubectl"
    kubectl = str(Path(sys.executable).parent / "kubectl")  # installed by make venv (tools/kube_tools.py)
    done = subprocess.run([kubectl, *argv[1:]], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert not api.job("orphan")["metadata"].get("finalizers")


def test_active_deadline_fails_the_job(cluster: Cluster) -> None:
    cluster.add_node("spot-1")
    cluster.create(good_job("bounded", activeDeadlineSeconds=3))  # timestamps have whole seconds
    _start(cluster, "bounded", ["spot-1", "spot-1", "spot-1"])
    failed = _phase(cluster, "bounded", "Failed")
    assert next(c for c in failed["conditions"] if c["type"] == "Failed")["reason"] == "DeadlineExceeded"
    wait_for("workers deleted", lambda: cluster.pods("bounded") == [])
    wait_for("etcd deleted", lambda: not cluster.etcd_kinds("bounded"))


def test_a_same_named_object_the_job_does_not_own_is_left_alone(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's own Service named `<job>-etcd`: not taken for the job's, not deleted; the status says the
    name is taken and no worker is made (it would reach that Service); once it is gone, the job runs."""
    monkeypatch.setattr(constants, "NAME_RETRY_SECONDS", 1)
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "clash-etcd", "namespace": NS},
              "spec": {"ports": [{"port": 80}]}}  # fmt: skip
    cluster.create(theirs)
    cluster.create(good_job("clash"))
    taken = wait_for("ReplicaFailure", lambda: _condition(cluster, "clash", "ReplicaFailure"))
    assert taken["reason"] == "NameTaken"
    assert "Service default/clash-etcd exists and is not owned by this job" in taken["message"]
    assert wait_for("NameTaken event", lambda: cluster.events("NameTaken"))
    assert cluster.pods("clash") == []
    assert _status(cluster, "clash")["phase"] == "Pending"

    cluster.patch(constants.PLURAL, "clash", {"spec": {"suspend": True}})  # the job's own etcd objects go ...
    wait_for("the job's Deployment deleted", lambda: "Deployment" not in cluster.etcd_kinds("clash"))
    service = cluster.etcd("clash")["Service"]  # ... the user's Service stays
    assert "ownerReferences" not in service["metadata"]

    cluster.delete("v1", "Service", "clash-etcd")
    cluster.patch(constants.PLURAL, "clash", {"spec": {"suspend": False}})
    wait_for("workers once the name is free", lambda: len(cluster.pods("clash")) == 3, timeout=RECONCILE_INTERVAL + 20)
    owned = cluster.etcd("clash")["Service"]["metadata"]["ownerReferences"][0]
    assert owned["uid"] == cluster.job("clash")["metadata"]["uid"]
    wait_for(
        "ReplicaFailure cleared",
        lambda: (c := _condition(cluster, "clash", "ReplicaFailure")) and c["status"] == "False",
    )


def test_a_recreated_job_never_counts_its_predecessors_pods(cluster: Cluster) -> None:
    """Deleted and re-created under the same name while the old pods are still there (their garbage
    collection takes a while on a cluster; the emulator has none): the new job owns only its own."""
    cluster.add_node("spot-1")
    cluster.create(good_job("again"))
    old_names = _start(cluster, "again", ["spot-1", "spot-1", "spot-1"])
    _phase(cluster, "again", "Running")
    old_uid = cluster.job("again")["metadata"]["uid"]
    cluster.delete(constants.API_VERSION, constants.PLURAL, "again")
    wait_for("the old job gone", lambda: cluster.api.run(
        cluster.kube.get(constants.API_VERSION, constants.PLURAL, NS, "again")) is None or None)  # fmt: skip
    for api_version, kind in ETCD_KINDS:  # the garbage collector's part
        cluster.delete(api_version, kind, "again-etcd")
    cluster.delete("v1", "Secret", "again-etcd-tls")

    cluster.create(good_job("again", cleanPodPolicy="All"))
    new_uid = wait_for("the new job", lambda: (u := cluster.job("again")["metadata"]["uid"]) != old_uid and u)
    wait_for("its own three workers", lambda: len(cluster.pods("again")) == 6)
    mine = [p for p in cluster.pods("again") if p["metadata"]["ownerReferences"][0]["uid"] == new_uid]
    assert sorted(p["metadata"]["name"] for p in mine) == ["again-worker-3", "again-worker-4", "again-worker-5"]
    status_now = _phase(cluster, "again", "Pending")
    assert status_now["replicas"]["ready"] == 0  # the old, Ready pods are not its workers
    assert [e["message"] for e in cluster.events("NameTaken")] == []

    cluster.run_pod("again-worker-3", "spot-1")
    cluster.exit("again-worker-3", 0)
    _phase(cluster, "again", "Succeeded")
    wait_for("its own pods cleaned up", lambda: sorted(cluster.names("again")) == sorted(old_names))


def test_an_edit_of_the_rendezvous_image_updates_the_etcd_in_place(cluster: Cluster) -> None:
    cluster.create(good_job("edited"))
    before = wait_for("the etcd Deployment", lambda: cluster.etcd("edited").get("Deployment"))
    cluster.patch(constants.PLURAL, "edited", {"spec": {"rendezvous": {"image": "quay.io/coreos/etcd:v3.5.21"}}})

    def image() -> str:
        found = cluster.etcd("edited").get("Deployment") or {}
        return str(found.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0].get("image"))

    wait_for("the new image", lambda: image() == "quay.io/coreos/etcd:v3.5.21")
    after = cluster.etcd("edited")["Deployment"]
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # in place, not re-created
    hash_key = constants.ANNOTATION_SPEC_HASH
    assert after["metadata"]["annotations"][hash_key] != before["metadata"]["annotations"][hash_key]
    assert wait_for("Updated event", lambda: cluster.events("Updated"))

    # A template edit reaches the workers created after it; the running ones stay as they are.
    wait_for("three workers", lambda: len(cluster.pods("edited")) == 3)
    old = {p["metadata"]["uid"] for p in cluster.pods("edited")}
    trainer = cluster.job("edited")["spec"]["template"]["spec"]["containers"][0]
    cluster.patch(constants.PLURAL, "edited", {"spec": {"template": {"spec": {"containers": [
        {**trainer, "image": "ghcr.io/torchspot/trainer:0.2.0"}]}}}})  # fmt: skip
    cluster.evict("edited-worker-0")
    new = wait_for("a replacement", lambda: [p for p in cluster.pods("edited") if p["metadata"]["uid"] not in old])
    assert new[0]["spec"]["containers"][0]["image"] == "ghcr.io/torchspot/trainer:0.2.0"
    kept = [p for p in cluster.pods("edited") if p["metadata"]["uid"] in old]
    assert {p["spec"]["containers"][0]["image"] for p in kept} == {"ghcr.io/torchspot/trainer:0.1.0"}


def test_a_hand_edit_of_the_managed_etcd_is_set_back_by_server_side_apply(cluster: Cluster) -> None:
    """Someone scales the job's etcd to 0 and swaps its image: the operator applies what it builds
    (fieldManager torchspot-operator, force), once, and says so; the hash annotation alone would
    never have noticed (the edit left it as it was)."""
    cluster.create(good_job("drifting"))
    built = wait_for("the etcd Deployment", lambda: cluster.etcd("drifting").get("Deployment"))
    image = built["spec"]["template"]["spec"]["containers"][0]["image"]
    name = built["metadata"]["name"]
    edited = copy.deepcopy(built["spec"]["template"]["spec"]["containers"])
    edited[0]["image"] = "etcd:someone-elses"
    patches = cluster.requests("PATCH", "apps/v1/deployments")
    cluster.api.run(cluster.kube.patch("apps/v1", "Deployment", NS, name, {"spec": {
        "replicas": 0, "template": {"spec": {"containers": edited}}}}))  # fmt: skip

    def restored() -> bool:
        spec = cluster.etcd("drifting")["Deployment"]["spec"]
        return bool(spec["replicas"] == 1 and spec["template"]["spec"]["containers"][0]["image"] == image)

    wait_for("the Deployment set back", restored)
    assert wait_for("a Drifted event", lambda: cluster.events("Drifted"))
    _quiet(cluster)
    assert cluster.requests("PATCH", "apps/v1/deployments") - patches == 2  # the edit, and one apply
    assert cluster.etcd("drifting")["Deployment"]["metadata"]["uid"] == built["metadata"]["uid"]  # in place


def test_with_node_handling_off_the_operator_neither_watches_nor_reads_nodes(api: Cluster, tmp_path: Path) -> None:
    """TORCHSPOT_NODE_HANDLING=off: no node watch, no node read, and a NotReady node's worker stays.

    The operator runs as its own process, started as the chart starts it (`python -m
    torchspot_operator`), its settings read from its environment.
    """
    api.add_node("spot-1")
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(api.api.kubeconfig), constants.NODE_HANDLING_ENV: "off",
           METRICS_PORT_ENV: str(port)}  # fmt: skip

    with (tmp_path / "operator.log").open("w") as log, subprocess.Popen(
        [sys.executable, "-m", "torchspot_operator", "--standalone", "--all-namespaces"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    ) as operator:  # fmt: skip
        try:
            api.create(good_job("nodeless"))
            _start(api, "nodeless", ["spot-1", "spot-1", "spot-1"])
            _phase(api, "nodeless", "Running")
            api.patch("nodes", "spot-1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, None)
            with _settles(api, lambda: metric_sum(port, "torchspot_reconcile_seconds_count")):
                api.patch("pods", "nodeless-worker-0", {"metadata": {"labels": {"poke": "1"}}})  # reconcile it
            assert len(api.pods("nodeless")) == 3
            assert api.requests(resource="v1/nodes") == 2  # this test's own create and patch
            # A reconcile the operator's own pod watch started (--all-namespaces: one cluster-wide watch)
            # posts its Events: it runs in kopf's context (it failed at its first Event when the watches
            # were started at login).
            api.evict("nodeless-worker-1")
            wait_for("the Replaced event", lambda: api.events("Replaced"))
        finally:
            operator.terminate()
            operator.wait(30)
    assert "after a watch event failed" not in (tmp_path / "operator.log").read_text()


def test_kubectl_apply_of_a_bad_or_changed_job_is_refused_naming_the_field(api: Cluster) -> None:
    """The API server (the emulator with the CRD) refuses at once: no operator needed to say why."""
    with pytest.raises(ApiError) as refused:
        api.create(with_path("checkpoint.uri", "s3://bucket/run", name="bad-uri"))
    assert refused.value.status == 422
    assert "spec.checkpoint.uri: expected az://CONTAINER/PREFIX" in str(refused.value)
    api.create(good_job("fixed"))
    with pytest.raises(ApiError) as immutable:
        api.patch(constants.PLURAL, "fixed", {"spec": {"maxReplicas": 5}})
    assert immutable.value.status == 422
    assert "minReplicas and maxReplicas are immutable" in str(immutable.value)


def test_a_spec_no_schema_checked_is_reported_once(cluster: Cluster) -> None:
    """Stored under an older CRD (the emulator without its admission): InvalidSpec, one event, nothing made."""
    assert cluster.api.emulator is not None
    cluster.api.emulator.admissions.clear()
    cluster.create(with_path("minReplicas", "two", name="old-crd"))
    condition = wait_for("InvalidSpec", lambda: _condition(cluster, "old-crd", "InvalidSpec"))
    assert condition["status"] == "True"
    assert "spec.minReplicas: must be an integer" in condition["message"]
    assert _status(cluster, "old-crd")["phase"] == "Invalid"
    assert condition["observedGeneration"] == _status(cluster, "old-crd")["observedGeneration"] == 1
    writes = cluster.requests("PATCH", f"{JOBS}/status")
    with _settles(cluster):
        cluster.patch(constants.PLURAL, "old-crd", {"spec": {"replicas": 2}})  # still invalid: reconciled again
    # One write: the same problems, of the spec's new generation (conditions say which spec they judged).
    assert cluster.requests("PATCH", f"{JOBS}/status") == writes + 1
    assert _status(cluster, "old-crd")["observedGeneration"] == 2
    assert len(cluster.events("InvalidSpec")) == 1
    assert cluster.pods("old-crd") == []
    assert cluster.etcd_kinds("old-crd") == set()


def test_operator_restarted_during_a_scale_change_converges(api: Cluster) -> None:
    """Level-based: a new operator process reads the world afresh and finishes what the old one began."""
    api.add_node("spot-1")
    with operator_running():
        api.create(good_job("resumed"))
        wait_for("three workers", lambda: len(api.pods("resumed")) == 3)
        for name in api.names("resumed"):
            api.run_pod(name, "spot-1")
        wait_for("phase Running", lambda: _status(api, "resumed").get("phase") == "Running")
    # While no operator runs: scale down to 1, and one of the pods is evicted.
    api.patch(constants.PLURAL, "resumed", {"spec": {"replicas": 1}})
    api.evict("resumed-worker-2")
    assert len(api.pods("resumed")) == 3  # nothing acted on it yet
    with operator_running():
        wait_for("one worker", lambda: len(api.live("resumed")) == 1)
        status = wait_for("desired 1", lambda: (s := _status(api, "resumed"))["replicas"]["desired"] == 1 and s)
        assert status["evictions"] == 1
        assert api.etcd_kinds("resumed") == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
        api.run_pod(api.live("resumed")[0], "spot-1")
        _phase(api, "resumed", "Running")
        # Converged means stable and quiet: two timer rounds later nothing changed, and the operator asked
        # the API nothing (its ticks re-plan from what the watches told it).
        wait_for("one ready", lambda: _status(api, "resumed")["replicas"] == {"desired": 1, "ready": 1, "pending": 0})
        names = api.names("resumed")
        served = _quiet(api)
        time.sleep(2 * RECONCILE_INTERVAL + 1)  # two timer rounds: the absence of change has no condition to poll
        assert api.api.emulator is not None
        assert dict(api.api.emulator.counts) == served
        assert api.names("resumed") == names
        assert _status(api, "resumed")["evictions"] == 1


def test_round_and_checkpoint_reported_by_the_run_reach_the_status(cluster: Cluster, etcd: EtcdServer) -> None:
    """A real etcd as the job's external rendezvous; the agents' and trainer's reports appear in the status."""
    cluster.create(good_job("reported", rendezvous={"endpoint": etcd.endpoint}))
    wait_for("workers", lambda: len(cluster.pods("reported")) == 3)
    assert cluster.etcd_kinds("reported") == set()  # external etcd: nothing managed
    run_id = _status(cluster, "reported")["runId"]
    client = etcd.client()
    try:
        milestones.write(client, run_id, milestones.ROUND, {"round": 2, "nodes": 3}, lease=None)
        record = {"step": 800, "uri": "az://checkpoints/cifar/step-0000000800/"}
        milestones.write(client, run_id, milestones.CHECKPOINT, record, lease=None)
    finally:
        client.close()
    reported = wait_for(
        "the reports in the status", lambda: (s := _status(cluster, "reported")).get("lastCheckpoint") and s
    )
    assert reported["lastCheckpoint"]["step"] == 800
    assert wait_for("the round", lambda: _status(cluster, "reported").get("rendezvousRound") == 2)


def test_a_script_that_reports_no_steps_is_judged_by_its_workers_activity(cluster: Cluster, etcd: EtcdServer) -> None:
    """Two runs of a script that reports no steps, as its agents report them (a real etcd as the jobs'
    rendezvous; the operator reads it): both formed a round. The agents of one say their workers use
    the CPU (activity.py: a script that trains), which is its progress: it trains past twice its stall
    timeout and stays Running. The other's agents say nothing more (its workers wait in a collective
    whose peer never comes): Failed as Stalled, naming the likely cause. Before, both failed so: the
    operator knew the trainer's steps only."""
    timeout = 4
    policy = {"stallTimeoutSeconds": timeout}
    names = ("trains", "hangs")
    for name in names:
        cluster.add_node(f"{name}-node")
        job = good_job(name, minReplicas=1, maxReplicas=1, rendezvous={"endpoint": etcd.endpoint})
        cluster.create({**job, "spec": {**job["spec"], "failurePolicy": policy}})
    runs = {name: wait_for("its run id", lambda: _status(cluster, name).get("runId")) for name in names}  # noqa: B023
    client = etcd.client()
    stop = threading.Event()

    def agents_of_the_training_script() -> None:
        while not stop.wait(0.5):
            record = {"at": int(time.time() * 1000), "node": "trains-node"}  # a new value at each report
            milestones.write(client, runs["trains"], milestones.ACTIVITY, record, lease=None)

    reporter = threading.Thread(target=agents_of_the_training_script, daemon=True)
    try:
        for name in names:  # the round, seen before the last worker is ready (the stall clock starts then)
            milestones.write(client, runs[name], milestones.ROUND, {"round": 0, "nodes": 1}, lease=None)
        wait_for(
            "the rounds in the status",
            lambda: all(_status(cluster, name).get("rendezvousRound") == 0 for name in names),
        )
        reporter.start()
        for name in names:
            _start(cluster, name, [f"{name}-node"])
        failed = _phase(cluster, "hangs", "Failed")
        said = _condition(cluster, "hangs", "Failed")
        assert said is not None
        assert said["reason"] == "Stalled"
        assert "its workers use no CPU" in said["message"]
        began = conditions.parse_timestamp(failed["reachedMinAt"])
        wait_for("twice the stall timeout and a timer round", lambda: (
            datetime.now(UTC) - began).total_seconds() > 2 * timeout + RECONCILE_INTERVAL)  # fmt: skip
        trains = _status(cluster, "trains")
        assert trains["phase"] == "Running", json.dumps(trains, indent=1)
        assert trains["progress"]["activity"] > 0
    finally:
        stop.set()
        if reporter.is_alive():
            reporter.join()
        client.close()


def test_liveness_endpoint_and_json_logs(api: Cluster) -> None:
    """What the Deployment's probe and a log pipeline rely on: /healthz answers, each log line is JSON."""
    port = free_port()
    args = [*OPERATOR_ARGS, "--liveness", f"http://127.0.0.1:{port}/healthz", "--log-format", "json"]
    with KopfRunner(args, timeout=60) as runner:
        api.create(good_job("probed"))
        wait_for("a worker", lambda: api.pods("probed"))

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        assert wait_for("the liveness endpoint", healthy)
    assert runner.exit_code == 0, runner.output
    lines = [line for line in runner.output.splitlines() if line.startswith("{")]
    assert lines
    records = [json.loads(line) for line in lines]
    assert any("probed" in json.dumps(record) for record in records)


def test_default_etcd_placement_setting_places_managed_etcds(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's etcd.defaultPlacement reaches the operator as TORCHSPOT_ETCD_PLACEMENT; a job's own wins."""
    placement = {
        "nodeSelector": {"agentpool": "system"},
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
    }
    monkeypatch.setenv(constants.ETCD_PLACEMENT_ENV, json.dumps(placement))
    with operator_running():
        api.create(good_job("defaulted"))
        api.create(good_job("own", rendezvous={"nodeSelector": {"pool": "cpu"}}))

        def etcd_pod_spec(job: str) -> dict[str, Any] | None:
            found = api.api.run(api.kube.get("apps/v1", "Deployment", NS, f"{job}-etcd"))
            return None if found is None else found["spec"]["template"]["spec"]

        defaulted = wait_for("the defaulted etcd", lambda: etcd_pod_spec("defaulted"))
        assert defaulted["nodeSelector"] == {"agentpool": "system"}
        assert defaulted["tolerations"] == placement["tolerations"]
        own = wait_for("the job's own etcd", lambda: etcd_pod_spec("own"))
        assert own["nodeSelector"] == {"pool": "cpu"}
        assert "tolerations" not in own


def test_a_bad_operator_setting_stops_the_operator_and_names_it(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spot pool as the etcds' default placement: refused at start, not applied to every job."""
    monkeypatch.setenv(constants.ETCD_PLACEMENT_ENV, json.dumps({"nodeSelector": {constants.SPOT_LABEL: "spot"}}))
    with KopfRunner(OPERATOR_ARGS, timeout=60, reraise=False) as runner:
        pass
    assert runner.exit_code != 0
    assert constants.ETCD_PLACEMENT_ENV in runner.output
    assert "must not run on the spot pool" in runner.output


def test_a_bad_node_handling_setting_stops_the_operator_and_names_it(
    api: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(constants.NODE_HANDLING_ENV, "lazy")
    with KopfRunner(OPERATOR_ARGS, timeout=60, reraise=False) as runner:
        pass
    assert runner.exit_code != 0
    assert f"{constants.NODE_HANDLING_ENV}='lazy': expected proactive or off" in runner.output


def test_namespaced_mode_handles_only_the_watched_namespaces(api: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the chart runs it with watchNamespaces: `--namespace=...` instead of `--all-namespaces`."""
    for namespace in ("ml-a", "ml-b"):
        api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    watched, ignored = good_job("team-job"), good_job("team-job")
    watched["metadata"]["namespace"], ignored["metadata"]["namespace"] = "ml-a", "ml-b"
    labels = {constants.LABEL_JOB: "team-job", constants.LABEL_ROLE: constants.ROLE_WORKER}

    def workers(namespace: str) -> list[dict[str, Any]]:
        return api.api.run(api.kube.list("v1", "Pod", namespace, labels))

    args = ["run", "--standalone", "--namespace=ml-a", "-m", "torchspot_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        api.create(watched)
        api.create(ignored)
        assert wait_for("workers in the watched namespace", lambda: len(workers("ml-a")) == 3)
        job = wait_for(
            "the watched job's status",
            lambda: (
                (j := api.api.run(api.kube.get(constants.API_VERSION, constants.PLURAL, "ml-a", "team-job")))
                and j.get("status")
                and j
            ),
        )
        assert job["status"]["phase"] == "Pending"
        ticks = count_ticks(monkeypatch)  # a timer round of the watched job: the other had its chance too
        wait_for("a timer round", lambda: ticks["team-job"] >= 1, timeout=RECONCILE_INTERVAL + 15)
        assert workers("ml-b") == []
        other = api.api.run(api.kube.get(constants.API_VERSION, constants.PLURAL, "ml-b", "team-job"))
        assert other is not None
        assert "status" not in other
    assert runner.exit_code == 0, runner.output


def test_a_status_written_from_an_old_version_is_refused_and_read_again(api: Cluster) -> None:
    """Two writers of one job's status (replicas overlapping in a leader change): the one that planned
    from an older version gets a 409 and reads the job again, instead of adding to a count twice."""
    api.create(good_job("contended"))
    leader = Controller(api.kube)
    standby = Controller(api.kube)

    async def scene() -> tuple[bool, bool, dict[str, Any]]:
        read = await api.kube.get(constants.API_VERSION, constants.PLURAL, NS, "contended")
        assert read is not None
        ref = JobRef("contended", NS, read["metadata"]["uid"])
        first = leader._remember(NS, "contended", ref.uid)
        second = standby._remember(NS, "contended", ref.uid)
        first.body, second.body = dict(read), dict(read)  # both planned from the same version
        version = read["metadata"]["resourceVersion"]
        wrote = await leader.writes.write_status(ref, first, {"evictions": 1}, version)
        refused = not await standby.writes.write_status(ref, second, {"evictions": 1}, version)
        stored = await api.kube.get(constants.API_VERSION, constants.PLURAL, NS, "contended")
        assert stored is not None
        assert first.body is not None  # the leader re-plans from the version it wrote
        assert first.body["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
        again = standby._memory[NS, "contended"].body  # the standby reads the job again
        return wrote, refused and again is None, stored

    wrote, refused, stored = api.api.run(scene())
    assert (wrote, refused) == (True, True)
    assert stored["status"]["evictions"] == 1


def test_a_suspended_job_resumed_by_a_restarted_operator_uses_its_own_secret(api: Cluster) -> None:
    """The operator reads no Secret back: the job's status records that its etcd Secret is its own, so a
    job suspended (its etcd gone, its Secret kept) and resumed under a new operator process runs again
    instead of taking its own Secret for someone else's."""
    with operator_running():
        api.create(good_job("paused"))
        wait_for("the etcd", lambda: "Deployment" in api.etcd_kinds("paused"))
        assert wait_for("recorded", lambda: _status(api, "paused").get("etcdSecret")) == "paused-etcd-tls"
        api.patch(constants.PLURAL, "paused", {"spec": {"suspend": True}})
        wait_for("the etcd gone", lambda: not api.etcd_kinds("paused"))
    with operator_running():  # a new process: it never made that Secret
        api.patch(constants.PLURAL, "paused", {"spec": {"suspend": False}})
        wait_for("the etcd again", lambda: "Deployment" in api.etcd_kinds("paused"))
        wait_for("its workers", lambda: len(api.live("paused")) == 3)
        said = _condition(api, "paused", "ReplicaFailure")
        assert said is None or said["reason"] != "NameTaken", said
