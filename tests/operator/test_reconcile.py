"""The pure parts of the operator: builders, conditions and the reconcile plan."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.operator.jobs import good_job
from torchspot.operator import builders, constants, reconcile, status
from torchspot.operator.builders import JobRef
from torchspot.operator.kube import collection
from torchspot.operator.spec import JobSpec, parse_spec

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
JOB = JobRef("cifar", "default", "0123456789abcdef")
ALL_ETCD = frozenset({"Deployment", "Service", "PodDisruptionBudget"})


def _spec(**fields: Any) -> JobSpec:
    return parse_spec("cifar", good_job(**fields)["spec"])


def _pod(
    index: int, phase: str = "Running", *, ready: bool = True, node: str = "spot-1", **extra: Any
) -> dict[str, Any]:
    pod = builders.worker_pod(JOB, _spec(), index)
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    pod["status"].update(extra)
    return pod


def _node(name: str = "spot-1", *, ready: bool = True, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _plan(pods: list[dict[str, Any]], *, nodes: dict[str, Any] | None = None, old: dict[str, Any] | None = None,
          now: datetime = T0, etcd: frozenset[str] = ALL_ETCD, **spec: Any) -> reconcile.Plan:  # fmt: skip
    nodes = {"spot-1": _node("spot-1"), "spot-2": _node("spot-2")} if nodes is None else nodes
    seen = reconcile.Observed(JOB, _spec(**spec), old or {}, pods, nodes, etcd, now)
    return reconcile.plan(seen)


class TestWorkerPod:
    def test_spot_placement_gpu_and_launcher_settings(self) -> None:
        pod = builders.worker_pod(JOB, _spec(nprocPerNode=2), 4)
        assert pod["metadata"]["name"] == "cifar-worker-4"
        assert pod["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
        assert pod["metadata"]["labels"][constants.LABEL_INDEX] == "4"
        spec = pod["spec"]
        assert spec["nodeSelector"] == {constants.SPOT_LABEL: "spot"}
        assert constants.SPOT_TOLERATION in spec["tolerations"]
        assert spec["restartPolicy"] == "Never"
        assert spec["terminationGracePeriodSeconds"] == 90
        assert spec["securityContext"]["runAsNonRoot"] is True
        trainer = spec["containers"][0]
        assert trainer["resources"]["limits"][constants.GPU_RESOURCE] == 2
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        assert env["PET_NNODES"] == "1:3"
        assert env["PET_NPROC_PER_NODE"] == "2"
        assert env["PET_MAX_RESTARTS"] == str(constants.AGENT_MAX_RESTARTS)  # survivors restart, never give up
        assert env["PET_RDZV_BACKEND"] == "etcd-v3"
        assert env["PET_RDZV_ENDPOINT"] == "cifar-etcd.default.svc:2379"
        assert env["PET_RDZV_ID"] == "default-cifar-01234567"
        assert env["TORCHSPOT_CHECKPOINT_URI"] == "az://checkpoints/cifar"
        assert env["TORCHSPOT_CHECKPOINT_EVERY"] == "100"

    def test_on_demand_without_gpu_and_external_etcd(self) -> None:
        spec = _spec(placement={"spot": False, "gpu": False}, rendezvous={"endpoint": "etcd.shared:2379"})
        pod = builders.worker_pod(JOB, spec, 0)
        assert "nodeSelector" not in pod["spec"]
        assert "tolerations" not in pod["spec"]
        assert "resources" not in pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["PET_RDZV_ENDPOINT"] == "etcd.shared:2379"

    def test_credentials_come_from_the_secret_not_the_spec(self) -> None:
        pod = builders.worker_pod(JOB, _spec(checkpoint={"uri": "az://ckpt/p", "credentialsSecret": "blob"}), 0)
        assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "blob"}}]


class TestEtcd:
    def test_on_demand_pool_non_root_never_spot(self) -> None:
        deployment = builders.etcd_deployment(JOB, _spec(rendezvous={"nodeSelector": {"agentpool": "system"}}))
        pod = deployment["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"agentpool": "system"}
        assert "tolerations" not in pod
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
        assert builders.etcd_disruption_budget(JOB)["spec"]["minAvailable"] == 1
        assert builders.etcd_service(JOB)["spec"]["ports"][0]["port"] == constants.ETCD_PORT


class TestConditions:
    def test_transition_time_moves_only_when_the_status_flips(self) -> None:
        first = status.set_condition([], "Running", True, "Training", "3 workers", T0)
        later = status.set_condition(first, "Running", True, "Training", "2 workers", T0 + timedelta(minutes=5))
        assert later[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
        assert later[0]["message"] == "2 workers"
        flipped = status.set_condition(later, "Running", False, "WaitingForWorkers", "0", T0 + timedelta(minutes=9))
        assert flipped[0]["lastTransitionTime"] == status.timestamp(T0 + timedelta(minutes=9))


def _names(plan: reconcile.Plan) -> list[str]:
    return [obj["metadata"]["name"] for obj in plan.create]


class TestPlan:
    def test_new_job_gets_etcd_and_max_workers(self) -> None:
        plan = _plan([], etcd=frozenset())
        kinds = [obj["kind"] for obj in plan.create]
        assert kinds.count("Pod") == 3
        assert {"Deployment", "Service", "PodDisruptionBudget"} <= set(kinds)
        assert plan.status["phase"] == "Pending"
        assert plan.status["replicas"] == {"desired": 3, "ready": 0, "pending": 0}
        assert [e[1] for e in plan.events].count("ScaledUp") == 3

    def test_converged_job_does_nothing(self) -> None:
        plan = _plan([_pod(0), _pod(1), _pod(2)])
        assert plan.create == []
        assert plan.delete == []
        assert plan.events == []
        assert plan.status["phase"] == "Running"
        running = next(c for c in plan.status["conditions"] if c["type"] == "Running")
        assert running["status"] == "True"

    def test_evicted_pod_is_replaced_and_not_counted_as_failure(self) -> None:
        evicted = _pod(1, "Failed", reason="Evicted")
        plan = _plan([_pod(0), evicted, _pod(2)])
        assert [d.name for d in plan.delete] == ["cifar-worker-1"]
        assert _names(plan) == ["cifar-worker-3"]  # a fresh name: the old one may still be terminating
        assert plan.status["evictions"] == 1
        assert plan.status["restarts"] == 1
        assert plan.status["applicationFailures"] == 0
        assert {e[1] for e in plan.events} == {"Evicted", "Replaced"}

    @pytest.mark.parametrize("code", [137, 143])
    def test_killed_by_a_signal_is_an_eviction(self, code: int) -> None:
        killed = _pod(0, "Failed", containerStatuses=[{"state": {"terminated": {"exitCode": code}}}])
        plan = _plan([killed, _pod(1), _pod(2)])
        assert plan.status["evictions"] == 1
        assert plan.status["applicationFailures"] == 0

    def test_application_failures_beyond_max_restarts_fail_the_job(self) -> None:
        crashed = _pod(0, "Failed", containerStatuses=[{"state": {"terminated": {"exitCode": 1}}}])
        plan = _plan([crashed, _pod(1), _pod(2)], old={"applicationFailures": 3}, failurePolicy={"maxRestarts": 3})
        assert plan.status["phase"] == "Failed"
        failed = next(c for c in plan.status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "TooManyFailures"
        assert plan.create == []
        assert plan.delete_etcd

    @pytest.mark.parametrize(
        ("node", "why"),
        [
            (_node(ready=False), "NotReady"),
            (_node(unschedulable=True), "cordoned"),
            (_node(taints=[{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]), "taint"),
            ({**_node(), "metadata": {"name": "spot-1", "deletionTimestamp": "2026-11-22T12:00:00Z"}}, "deleted"),
        ],
    )
    def test_workers_on_a_bad_node_are_deleted_with_their_grace_period(self, node: dict[str, Any], why: str) -> None:
        nodes = {"spot-1": node, "spot-2": _node("spot-2")}
        plan = _plan([_pod(0, node="spot-1"), _pod(1, node="spot-2")], nodes=nodes)
        assert [(d.name, d.grace) for d in plan.delete] == [("cifar-worker-0", None)]
        assert why in plan.delete[0].why
        assert plan.status["evictions"] == 1

    def test_with_node_handling_off_only_pods_count(self) -> None:
        """TORCHSPOT_NODE_HANDLING=off (the stock recipe's controller): a NotReady node's worker stays."""
        nodes = {"spot-1": _node(ready=False), "spot-2": _node("spot-2")}
        pods = [_pod(0, node="spot-1"), _pod(1, node="spot-2"), _pod(2, node="gone")]
        seen = reconcile.Observed(JOB, _spec(), {}, pods, nodes, ALL_ETCD, T0, node_handling=False)
        plan = reconcile.plan(seen)
        assert plan.delete == []
        assert plan.status["evictions"] == 0
        assert plan.status["replicas"]["ready"] == 3

    def test_workers_on_a_vanished_node_are_deleted_at_once(self) -> None:
        plan = _plan([_pod(0, node="gone"), _pod(1), _pod(2)])
        assert [(d.name, d.grace) for d in plan.delete] == [("cifar-worker-0", 0)]

    def test_pending_replacements_do_not_hold_back_training(self) -> None:
        plan = _plan([_pod(0), _pod(1, "Pending", ready=False, node=""), _pod(2, "Pending", ready=False, node="")])
        assert plan.create == []
        assert plan.status["phase"] == "Scaling"
        assert plan.status["replicas"] == {"desired": 3, "ready": 1, "pending": 2}
        below = next(c for c in plan.status["conditions"] if c["type"] == "BelowMin")
        assert below["status"] == "False"

    def test_scale_down_removes_pending_pods_first(self) -> None:
        pods = [_pod(0), _pod(1, "Pending", ready=False, node=""), _pod(2)]
        plan = _plan(pods, replicas=2)
        assert [d.name for d in plan.delete] == ["cifar-worker-1"]
        assert [e[1] for e in plan.events] == ["ScaledDown"]

    def test_below_min_fails_only_after_the_grace_period(self) -> None:
        old = {"startedAt": status.timestamp(T0), "belowMinSince": status.timestamp(T0)}
        pods = [_pod(0, ready=False), _pod(1, ready=False)]
        early = _plan(pods, old=old, now=T0 + timedelta(seconds=30), failurePolicy={"belowMinGraceSeconds": 60})
        assert early.status["phase"] == "BelowMin"
        late = _plan(pods, old=old, now=T0 + timedelta(seconds=61), failurePolicy={"belowMinGraceSeconds": 60})
        assert late.status["phase"] == "Failed"
        assert "belowMinGraceSeconds" in str(late.status["conditions"]) or "BelowMinTooLong" in str(
            late.status["conditions"]
        )

    def test_success_when_a_worker_exits_zero_and_none_is_left(self) -> None:
        done = [_pod(i, "Succeeded", containerStatuses=[{"state": {"terminated": {"exitCode": 0}}}]) for i in range(2)]
        finishing = _plan([*done, _pod(2)])
        assert finishing.create == []
        assert finishing.status["phase"] == "Running"
        finished = _plan(done)
        assert finished.status["phase"] == "Succeeded"
        assert finished.delete_etcd
        assert finished.create == []

    @pytest.mark.parametrize(("policy", "deleted"), [("All", 2), ("Running", 0), ("None", 0)])
    def test_clean_pod_policy(self, policy: str, deleted: int) -> None:
        done = [_pod(i, "Succeeded", containerStatuses=[{"state": {"terminated": {"exitCode": 0}}}]) for i in range(2)]
        plan = _plan(done, cleanPodPolicy=policy)
        assert len(plan.delete) == deleted

    def test_the_same_observation_gives_the_same_plan(self) -> None:
        pods = [_pod(0), _pod(1, "Failed", reason="Evicted")]
        assert _plan(pods) == _plan(pods)


def test_progress_from_etcd_lands_in_the_status_and_survives_gaps() -> None:
    progress = {"round": {"round": 4, "nodes": 3}, "checkpoint": {"step": 1200, "uri": "az://c/p/", "time": "t"}}
    seen = reconcile.Observed(
        JOB, _spec(), {}, [_pod(0), _pod(1), _pod(2)], {"spot-1": _node()}, ALL_ETCD, T0, progress
    )
    first = reconcile.plan(seen).status
    assert first["rendezvousRound"] == 4
    assert first["lastCheckpoint"] == {"step": 1200, "uri": "az://c/p/", "time": "t"}
    later = _plan([_pod(0), _pod(1), _pod(2)], old=first)  # etcd unreachable this time: nothing read
    assert later.status["rendezvousRound"] == 4
    assert later.status["lastCheckpoint"]["step"] == 1200


@pytest.mark.parametrize(
    ("api_version", "kind", "namespace", "want"),
    [
        ("v1", "Pod", "ml", "/api/v1/namespaces/ml/pods"),
        ("v1", "Node", None, "/api/v1/nodes"),
        ("v1", "Secret", "ml", "/api/v1/namespaces/ml/secrets"),
        ("apps/v1", "Deployment", "ml", "/apis/apps/v1/namespaces/ml/deployments"),
        ("policy/v1", "PodDisruptionBudget", "ml", "/apis/policy/v1/namespaces/ml/poddisruptionbudgets"),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition", None,
         "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"),
        (constants.API_VERSION, constants.KIND, "ml",
         f"/apis/{constants.API_VERSION}/namespaces/ml/{constants.PLURAL}"),
        ("v1", "nodes", None, "/api/v1/nodes"),  # a plural passes unchanged
    ],
)  # fmt: skip
def test_collection_paths_of_every_kind_the_project_touches(
    api_version: str, kind: str, namespace: str | None, want: str
) -> None:
    assert collection(api_version, kind, namespace) == want
