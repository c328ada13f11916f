"""The real kopf operator (torchspot.operator.handlers) against the kmock API emulator.

No kubelet or scheduler runs here: the tests play them by patching pod and node
status through the API, as a real kubelet would report it. Every wait is on a
condition read back from the API, with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner

from tests.operator.cluster import NS, Cluster, wait_for
from tests.operator.jobs import good_job, with_path
from torchspot.lab.etcd import EtcdServer, free_port
from torchspot.operator import constants
from torchspot.operator.handlers import RECONCILE_INTERVAL
from torchspot.trainer.rendezvous import status

OPERATOR_ARGS = ["run", "--standalone", "--all-namespaces", "-m", "torchspot.operator.handlers"]


@contextlib.contextmanager
def operator_running() -> Iterator[None]:
    """The real operator (kopf in a background thread of this process) until the block ends."""
    with KopfRunner(OPERATOR_ARGS, timeout=60) as runner:
        yield
    failure: BaseException | None = runner.exception  # typed as never None, but None when all went well
    assert failure is None, runner.output
    assert runner.exit_code == 0, runner.output


@pytest.fixture
def cluster(api: Cluster) -> Iterator[Cluster]:
    """The emulated API with the operator running against it."""
    with operator_running():
        yield api


def _status(cluster: Cluster, job: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.job(job).get("status") or {}
    return status


def _condition(cluster: Cluster, job: str, kind: str) -> dict[str, Any] | None:
    return next((c for c in _status(cluster, job).get("conditions", []) if c["type"] == kind), None)


def test_job_lifecycle_placement_eviction_node_loss_scale_and_success(cluster: Cluster) -> None:
    cluster.add_node("spot-1")
    cluster.add_node("spot-2")
    cluster.create(good_job("cifar"))

    # Created: managed etcd on the on-demand pool, three workers on the spot pool.
    wait_for("three worker pods", lambda: len(cluster.pods("cifar")) == 3)
    assert cluster.etcd_kinds("cifar") == {"Deployment", "Service", "PodDisruptionBudget"}
    pod = cluster.pods("cifar")[0]
    assert pod["spec"]["nodeSelector"][constants.SPOT_LABEL] == "spot"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "ElasticJob"
    assert wait_for("phase Pending", lambda: _status(cluster, "cifar").get("phase") == "Pending")

    # The kubelet starts them: Running, three ready.
    for name, node in zip(cluster.names("cifar"), ["spot-1", "spot-2", "spot-2"], strict=True):
        cluster.run_pod(name, node)
    wait_for("phase Running", lambda: _status(cluster, "cifar").get("phase") == "Running")
    assert _status(cluster, "cifar")["replicas"] == {"desired": 3, "ready": 3, "pending": 0}

    # A spot eviction fails one pod: it is replaced under a new name, counted as an eviction only.
    cluster.patch("pods", "cifar-worker-0", {"status": {"phase": "Failed", "reason": "Evicted"}})
    wait_for("a replacement pod", lambda: "cifar-worker-3" in cluster.names("cifar"))
    wait_for("worker-0 deleted", lambda: "cifar-worker-0" not in cluster.names("cifar"))
    status = wait_for("eviction counted", lambda: (s := _status(cluster, "cifar")).get("evictions") == 1 and s)
    assert status["failures"] == 0
    assert status["restarts"] == 1
    assert wait_for("Evicted event", lambda: cluster.events("Evicted"))
    assert wait_for("Replaced event", lambda: cluster.events("Replaced"))
    # The replacement is Pending (no spot capacity yet); training goes on with two.
    wait_for("phase Scaling", lambda: _status(cluster, "cifar").get("phase") == "Scaling")
    below = _condition(cluster, "cifar", "BelowMin")
    assert below is not None
    assert below["status"] == "False"

    # A node goes NotReady: its workers are deleted at once, not after timeouts.
    cluster.patch("nodes", "spot-2", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, None)
    wait_for("workers on spot-2 gone", lambda: {"cifar-worker-1", "cifar-worker-2"}.isdisjoint(cluster.names("cifar")))
    assert wait_for("evictions counted", lambda: _status(cluster, "cifar").get("evictions") == 3)
    wait_for("replacements", lambda: len(cluster.pods("cifar")) == 3)

    # Scale down through spec.replicas (what kubectl scale sets).
    cluster.patch(constants.PLURAL, "cifar", {"spec": {"replicas": 1}})
    wait_for("one worker left", lambda: len(cluster.pods("cifar")) == 1)
    assert wait_for("ScaledDown event", lambda: cluster.events("ScaledDown"))

    # The run completes: the worker exits 0; the job succeeds and the managed etcd goes.
    (last,) = cluster.names("cifar")
    cluster.run_pod(last, "spot-1")
    terminated = {"terminated": {"exitCode": 0}}
    cluster.patch("pods", last, {"status": {"phase": "Succeeded", "containerStatuses": [{"state": terminated}]}})
    wait_for("phase Succeeded", lambda: _status(cluster, "cifar").get("phase") == "Succeeded")
    wait_for("etcd deleted", lambda: not cluster.etcd_kinds("cifar"))
    succeeded = _condition(cluster, "cifar", "Succeeded")
    assert succeeded is not None
    assert succeeded["status"] == "True"


def test_application_failures_beyond_max_restarts_fail_the_job(cluster: Cluster) -> None:
    cluster.add_node("spot-1")
    cluster.create(good_job("crashy", minReplicas=1, maxReplicas=1, failurePolicy={"maxRestarts": 1}))
    crashed = {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}]}
    for name in ("crashy-worker-0", "crashy-worker-1"):
        wait_for(f"{name} created", lambda: cluster.names("crashy") == [name])  # noqa: B023 - used at once
        cluster.run_pod(name, "spot-1")
        cluster.patch("pods", name, {"status": crashed})
        wait_for(f"{name} removed", lambda: name not in cluster.names("crashy"))  # noqa: B023
    status = wait_for("phase Failed", lambda: (s := _status(cluster, "crashy")).get("phase") == "Failed" and s)
    assert status["failures"] == 2
    failed = _condition(cluster, "crashy", "Failed")
    assert failed is not None
    assert failed["reason"] == "TooManyFailures"
    assert cluster.pods("crashy") == []
    assert wait_for("WorkerFailed events", lambda: len(cluster.events("WorkerFailed")) == 2)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (with_path("checkpoint.uri", "s3://bucket/run", name="bad-uri"), "spec.checkpoint.uri"),
        (with_path("minReplicas", 4, name="bad-range"), "spec.minReplicas"),
        (with_path("template.spec.containers", [], name="bad-template"), "spec.template.spec.containers"),
        (with_path("rendezvous.endpoint", "etcd-without-port", name="bad-endpoint"), "spec.rendezvous.endpoint"),
    ],
)
def test_invalid_spec_creates_nothing_and_says_why(cluster: Cluster, body: dict[str, Any], field: str) -> None:
    """The emulator, like an API server without CEL, lets these through; the operator does not."""
    name = body["metadata"]["name"]
    cluster.create(body)
    condition = wait_for("InvalidSpec", lambda: _condition(cluster, name, "InvalidSpec"))
    assert condition["status"] == "True"
    assert field in condition["message"]
    assert _status(cluster, name)["phase"] == "Invalid"
    assert wait_for("InvalidSpec event", lambda: cluster.events("InvalidSpec"))
    assert cluster.pods(name) == []
    assert cluster.etcd_kinds(name) == set()


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
    api.patch("pods", "resumed-worker-2", {"status": {"phase": "Failed", "reason": "Evicted"}})
    assert len(api.pods("resumed")) == 3  # nothing acted on it yet
    with operator_running():
        wait_for("one worker", lambda: len(api.pods("resumed")) == 1)
        status = wait_for("desired 1", lambda: (s := _status(api, "resumed"))["replicas"]["desired"] == 1 and s)
        assert status["evictions"] == 1
        assert api.etcd_kinds("resumed") == {"Deployment", "Service", "PodDisruptionBudget"}
        # Converged means stable: a few timer rounds later nothing else changed.
        names = api.names("resumed")
        time.sleep(RECONCILE_INTERVAL + 1)  # one timer round: the absence of change has no condition to poll
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
        status.write(client, run_id, status.ROUND, {"round": 2, "nodes": 3}, lease=None)
        record = {"step": 800, "uri": "az://checkpoints/cifar/step-0000000800/"}
        status.write(client, run_id, status.CHECKPOINT, record, lease=None)
    finally:
        client.close()
    reported = wait_for(
        "the reports in the status", lambda: (s := _status(cluster, "reported")).get("lastCheckpoint") and s
    )
    assert reported["lastCheckpoint"]["step"] == 800
    assert wait_for("the round", lambda: _status(cluster, "reported").get("rendezvousRound") == 2)


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


def test_namespaced_mode_handles_only_the_watched_namespaces(api: Cluster) -> None:
    """As the chart runs it with watchNamespaces: `--namespace=...` instead of `--all-namespaces`."""
    for namespace in ("ml-a", "ml-b"):
        api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    watched, ignored = good_job("team-job"), good_job("team-job")
    watched["metadata"]["namespace"], ignored["metadata"]["namespace"] = "ml-a", "ml-b"
    labels = {constants.LABEL_JOB: "team-job", constants.LABEL_ROLE: constants.ROLE_WORKER}

    def workers(namespace: str) -> list[dict[str, Any]]:
        return api.api.run(api.kube.list("v1", "Pod", namespace, labels))

    args = ["run", "--standalone", "--namespace=ml-a", "-m", "torchspot.operator.handlers"]
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
        time.sleep(RECONCILE_INTERVAL + 1)  # a timer round: the absence of action has no condition to poll
        assert workers("ml-b") == []
        other = api.api.run(api.kube.get(constants.API_VERSION, constants.PLURAL, "ml-b", "team-job"))
        assert other is not None
        assert "status" not in other
    assert runner.exit_code == 0, runner.output
