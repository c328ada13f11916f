"""The pure parts of the operator: builders, conditions, failure rules and the reconcile plan, table-driven."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.operator.jobs import good_job
from torchspot_operator import builders, conditions, constants, lifecycle, nodes, reconcile, verdicts
from torchspot_operator.builders import JobRef
from torchspot_operator.conditions import CreateFailure
from torchspot_operator.kube import delete_options
from torchspot_operator.nodes import NodePolicy
from torchspot_operator.spec import JobSpec, parse_spec
from torchspot_operator.writes import slow_start
from torchspot_trainer import REPLICA_GROUP_ENV, REPLICA_GROUP_SIZE_ENV

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
JOB = JobRef("cifar", "default", "0123456789abcdef")
_uids = itertools.count(1)


def _spec(**fields: Any) -> JobSpec:
    return parse_spec(good_job(**fields)["spec"])


def _etcd(spec: JobSpec | None = None) -> dict[str, Mapping[str, Any]]:
    """The managed etcd's objects as the API server holds them after the operator made them."""
    objs = builders.etcd_objects(JOB, spec or _spec())
    for obj in objs:
        obj["metadata"]["uid"] = f"etcd-{obj['kind']}"
        if obj["kind"] == "Deployment":
            obj["status"] = {"availableReplicas": 1}  # serving
    return {obj["kind"]: obj for obj in objs}


ALL_ETCD = _etcd()


def _pod(
    index: int, phase: str = "Running", *, ready: bool = True, node: str = "spot-1", uid: str = "", **extra: Any
) -> dict[str, Any]:
    """Worker pod `index` as a kubelet reports it; `extra` goes into its status."""
    pod = builders.worker_pod(JOB, _spec(), index)
    pod["metadata"]["uid"] = uid or f"uid-{index}-{next(_uids)}"
    if node:
        pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    pod["status"].update(extra)
    return pod


def _exited(index: int, code: int, reason: str = "Error", **extra: Any) -> dict[str, Any]:
    terminated = {"exitCode": code, "reason": reason}
    phase = "Succeeded" if code == 0 else "Failed"
    return _pod(index, phase, ready=False, containerStatuses=[{"state": {"terminated": terminated}}], **extra)


def _pending(index: int, message: str = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.") -> dict[str, Any]:
    scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    return _pod(index, "Pending", ready=False, node="", conditions=[scheduled])


def _node(name: str = "spot-1", *, ready: bool = True, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


NODES = {"spot-1": _node("spot-1"), "spot-2": _node("spot-2")}


def _seen(
    pods: list[dict[str, Any]], *, old: Mapping[str, Any] | None = None, now: datetime = T0,
    etcd: Mapping[str, Mapping[str, Any]] | None = None, nodes: Mapping[str, Any] | None = None,
    spec: JobSpec | None = None, **fields: Any,
) -> reconcile.Observed:  # fmt: skip
    return reconcile.Observed(
        JOB, spec or _spec(), old or {}, pods, NODES if nodes is None else nodes,
        ALL_ETCD if etcd is None else etcd, now, **fields,
    )  # fmt: skip


def _plan(pods: list[dict[str, Any]], **kwargs: Any) -> reconcile.Plan:
    return reconcile.plan(_seen(pods, **kwargs))


def _running(**extra: Any) -> dict[str, Any]:
    """The status of a job that reached its minimum at T0 and trains with 3 workers."""
    started = conditions.timestamp(T0 - timedelta(minutes=5))
    conds = conditions.set_condition([], conditions.RUNNING, True, "Training", "training with 3 worker(s)", T0)
    return {"phase": "Running", "startTime": started, "reachedMinAt": started, "conditions": conds, **extra}


def _condition(plan: reconcile.Plan, kind: str) -> dict[str, Any]:
    found = conditions.find(plan.status["conditions"], kind)
    assert found is not None, f"no {kind} condition in {plan.status['conditions']}"
    return dict(found)


def _created(plan: reconcile.Plan, kind: str = "Pod") -> list[str]:
    return [obj["metadata"]["name"] for obj in plan.create if obj["kind"] == kind]


def _deleted(plan: reconcile.Plan, kind: str = "Pod") -> list[tuple[str, int | None]]:
    return [(d.name, d.grace) for d in plan.delete if d.kind == kind]


def _reasons(plan: reconcile.Plan) -> list[str]:
    return [reason for _, reason, _ in plan.all_events()]


class TestWorkerPod:
    def test_spot_placement_gpu_and_launcher_settings(self) -> None:
        pod = builders.worker_pod(JOB, _spec(nprocPerNode=2), 4)
        assert pod["metadata"]["name"] == "cifar-worker-4"
        assert pod["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
        assert pod["metadata"]["annotations"][constants.ANNOTATION_INDEX] == "4"
        # Labels stay job-scoped: a label unique to each pod would be one Cilium identity per pod.
        assert set(pod["metadata"]["labels"]) == {constants.LABEL_JOB, constants.LABEL_ROLE, constants.LABEL_MANAGED_BY}
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
        assert env["TORCHSPOT_DEVICE"] == "cuda"  # a GPU job's worker stops on a node without CUDA, never gloo
        own = _spec()
        own.template["spec"]["containers"][0]["env"] = [{"name": "TORCHSPOT_DEVICE", "value": "auto"}]
        mine = builders.worker_pod(JOB, own, 0)["spec"]["containers"][0]["env"]
        assert [e["value"] for e in mine if e["name"] == "TORCHSPOT_DEVICE"] == ["auto"]  # the user's setting stays

    def test_on_demand_without_gpu_and_external_etcd(self) -> None:
        spec = _spec(placement={"spot": False, "gpu": False}, rendezvous={"endpoint": "etcd.shared:2379"})
        pod = builders.worker_pod(JOB, spec, 0)
        assert "nodeSelector" not in pod["spec"]
        assert "tolerations" not in pod["spec"]
        assert "resources" not in pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["PET_RDZV_ENDPOINT"] == "etcd.shared:2379"
        assert "TORCHSPOT_DEVICE" not in env

    def test_loader_workers_get_shared_memory_unless_the_template_mounts_its_own(self) -> None:
        pod = builders.worker_pod(JOB, _spec(), 0)["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[constants.SHM_DIR])
        # Sized (the runtime's default is 64 MiB; unsized, it could grow to the node's memory and get
        # the pod evicted under node pressure): from the memory limit, else the request, else a fallback.
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": builders.SHM_FALLBACK_SIZE}
        limited = _spec()
        limited.template["spec"]["containers"][0]["resources"] = {
            "requests": {"memory": "12Gi"},
            "limits": {"memory": "24Gi"},
        }
        pod = builders.worker_pod(JOB, limited, 0)["spec"]
        assert next(v for v in pod["volumes"] if v["name"] == "torchspot-shm")["emptyDir"]["sizeLimit"] == "24Gi"
        spec = _spec()
        own = {"name": "big-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
        spec.template["spec"]["volumes"] = [own]
        spec.template["spec"]["containers"][0]["volumeMounts"] = [{"name": "big-shm", "mountPath": "/dev/shm"}]
        kept = builders.worker_pod(JOB, spec, 0)["spec"]
        assert [v for v in kept["volumes"] if "emptyDir" in v] == [own]
        assert [m for m in kept["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"] == [
            {"name": "big-shm", "mountPath": "/dev/shm"}
        ]

    def test_credentials_come_from_the_secret_not_the_spec(self) -> None:
        pod = builders.worker_pod(JOB, _spec(checkpoint={"uri": "az://ckpt/p", "credentialsSecret": "blob"}), 0)
        assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "blob"}}]

    def test_a_resumed_job_gets_a_fresh_rendezvous_id(self) -> None:
        pod = builders.worker_pod(replace(JOB, resumes=2), _spec(), 0)
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["PET_RDZV_ID"] == "default-cifar-01234567-r2"


class TestEtcd:
    def test_on_demand_pool_non_root_never_spot(self) -> None:
        deployment = builders.etcd_deployment(JOB, _spec(rendezvous={"nodeSelector": {"agentpool": "system"}}))
        pod = deployment["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"agentpool": "system"}
        assert "tolerations" not in pod
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
        assert builders.etcd_service(JOB)["spec"]["ports"][0]["port"] == constants.ETCD_PORT

    def test_the_etcd_demands_the_jobs_client_certificate_and_pods_get_only_theirs(self) -> None:
        deployment = builders.etcd_deployment(JOB, _spec())
        pod = deployment["spec"]["template"]["spec"]
        command = pod["containers"][0]["command"]
        assert "--client-cert-auth" in command
        assert "--listen-client-urls=https://0.0.0.0:2379" in command
        assert f"--trusted-ca-file={constants.ETCD_TLS_DIR}/ca.crt" in command
        (tls,) = [v for v in pod["volumes"] if "secret" in v]
        assert [i["key"] for i in tls["secret"]["items"]] == ["ca.crt", "tls.crt", "tls.key"]
        assert pod["containers"][0]["readinessProbe"]["httpGet"]["port"] == constants.ETCD_HEALTH_PORT
        worker = builders.worker_pod(JOB, _spec(), 0)["spec"]
        (tls,) = [v for v in worker["volumes"] if "secret" in v]
        assert tls["secret"]["secretName"] == "cifar-etcd-tls"
        assert [i["key"] for i in tls["secret"]["items"]] == ["ca.crt", "client.crt", "client.key"]  # never tls.key
        env = {e["name"]: e.get("value") for e in worker["containers"][0]["env"]}
        assert env["PET_RDZV_CONF"].endswith(
            ",cacert=/etc/torchspot/etcd/ca.crt,cert=/etc/torchspot/etcd/client.crt,key=/etc/torchspot/etcd/client.key"
        )
        external = builders.worker_pod(JOB, _spec(rendezvous={"endpoint": "etcd.shared:2379"}), 0)["spec"]
        assert not [v for v in external["volumes"] if "secret" in v]  # a user's own etcd: their TLS is theirs

    def test_the_etcd_is_sized_so_its_memory_volume_cannot_fill(self) -> None:
        """bench/etcd_soak measured a day: the data directory peaked at 254 MiB with these flags."""
        pod = builders.etcd_deployment(JOB, _spec())["spec"]["template"]["spec"]
        etcd = pod["containers"][0]
        assert set(builders.ETCD_SIZING) <= set(etcd["command"])
        assert "--max-wals=2" in etcd["command"]
        (data,) = [v for v in pod["volumes"] if v["name"] == "data"]
        assert data["emptyDir"] == {"medium": "Memory", "sizeLimit": "384Mi"}
        assert etcd["resources"]["limits"]["memory"] == "512Mi"  # the volume counts against it

    def test_only_the_jobs_workers_and_the_operator_reach_the_etcd(self) -> None:
        operator = ("torchspot", (("app.kubernetes.io/name", "torchspot"),))
        policy = builders.etcd_network_policy(replace(JOB, operator=operator))["spec"]
        assert policy["podSelector"]["matchLabels"][constants.LABEL_ROLE] == "etcd"
        (rule,) = policy["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": constants.ETCD_PORT}]
        workers, ours = rule["from"]
        assert workers == {"podSelector": {"matchLabels": JOB.labels(constants.ROLE_WORKER)}}
        assert ours["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "torchspot"}}
        assert ours["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "torchspot"}}
        assert len(builders.etcd_network_policy(JOB)["spec"]["ingress"][0]["from"]) == 1  # operator unknown

    def test_an_etcd_made_before_tls_stays_plain_for_its_running_workers(self) -> None:
        """An operator upgrade under a running job: its workers hold no certificate."""
        legacy = replace(JOB, etcd_tls=False)
        etcd = {obj["kind"]: obj for obj in builders.etcd_objects(legacy, _spec())}
        plan = _plan([_pod(0)], etcd=etcd, old=_running())
        (created,) = [obj for obj in plan.create if obj["kind"] == "Pod"][:1]
        assert not [v for v in created["spec"]["volumes"] if "secret" in v]
        assert plan.update == []  # nothing to bring in line: the plain etcd stays
        assert "cacert=" not in str(created)

    def test_each_object_carries_the_hash_of_what_was_built(self) -> None:
        before = {o["kind"]: o for o in builders.etcd_objects(JOB, _spec())}
        after = {o["kind"]: o for o in builders.etcd_objects(JOB, _spec(rendezvous={"image": "etcd:v3.5.21"}))}
        hashes = {kind: (o["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH]) for kind, o in before.items()}
        assert all(len(h) == 16 for h in hashes.values())
        changed = {k for k in before if after[k]["metadata"]["annotations"] != before[k]["metadata"]["annotations"]}
        assert changed == {"Deployment"}

    @pytest.mark.parametrize(
        ("old", "new", "want"),
        [
            ({"a": 1, "b": 2}, {"a": 1, "b": 3}, {"b": 3}),
            ({"a": 1, "b": 2}, {"a": 1}, {"b": None}),
            ({"m": {"x": 1, "y": 2}}, {"m": {"x": 1}}, {"m": {"y": None}}),
            ({"l": [1, 2]}, {"l": [2]}, {"l": [2]}),
            ({}, {"n": {"k": "v"}}, {"n": {"k": "v"}}),
        ],
        ids=["changed", "removed", "nested-removed", "list-replaced", "added"],
    )
    def test_merge_patch_turns_old_into_new(self, old: dict[str, Any], new: dict[str, Any], want: Any) -> None:
        assert builders.merge_patch(old, new) == want

    def test_an_object_covers_what_the_operator_sets_whatever_the_server_adds(self) -> None:
        """Drift is a field the operator sets holding another value (or gone); the API server's defaults,
        allocations and bookkeeping are not."""
        (desired,) = [o for o in builders.etcd_objects(JOB, _spec()) if o["kind"] == "Deployment"]
        stored = copy.deepcopy(desired)
        stored["metadata"].update(uid="u", resourceVersion="7", generation=2, managedFields=[{"manager": "x"}])
        stored["spec"]["progressDeadlineSeconds"] = 600  # defaults
        stored["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
        stored["status"] = {"availableReplicas": 1}
        assert builders.covers(stored, desired)
        scaled = copy.deepcopy(stored)
        scaled["spec"]["replicas"] = 0  # kubectl scale
        assert not builders.covers(scaled, desired)
        imaged = copy.deepcopy(stored)
        imaged["spec"]["template"]["spec"]["containers"][0]["image"] = "etcd:other"
        assert not builders.covers(imaged, desired)
        relabelled = copy.deepcopy(stored)
        del relabelled["metadata"]["labels"][constants.LABEL_ROLE]
        assert not builders.covers(relabelled, desired)

    def test_objects_found_holding_the_build_are_not_compared_again_at_their_version(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A timer tick of a settled job builds and compares nothing; a new version of one object (someone's
        edit) is compared again, and drift found."""
        etcd = copy.deepcopy(_etcd())
        for index, obj in enumerate(etcd.values()):
            obj["metadata"]["resourceVersion"] = str(index + 1)
        first = _plan([_pod(0)], etcd=etcd, old=_running())
        assert first.settled == {o["metadata"]["uid"]: o["metadata"]["resourceVersion"] for o in etcd.values()}

        def no_build(*_: Any) -> list[dict[str, Any]]:
            raise AssertionError("built although every object is known to hold the build")

        with monkeypatch.context() as patched:
            patched.setattr(builders, "etcd_objects", no_build)
            again = _plan([_pod(0)], etcd=etcd, old=first.status, applied=first.settled)
        assert again.update == []
        assert again.settled == {}
        scaled = copy.deepcopy(etcd)
        scaled["Deployment"]["spec"]["replicas"] = 0  # kubectl scale: a new version
        scaled["Deployment"]["metadata"]["resourceVersion"] = "9"
        drifted = _plan([_pod(0)], etcd=scaled, old=first.status, applied=first.settled)
        assert [(u.kind, u.apply) for u in drifted.update] == [("Deployment", True)]


class TestConditions:
    def test_transition_time_moves_only_when_the_status_flips(self) -> None:
        first = conditions.set_condition([], "Running", True, "Training", "3 workers", T0)
        later = conditions.set_condition(first, "Running", True, "Training", "2 workers", T0 + timedelta(minutes=5))
        assert later[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
        assert later[0]["message"] == "2 workers"
        flipped = conditions.set_condition(later, "Running", False, "WaitingForWorkers", "0", T0 + timedelta(minutes=9))
        assert flipped[0]["lastTransitionTime"] == conditions.timestamp(T0 + timedelta(minutes=9))

    def test_replica_failure_names_each_object_and_clears(self) -> None:
        taken = CreateFailure("Service/cifar-etcd", conditions.NAME_TAKEN, "Service default/cifar-etcd exists", T0)
        refused = CreateFailure("Pod/cifar-worker-0", conditions.FAILED_CREATE, "Pod refused: quota", T0)
        conds = conditions.replica_failure([], [refused, taken], T0)
        assert conds == [{
            "type": "ReplicaFailure", "status": "True", "reason": "NameTaken",
            "message": "Pod refused: quota; Service default/cifar-etcd exists",
            "lastTransitionTime": conditions.timestamp(T0),
        }]  # fmt: skip
        cleared = conditions.replica_failure(conds, [], T0 + timedelta(minutes=1))
        assert (cleared[0]["status"], cleared[0]["reason"]) == ("False", "Created")
        assert conditions.replica_failure([], [], T0) == []  # never failed: no condition at all


CLASSIFY = [
    # (case, pod, trouble, want kind, want reason)
    (
        "disruption target",
        _pod(
            0, "Failed", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
        ),
        None,
        "eviction",
        "PreemptionByScheduler",
    ),
    (
        "node-pressure eviction",
        _pod(
            0,
            "Failed",
            reason="Evicted",
            conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}],
        ),
        None,
        "eviction",
        "TerminationByKubelet",
    ),
    (
        "kubelet limit eviction",
        _pod(0, "Failed", reason="Evicted", message='Usage of EmptyDir volume "cache" exceeds the limit "2Gi".'),
        None,
        "failure",
        "LimitEvicted",
    ),
    ("limit eviction on a NotReady node", _pod(0, "Failed", reason="Evicted"), None, "failure", "LimitEvicted"),
    ("node shutdown", _pod(0, "Failed", reason="Terminated"), None, "eviction", "Terminated"),
    ("killed on a lost node", _exited(0, 137), "node is NotReady", "eviction", "NodeLost"),
    ("exit 1", _exited(0, 1), None, "failure", "ExitCode"),
    ("its node cannot run the program", _exited(0, constants.NODE_FAULT_EXIT_CODE), None, "eviction", "NodeFault"),
    ("OOMKilled", _exited(0, 137, "OOMKilled"), None, "failure", "OOMKilled"),
    ("SIGKILL with no disruption", _exited(0, 137), None, "failure", "ExitCode"),
    ("SIGTERM with no disruption", _exited(0, 143), None, "failure", "ExitCode"),
    (
        "device plugin not ready",
        _pod(0, "Failed", reason="UnexpectedAdmissionError", message="Allocate failed"),
        None,
        "eviction",
        "UnexpectedAdmissionError",
    ),
    (
        "no GPU on the node yet",
        _pod(0, "Failed", reason="OutOfnvidia.com/gpu"),
        None,
        "eviction",
        "OutOfnvidia.com/gpu",
    ),
    ("refused for its affinity", _pod(0, "Failed", reason="NodeAffinity"), None, "failure", "NodeAffinity"),
    (
        "a sidecar's exit is not the trainer's",
        _pod(
            0,
            "Failed",
            containerStatuses=[
                {"name": "istio-proxy", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}},
                {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}},
            ],
        ),
        None,
        "failure",
        "OOMKilled",
    ),
    ("failed before running", _pod(0, "Failed"), None, "failure", "AdmissionFailed"),
]


@pytest.mark.parametrize(("case", "pod", "trouble", "kind", "reason"), CLASSIFY, ids=[c[0] for c in CLASSIFY])
def test_what_the_cluster_says_is_an_eviction_everything_else_a_failure(
    case: str, pod: dict[str, Any], trouble: str | None, kind: str, reason: str
) -> None:
    verdict = verdicts.classify(pod, trouble)
    assert (verdict.kind, verdict.reason) == (kind, reason), verdict


class TestStartAndScale:
    def test_new_job_gets_etcd_and_max_workers_and_waits_for_capacity(self) -> None:
        plan = _plan([], etcd={})
        assert [o["kind"] for o in plan.create].count("Pod") == 3
        assert set(_created(plan, "Deployment") + _created(plan, "Service")) == {"cifar-etcd"}
        assert plan.status["phase"] == "Pending"
        assert plan.status["startTime"] == conditions.timestamp(T0)
        assert plan.status["reachedMinAt"] is None
        assert _condition(plan, "WaitingForCapacity")["status"] == "True"
        assert _reasons(plan).count("ScaledUp") == 3

    def test_converged_job_does_nothing_and_its_status_is_a_fixed_point(self) -> None:
        pods = [_pod(0), _pod(1), _pod(2)]
        plan = _plan(pods, old=_running())
        assert (plan.create, plan.delete, plan.update, plan.events, plan.accounted) == ([], [], [], [], [])
        assert plan.status["phase"] == "Running"
        again = _plan(pods, old=plan.status, now=T0 + timedelta(minutes=10))
        assert again.status == plan.status  # the timer finds nothing to write: no request
        assert not again.acts()

    def test_pending_replacements_do_not_hold_back_training(self) -> None:
        plan = _plan([_pod(0), _pending(1), _pending(2)], old=_running())
        assert plan.create == []
        assert plan.status["phase"] == "Scaling"
        assert plan.status["replicas"] == {"desired": 3, "ready": 1, "pending": 2}
        assert _condition(plan, "BelowMin")["status"] == "False"

    def test_scale_down_removes_pending_pods_first(self) -> None:
        plan = _plan([_pod(0), _pending(1), _pod(2)], old=_running(), spec=_spec(replicas=2))
        assert _deleted(plan) == [("cifar-worker-1", None)]
        assert _reasons(plan) == ["ScaledDown"]

    def test_names_a_predecessor_still_holds_are_skipped(self) -> None:
        """A job re-created under its name while the old one's pods are being collected: new names."""
        plan = _plan([], old=_running(), names_in_use=frozenset({"cifar-worker-0", "cifar-worker-1"}))
        assert _created(plan) == ["cifar-worker-2", "cifar-worker-3", "cifar-worker-4"]

    def test_a_taken_worker_name_is_skipped(self) -> None:
        taken = CreateFailure("Pod/cifar-worker-0", conditions.NAME_TAKEN, "Pod default/cifar-worker-0 exists", T0)
        plan = _plan([], old=_running(), create_failures=[taken])
        assert _created(plan) == ["cifar-worker-1", "cifar-worker-2", "cifar-worker-3"]
        assert _condition(plan, "ReplicaFailure")["reason"] == "NameTaken"

    def test_an_etcd_whose_pods_are_refused_is_reported_once(self) -> None:
        """Pod Security (or a quota) refuses the Deployment's pods; its ReplicaFailure reaches the job's status."""
        etcd = _etcd()
        message = 'pods "cifar-etcd-x" is forbidden: violates PodSecurity "restricted:latest": seccompProfile'
        refused = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": message}
        etcd["Deployment"] = {**etcd["Deployment"], "status": {"conditions": [refused]}}
        first = _plan([], etcd=etcd)
        said = _condition(first, "ReplicaFailure")
        assert said["reason"] == "FailedCreate"
        assert said["message"] == f"the managed etcd's pods are refused: {message}"
        assert "the cluster refuses the job's pods" in _condition(first, "WaitingForCapacity")["message"]
        assert [(kind, reason) for kind, reason, _ in first.events if reason == "FailedCreate"] == [
            ("Warning", "FailedCreate")
        ]
        again = _plan([], etcd=etcd, old=first.status)
        assert "FailedCreate" not in _reasons(again)  # an Event once, not at every reconcile
        fixed = _plan([], etcd=_etcd(), old=again.status)
        assert _condition(fixed, "ReplicaFailure")["status"] == "False"


def test_the_status_and_each_condition_say_which_generation_of_the_spec_they_judged() -> None:
    plan = _plan([_pod(0), _pod(1), _pod(2)], old=_running(), generation=4)
    assert plan.status["observedGeneration"] == 4
    assert {c["type"]: c["observedGeneration"] for c in plan.status["conditions"]} == {
        c["type"]: 4 for c in plan.status["conditions"]
    }
    invalid = conditions.invalid(plan.status["conditions"], ["spec.minReplicas: must be an integer"], T0, generation=5)
    assert invalid["observedGeneration"] == 5
    assert all(c["observedGeneration"] == 5 for c in invalid["conditions"])


def _not_ready_since(minutes: int) -> dict[str, Any]:
    since = conditions.timestamp(T0 - timedelta(minutes=minutes))
    return {"metadata": {"name": "spot-1"}, "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": since}]}}  # fmt: skip


def _waiting(reason: str, minutes: int) -> dict[str, Any]:
    """A running pod whose trainer waits for `reason`, bound `minutes` ago."""
    bound = {
        "type": "PodScheduled",
        "status": "True",
        "lastTransitionTime": conditions.timestamp(T0 - timedelta(minutes=minutes)),
    }
    waiting = [{"name": "trainer", "state": {"waiting": {"reason": reason, "message": f"{reason}: bad"}}}]
    return _pod(0, "Pending", ready=False, conditions=[bound], containerStatuses=waiting)


@pytest.mark.parametrize(
    ("pod", "phase", "node", "admitted", "expected"),
    [
        (_pod(0), "Running", NODES["spot-1"], False, None),  # active
        (_exited(0, 137, "OOMKilled"), "Failed", NODES["spot-1"], False, ("failure", "OOMKilled", None, True)),
        (_exited(0, constants.NODE_FAULT_EXIT_CODE), "Failed", NODES["spot-1"], False,
         ("eviction", constants.NODE_FAULT_REASON, None, True)),
        (_pod(0), "Running", None, False, ("eviction", "NodeLost", 0, False)),  # its node is gone
        (_pod(0), "Running", _not_ready_since(60), True, ("eviction", "NodeNotReady", None, False)),
        (_pod(0), "Running", _not_ready_since(60), False, None),  # not admitted by the rate limit: waits
        (_pod(0), "Running", _not_ready_since(0), True, None),  # within the pod's grace
        (_waiting("InvalidImageName", 5), "Pending", NODES["spot-1"], False,
         ("failure", "InvalidImageName", None, False)),
        (_waiting("InvalidImageName", 1), "Pending", NODES["spot-1"], False, None),  # not for long enough yet
    ],
    ids=["active", "failed", "node-fault", "node-gone", "not-ready", "not-admitted", "in-grace", "stuck",
         "stuck-briefly"],
)  # fmt: skip
def test_one_pure_verdict_judges_each_live_pod_from_its_state_and_its_node(
    pod: dict[str, Any], phase: str, node: dict[str, Any] | None, admitted: bool,
    expected: tuple[str, str, int | None, bool] | None,
) -> None:  # fmt: skip
    loss = verdicts.judge(pod, phase, node, node_handling=True, policy=NodePolicy(grace_seconds=300),
                          admitted=admitted, now=T0)  # fmt: skip
    got = None if loss is None else (loss.verdict.kind, loss.verdict.reason, loss.grace, loss.keep)
    assert got == expected
    off = verdicts.judge(pod, phase, node, node_handling=False, policy=NodePolicy(), admitted=admitted, now=T0)
    if expected is not None and expected[1] in ("NodeLost", "NodeNotReady"):
        assert off is None  # node handling off: a node's state moves no pod


class TestReplicaGroups:
    """spec.replicaGroupSize 2, four pods: two groups, made, refilled and deleted whole."""

    GROUPED = _spec(minReplicas=2, maxReplicas=4, replicaGroupSize=2)

    @classmethod
    def _pod(cls, index: int, group: int, *, ready: bool = True) -> dict[str, Any]:
        pod = builders.worker_pod(JOB, cls.GROUPED, index, group=group)
        pod["metadata"]["uid"] = f"uid-{index}-{next(_uids)}"
        pod["spec"]["nodeName"] = "spot-1"
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        return pod

    @staticmethod
    def _groups(plan: reconcile.Plan) -> dict[str, str]:
        return {obj["metadata"]["name"]: obj["metadata"]["labels"][constants.LABEL_REPLICA_GROUP]
                for obj in plan.create if obj["kind"] == "Pod"}  # fmt: skip

    def test_each_pod_is_told_its_group_and_the_groups_size(self) -> None:
        plan = _plan([], old=_running(), spec=self.GROUPED)
        assert self._groups(plan) == {"cifar-worker-0": "0", "cifar-worker-1": "0", "cifar-worker-2": "1",
                                      "cifar-worker-3": "1"}  # fmt: skip
        env = {e["name"]: e.get("value") for e in plan.create[-1]["spec"]["containers"][0]["env"]}
        assert (env[REPLICA_GROUP_ENV], env[REPLICA_GROUP_SIZE_ENV]) == ("1", "2")
        # A group's pods prefer one zone, beside the job's own affinity (here: a node pool it requires).
        own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["h100"]}]}]}}}  # fmt: skip
        placed = builders.worker_pod(JOB, _spec(minReplicas=2, maxReplicas=4, replicaGroupSize=2,
                                                placement={"affinity": own}), 3, group=1)  # fmt: skip
        assert placed["spec"]["affinity"]["nodeAffinity"] == own["nodeAffinity"]
        (term,) = placed["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"] == {
            "labelSelector": {"matchLabels": {constants.LABEL_JOB: "cifar", constants.LABEL_REPLICA_GROUP: "1"}},
            "topologyKey": "topology.kubernetes.io/zone",
        }
        assert "podAffinity" not in own  # the job's spec is not changed under it
        alone = builders.worker_pod(JOB, _spec(), 3)  # groups of one: nothing said
        assert constants.LABEL_REPLICA_GROUP not in alone["metadata"]["labels"]
        assert "podAffinity" not in alone["spec"].get("affinity", {})
        assert REPLICA_GROUP_ENV not in {e["name"] for e in alone["spec"]["containers"][0]["env"]}

    def test_a_lost_pods_replacement_joins_its_group_under_a_free_name(self) -> None:
        pods = [self._pod(0, 0), self._pod(2, 1), self._pod(3, 1)]  # worker-1 lost, its name still held
        plan = _plan(pods, old=_running(), spec=self.GROUPED, names_in_use=frozenset({"cifar-worker-1"}))
        assert self._groups(plan) == {"cifar-worker-4": "0"}
        assert plan.status["replicaGroups"] == {"size": 2, "desired": 2, "ready": 1}

    def test_scaling_down_deletes_the_broken_group_whole_and_keeps_the_ready_one(self) -> None:
        pods = [self._pod(0, 0), self._pod(1, 0, ready=False), self._pod(2, 1), self._pod(3, 1)]
        down = replace(self.GROUPED, replicas=2)
        plan = _plan(pods, old=_running(), spec=down)
        assert sorted(name for name, _ in _deleted(plan)) == ["cifar-worker-0", "cifar-worker-1"]
        assert plan.create == []
        assert plan.status["replicaGroups"] == {"size": 2, "desired": 1, "ready": 1}

    def test_a_new_group_takes_the_lowest_number_free_and_the_lowest_free_names(self) -> None:
        pods = [self._pod(1, 1), self._pod(4, 1)]
        plan = _plan(pods, old=_running(), spec=self.GROUPED)
        assert self._groups(plan) == {"cifar-worker-0": "0", "cifar-worker-2": "0"}


class TestSuccess:
    def test_succeeded_at_once_with_a_pending_replacement_and_a_straggler(self) -> None:
        pods = [_exited(0, 0), _pod(1), _pending(2)]
        plan = _plan(pods, old=_running())
        assert plan.status["phase"] == "Succeeded"
        assert plan.status["completionTime"] == conditions.timestamp(T0)
        assert plan.create == []
        assert sorted(_deleted(plan)) == [("cifar-worker-1", None), ("cifar-worker-2", None)]  # with their grace
        # The etcd stays while the stopped workers leave its rendezvous; it goes once they are gone.
        assert {d.kind for d in plan.delete} == {"Pod"}
        leaving = _pod(1)
        leaving["metadata"]["deletionTimestamp"] = conditions.timestamp(T0)
        accounted = frozenset(plan.accounted)
        assert {d.kind for d in _plan([_exited(0, 0), leaving], old=plan.status, accounted=accounted).delete} == set()
        gone = _plan([_exited(0, 0)], old=plan.status, accounted=accounted)
        assert {d.kind for d in gone.delete} == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
        assert _condition(plan, "Succeeded")["status"] == "True"
        assert _condition(plan, "Running")["status"] == "False"
        assert "Succeeded" in _reasons(plan)

    def test_success_wins_over_a_failure_in_the_same_observation(self) -> None:
        plan = _plan(
            [_exited(0, 0), _exited(1, 1)], old=_running(failures=3), spec=_spec(failurePolicy={"maxRestarts": 3})
        )
        assert plan.status["phase"] == "Succeeded"

    def test_a_straggler_after_success_changes_nothing(self) -> None:
        done = _plan([_exited(0, 0), _pod(1)], old=_running()).status
        later = _plan([_exited(0, 0), _exited(1, 143)], old=done, spec=_spec(failurePolicy={"maxRestarts": 0}))
        assert later.status == done
        assert later.create == []
        assert _deleted(later) == []  # finished pods stay with cleanPodPolicy Running

    @pytest.mark.parametrize(
        ("policy", "want"),
        [
            ("All", ["cifar-worker-0", "cifar-worker-1", "cifar-worker-2"]),
            ("Running", ["cifar-worker-1", "cifar-worker-2"]),
            ("None", ["cifar-worker-2"]),  # pending ones always go: they would buy a spot VM for a finished job
        ],
    )
    def test_clean_pod_policy(self, policy: str, want: list[str]) -> None:
        plan = _plan([_exited(0, 0), _pod(1), _pending(2)], old=_running(), spec=_spec(cleanPodPolicy=policy))
        assert sorted(name for name, _ in _deleted(plan)) == want


class TestFailureRules:
    def test_oomkilled_counts_and_its_replacement_backs_off(self) -> None:
        plan = _plan([_exited(0, 137, "OOMKilled"), _pod(1), _pod(2)], old=_running())
        assert plan.status["failures"] == 1
        assert plan.status["evictions"] == 0
        assert plan.status["lastFailure"] == {
            "pod": "cifar-worker-0", "reason": "OOMKilled", "message": "out of memory (exit code 137)",
            "time": conditions.timestamp(T0),
        }  # fmt: skip
        assert plan.status["backoff"] == {
            "consecutiveFailures": 1, "until": conditions.timestamp(T0 + timedelta(seconds=10)), "replacements": 1,
        }  # fmt: skip
        assert _deleted(plan) == []  # kept for `kubectl logs`, marked as counted
        assert plan.keep == [reconcile.Keep("cifar-worker-0", plan.accounted[0], "failure: OOMKilled")]
        assert plan.create == []
        assert {"WorkerFailed", "BackOff"} <= set(_reasons(plan))
        assert "kubectl logs cifar-worker-0" in str(plan.events)

    def test_the_wait_doubles_with_consecutive_failures_and_resets_after_a_quiet_while(self) -> None:
        first = _plan([_exited(0, 1), _pod(1), _pod(2)], old=_running())
        later = T0 + timedelta(seconds=30)
        second = _plan([_exited(3, 1), _pod(1), _pod(2)], old=first.status, now=later)
        assert second.status["backoff"]["consecutiveFailures"] == 2
        assert second.status["backoff"]["until"] == conditions.timestamp(later + timedelta(seconds=20))
        quiet = T0 + timedelta(seconds=30 + constants.BACKOFF_RESET_SECONDS)
        third = _plan([_exited(4, 1), _pod(1), _pod(2)], old=second.status, now=quiet)
        assert third.status["backoff"]["consecutiveFailures"] == 1

    def test_the_replacement_comes_when_the_wait_is_over(self) -> None:
        failed = _plan([_exited(0, 1), _pod(1), _pod(2)], old=_running())
        waiting = _plan([_pod(1), _pod(2)], old=failed.status, now=T0 + timedelta(seconds=9))
        assert waiting.create == []
        assert not waiting.acts()
        done = _plan([_pod(1), _pod(2)], old=failed.status, now=T0 + timedelta(seconds=10))
        assert _created(done) == ["cifar-worker-0"]
        assert _reasons(done) == ["Replaced"]
        assert done.status["restarts"] == 1
        assert done.status["backoff"]["replacements"] == 0

    def test_a_wait_read_back_from_the_status_in_whole_seconds_is_never_shorter(self) -> None:
        failed_at = T0 + timedelta(seconds=0.9)
        failed = _plan([_exited(0, 1), _pod(1), _pod(2)], old=_running(), now=failed_at)
        early = _plan([_pod(1), _pod(2)], old=failed.status, now=failed_at + timedelta(seconds=9.95))
        assert early.create == []  # 10.0 s would have been the truncated `until`
        done = _plan([_pod(1), _pod(2)], old=failed.status, now=T0 + timedelta(seconds=11))
        assert _created(done) == ["cifar-worker-0"]

    def test_evictions_are_replaced_at_once_even_during_a_backoff(self) -> None:
        failed = _plan([_exited(0, 1), _pod(1), _pod(2)], old=_running())
        disrupted = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
        evicted = _pod(1, "Failed", reason="Evicted", conditions=disrupted)
        plan = _plan([evicted, _pod(2)], old=failed.status, now=T0 + timedelta(seconds=2))
        assert len(_created(plan)) == 1  # the evicted one's; the failed one's still waits
        assert plan.status["failures"] == 1
        assert plan.status["evictions"] == 1

    def test_an_admission_failure_counts_unless_it_is_the_nodes(self) -> None:
        refused = _pod(0, "Failed", reason="NodeAffinity", message="Predicate NodeAffinity failed")
        plan = _plan([refused, _pod(1), _pod(2)], old=_running())
        assert plan.status["failures"] == 1
        assert plan.status["lastFailure"]["reason"] == "NodeAffinity"
        fresh_vm = _pod(0, "Failed", reason="UnexpectedAdmissionError", message="Allocate failed due to no devices")
        plan = _plan([fresh_vm, _pod(1), _pod(2)], old=_running())
        assert (plan.status["failures"], plan.status["evictions"]) == (0, 1)  # not maxRestarts' business
        assert _created(plan) == ["cifar-worker-3"]

    def test_a_node_that_cannot_run_the_program_is_avoided_and_never_fails_the_job(self) -> None:
        """A worker whose GPU refused exits 75: an eviction (more such exits than maxRestarts fail
        nothing), said in a NodeFault Event, and every replacement avoids the node, on top of the
        template's own required node affinity. Before, each was a failure, its replacement landed on
        the same node (its GPUs were the free ones), and the fourth failed the job."""
        affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100", "a100"]}]},
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]},
        ]}}}  # fmt: skip
        spec = _spec(placement={"spot": True, "affinity": affinity})
        cluster = {f"spot-{n}": _node(f"spot-{n}") for n in range(100)}
        status = _running()
        for round_, node in enumerate(["spot-1", "spot-2", "spot-3", "spot-1", "spot-4"]):
            bad = _exited(0, constants.NODE_FAULT_EXIT_CODE, node=node)
            later = T0 + timedelta(seconds=round_ * (constants.EVICTION_WINDOW_SECONDS + 1))  # within the budget
            plan = _plan([bad, _pod(1), _pod(2)], old=status, spec=spec, now=later, nodes=cluster)
            status = plan.status
            assert plan.status["phase"] in ("Running", "Scaling")
            assert any(reason == "NodeFault" and node in message for _, reason, message in plan.events), plan.events
        assert (status["failures"], status["evictions"]) == (0, 5)
        assert status["avoidedNodes"] == ["spot-2", "spot-3", "spot-1", "spot-4"]  # once each, newest last
        (replacement,) = [obj for obj in plan.create if obj["kind"] == "Pod"]
        terms = replacement["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        avoid = {"key": "metadata.name", "operator": "NotIn", "values": ["spot-1", "spot-2", "spot-3", "spot-4"]}
        assert terms["nodeSelectorTerms"] == [
            {**term, "matchFields": [avoid]} for term in affinity["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        ]  # fmt: skip
        assert spec.placement.affinity == affinity  # the job's own is not changed
        quick = _running()  # node after node within minutes: more likely the job's (the eviction budget)
        for round_ in range(constants.EVICTION_REPEAT):
            bad = _exited(0, constants.NODE_FAULT_EXIT_CODE, node=f"spot-{round_}")
            plan = _plan([bad, _pod(1), _pod(2)], old=quick, now=T0 + timedelta(seconds=round_), nodes=cluster)
            quick = plan.status
        assert _condition(plan, "EvictionBudgetExceeded")["status"] == "True"
        many = {"avoidedNodes": [f"spot-{n}" for n in range(40)]}
        bad = _exited(0, constants.NODE_FAULT_EXIT_CODE, node="spot-99")
        plan = _plan([bad, _pod(1), _pod(2)], old=_running(**many), nodes=cluster)
        assert plan.status["avoidedNodes"] == [*many["avoidedNodes"][-constants.AVOIDED_NODES_KEPT + 1 :], "spot-99"]

    def test_a_limit_eviction_is_a_failure_with_backoff_not_a_free_eviction(self) -> None:
        said = 'Usage of EmptyDir volume "cache" exceeds the limit "2Gi".'
        status = _running()
        for round_ in range(3):  # the review's loop: evictions 1, 2, 3 and no backoff
            pods = [_pod(0, "Failed", reason="Evicted", message=said), _pod(1), _pod(2)]
            plan = _plan(pods, old=status, now=T0 + timedelta(seconds=round_))
            status = plan.status
        assert (status["evictions"], status["failures"]) == (0, 3)
        assert status["lastFailure"]["reason"] == "LimitEvicted"
        assert status["backoff"]["consecutiveFailures"] == 3
        assert plan.create == []  # the replacement waits

    def test_a_failed_pod_kept_for_its_logs_is_never_counted_again(self) -> None:
        first = _plan([_exited(0, 1), _pod(1), _pod(2)], old=_running())
        kept = _exited(0, 1, uid=first.accounted[0])
        kept["metadata"]["annotations"][constants.ANNOTATION_ACCOUNTED] = "failure: ExitCode"
        # Another operator process (no memory of what was counted) sees the mark.
        again = _plan([kept, _pod(1), _pod(2)], old=first.status, now=T0 + timedelta(seconds=20))
        assert again.status["failures"] == 1
        assert again.keep == []
        assert _created(again) == ["cifar-worker-3"]  # the kept pod holds its name

    def test_only_the_newest_failed_pods_are_kept(self) -> None:
        kept = []
        for index in range(constants.FAILED_PODS_KEPT + 2):
            pod = _exited(index, 1)
            pod["metadata"]["creationTimestamp"] = conditions.timestamp(T0 + timedelta(minutes=index))
            pod["metadata"]["annotations"][constants.ANNOTATION_ACCOUNTED] = "failure: ExitCode"
            kept.append(pod)
        plan = _plan([*kept, _pod(10)], old=_running(failures=7, failurePolicy={}),
                     spec=_spec(failurePolicy={"maxRestarts": 10}))  # fmt: skip
        assert sorted(_deleted(plan)) == [("cifar-worker-0", None), ("cifar-worker-1", None)]

    def test_a_permanent_waiting_reason_fails_the_pod_after_a_grace(self) -> None:
        waiting = {"reason": "CreateContainerConfigError", "message": 'secret "blob" not found'}
        scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": conditions.timestamp(T0)}
        stuck = _pod(0, "Pending", ready=False, conditions=[scheduled],
                     containerStatuses=[{"name": "trainer", "state": {"waiting": waiting}}])  # fmt: skip
        early = _plan([stuck, _pod(1), _pod(2)], old=_running(), now=T0 + timedelta(seconds=10))
        assert early.delete == []
        assert 'CreateContainerConfigError: secret "blob" not found' in _condition(early, "Scaling")["message"]
        late = _plan(
            [stuck, _pod(1), _pod(2)], old=_running(), now=T0 + timedelta(seconds=constants.PERMANENT_WAIT_SECONDS)
        )
        assert _deleted(late) == [("cifar-worker-0", None)]
        assert late.status["lastFailure"]["reason"] == "CreateContainerConfigError"
        pull = [{"name": "trainer", "state": {"waiting": {"reason": "ImagePullBackOff"}}}]
        pulling = _pod(0, "Pending", ready=False, conditions=[scheduled], containerStatuses=pull)
        assert _plan([pulling, _pod(1), _pod(2)], old=_running(), now=T0 + timedelta(hours=1)).delete == []

    def test_failures_beyond_max_restarts_fail_the_job_naming_the_last(self) -> None:
        plan = _plan([_exited(0, 137, "OOMKilled"), _pod(1), _pod(2)], old=_running(failures=3))
        assert plan.status["phase"] == "Failed"
        failed = _condition(plan, "Failed")
        assert failed["reason"] == "TooManyFailures"
        assert "4 worker failures exceed failurePolicy.maxRestarts 3" in failed["message"]
        assert "OOMKilled" in failed["message"]
        assert plan.create == []
        assert sorted(_deleted(plan)) == [("cifar-worker-1", None), ("cifar-worker-2", None)]


class TestEvictions:
    @pytest.mark.parametrize(
        ("node", "why"),
        [
            (_node(taints=[{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]), "taint"),
            (_node(taints=[{"key": "remediator.kubernetes.azure.com/unschedulable", "effect": "NoSchedule"}]), "taint"),
            ({**_node(), "metadata": {"name": "spot-1", "deletionTimestamp": "2026-11-22T12:00:00Z"}}, "deleted"),
        ],
    )
    def test_workers_on_a_bad_node_are_deleted_with_their_grace_period(self, node: dict[str, Any], why: str) -> None:
        plan = _plan([_pod(0, node="spot-1"), _pod(1, node="spot-2")], old=_running(),
                     nodes={"spot-1": node, "spot-2": _node("spot-2")})  # fmt: skip
        assert _deleted(plan) == [("cifar-worker-0", None)]
        assert why in plan.delete[0].why or why in str(plan.events)
        assert plan.status["evictions"] == 1
        assert plan.status["failures"] == 0

    def test_workers_on_a_vanished_node_are_deleted_at_once(self) -> None:
        plan = _plan([_pod(0, node="gone"), _pod(1), _pod(2)], old=_running())
        assert _deleted(plan) == [("cifar-worker-0", 0)]

    def test_with_node_handling_off_only_pods_count(self) -> None:
        pods = [_pod(0, node="spot-1"), _pod(1, node="spot-2"), _pod(2, node="gone")]
        plan = _plan(pods, old=_running(), nodes={"spot-1": _node(ready=False)}, node_handling=False)
        assert plan.delete == []
        assert plan.status["evictions"] == 0

    @pytest.mark.parametrize(
        "node",
        [
            _node(ready=False),  # a NotReady node, not yet past the grace, or not admitted
            _node(unschedulable=True),  # an admin's cordon: new scheduling stops, nothing more
            _node(taints=[{"key": "DeletionCandidateOfClusterAutoscaler", "effect": "PreferNoSchedule"}]),  # maybe
        ],
    )
    def test_soft_signals_do_not_move_a_worker_at_once(self, node: dict[str, Any]) -> None:
        both = {"spot-1": node, "spot-2": _node("spot-2")}
        pods = [_pod(0, node="spot-1"), _pod(1, node="spot-2")]
        plan = _plan(pods, old=_running(), nodes=both, admitted_nodes=frozenset({"spot-1"}))
        assert plan.delete == []
        assert plan.status["evictions"] == 0

    def test_a_not_ready_worker_leaves_after_its_toleration_once_admitted(self) -> None:
        since = conditions.timestamp(T0)
        node = _node(ready=False)
        node["status"]["conditions"][0]["lastTransitionTime"] = since
        pod = _pod(0, node="spot-1")
        both = {"spot-1": node, "spot-2": _node("spot-2")}
        pods = [pod, _pod(1, node="spot-2")]
        admitted = frozenset({"spot-1"})
        default = float(constants.DEFAULT_NOT_READY_TOLERATION_SECONDS)
        assert _plan(pods, old=_running(), nodes=both, admitted_nodes=admitted,
                     now=T0 + timedelta(seconds=default - 1)).delete == []  # fmt: skip
        due = _plan(pods, old=_running(), nodes=both, admitted_nodes=admitted, now=T0 + timedelta(seconds=default))
        assert _deleted(due) == [("cifar-worker-0", None)]
        assert due.status["evictions"] == 1
        assert _plan(pods, old=_running(), nodes=both, now=T0 + timedelta(seconds=default)).delete == []  # not admitted
        # The pod's own toleration of the taint says how long; the operator's setting overrides it.
        pod["spec"]["tolerations"] = [{"key": constants.NOT_READY_TAINT, "operator": "Exists", "effect": "NoExecute",
                                       "tolerationSeconds": 30}]  # fmt: skip
        assert _deleted(
            _plan(pods, old=_running(), nodes=both, admitted_nodes=admitted, now=T0 + timedelta(seconds=30))
        )
        policy = NodePolicy(grace_seconds=600)
        assert not _plan(pods, old=_running(), nodes=both, admitted_nodes=admitted, node_policy=policy,
                         now=T0 + timedelta(seconds=300)).delete  # fmt: skip
        # Cordon handling is opt-in; on, a cordoned node's worker leaves once admitted.
        cordoned = {"spot-1": _node(unschedulable=True), "spot-2": _node("spot-2")}
        on = NodePolicy(cordon=True)
        assert _deleted(_plan(pods, old=_running(), nodes=cordoned, admitted_nodes=admitted, node_policy=on))

    def test_a_pod_deleted_by_a_user_is_an_eviction_counted_once(self) -> None:
        leaving = _pod(0, uid="user-deleted")
        leaving["metadata"]["deletionTimestamp"] = conditions.timestamp(T0)
        plan = _plan([leaving, _pod(1), _pod(2)], old=_running())
        assert plan.status["evictions"] == 1
        assert plan.accounted == ["user-deleted"]
        assert plan.delete == []  # it is going already
        assert _created(plan) == ["cifar-worker-3"]  # at once, under a free name
        again = _plan([leaving, _pod(1), _pod(2), _pending(3)], old=plan.status, accounted=frozenset(plan.accounted))
        assert again.status["evictions"] == 1
        assert not again.acts()

    def test_a_pod_that_vanished_without_the_operator_is_an_eviction(self) -> None:
        gone = _pod(0, uid="vanished")
        plan = _plan([_pod(1), _pod(2)], old=_running(), vanished=[gone])
        assert plan.status["evictions"] == 1
        assert plan.accounted == ["vanished"]
        assert _created(plan) == ["cifar-worker-0"]
        assert _reasons(plan) == ["Evicted", "Replaced"]

    def test_a_worker_that_exits_0_while_being_stopped_is_not_a_success(self) -> None:
        wrapper = _exited(0, 0)
        wrapper["metadata"]["deletionTimestamp"] = conditions.timestamp(T0)
        plan = _plan([wrapper, _pod(1), _pod(2)], old=_running())
        assert plan.status["phase"] == "Scaling"  # not Succeeded: a replacement is on its way
        assert plan.status["evictions"] == 1
        drained = _exited(
            0, 0, conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
        )
        assert _plan([drained, _pod(1), _pod(2)], old=_running()).status["phase"] == "Scaling"

    def test_the_eviction_budget_backs_off_what_spot_does_not_explain(self) -> None:
        pressure = [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                     "message": "The node was low on resource: memory."}]  # fmt: skip
        status = _running()
        plans = []
        for round_ in range(constants.EVICTION_REPEAT):
            pods = [_pod(0, "Failed", reason="Evicted", conditions=pressure), _pod(1), _pod(2)]
            plans.append(_plan(pods, old=status, now=T0 + timedelta(seconds=round_)))
            status = plans[-1].status
        assert [len(_created(p)) for p in plans[:-1]] == [1, 1]  # replaced at once, within the budget
        assert _created(plans[-1]) == []  # the third in a row waits the failure backoff
        assert _condition(plans[-1], "EvictionBudgetExceeded")["status"] == "True"
        assert status["failures"] == 0  # still evictions: maxRestarts is not spent on them
        later = _plan(
            [_pod(1), _pod(2)], old=status, now=T0 + timedelta(seconds=constants.EVICTION_WINDOW_SECONDS + 10)
        )
        assert _condition(later, "EvictionBudgetExceeded")["status"] == "False"
        # Spot preemptions of different pods: many more before the budget (twice the desired workers, >= 6).
        spot = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
        status = _running()
        for round_ in range(constants.EVICTION_BUDGET):
            plan = _plan(
                [_pod(0, "Failed", conditions=spot), _pod(1), _pod(2)], old=status, now=T0 + timedelta(seconds=round_)
            )
            assert len(_created(plan)) == 1
            status = plan.status

    def test_pods_the_operator_deleted_are_not_judged_again(self) -> None:
        leaving = _pod(0, uid="ours")
        leaving["metadata"]["deletionTimestamp"] = conditions.timestamp(T0)
        plan = _plan([leaving, _pod(1), _pod(2)], old=_running(), accounted=frozenset({"ours"}))
        assert plan.status["evictions"] == 0


class TestClocks:
    def test_waiting_for_capacity_says_what_the_scheduler_says(self) -> None:
        plan = _plan([_pending(0), _pending(1), _pending(2)], old={"startTime": conditions.timestamp(T0)})
        waiting = _condition(plan, "WaitingForCapacity")
        assert waiting["status"] == "True"
        assert "0/3 nodes are available: 3 Insufficient nvidia.com/gpu." in waiting["message"]
        assert plan.status["phase"] == "Pending"
        assert _condition(plan, "BelowMin")["status"] == "False"  # never reached: not "below" it

    def test_the_start_up_timeout_is_its_own_budget(self) -> None:
        pods = [_pending(0), _pending(1), _pending(2)]
        spec = _spec(failurePolicy={"belowMinGraceSeconds": 60, "startupTimeoutSeconds": 900})
        old = {"startTime": conditions.timestamp(T0)}
        assert _plan(pods, old=old, spec=spec, now=T0 + timedelta(seconds=899)).status["phase"] == "Pending"
        late = _plan(pods, old=old, spec=spec, now=T0 + timedelta(seconds=901))
        assert late.status["phase"] == "Failed"
        assert _condition(late, "Failed")["reason"] == "StartupTimeout"

    def test_below_min_counts_from_the_last_time_at_min(self) -> None:
        spec = _spec(failurePolicy={"belowMinGraceSeconds": 60})
        running = _plan([_pod(0), _pod(1), _pod(2)], old=_running(), spec=spec)
        lost = T0 + timedelta(hours=3)  # long after the start: only the time below counts
        below = _plan([_pod(0, ready=False)], old=running.status, spec=spec, now=lost)
        assert below.status["phase"] == "BelowMin"
        assert below.status["belowMinSince"] == conditions.timestamp(lost)
        still = _plan([_pod(0, ready=False)], old=below.status, spec=spec, now=lost + timedelta(seconds=59))
        assert still.status["phase"] == "BelowMin"
        late = _plan([_pod(0, ready=False)], old=below.status, spec=spec, now=lost + timedelta(seconds=61))
        assert _condition(late, "Failed")["reason"] == "BelowMinTooLong"

    def test_active_deadline(self) -> None:
        spec = _spec(activeDeadlineSeconds=3600)
        old = _running(startTime=conditions.timestamp(T0))
        assert (
            _plan([_pod(0), _pod(1), _pod(2)], old=old, spec=spec, now=T0 + timedelta(seconds=3599)).status["phase"]
            == "Running"
        )
        late = _plan([_pod(0), _pod(1), _pod(2)], old=old, spec=spec, now=T0 + timedelta(seconds=3601))
        assert _condition(late, "Failed")["reason"] == "DeadlineExceeded"


class TestSuspend:
    def test_suspending_stops_the_workers_with_their_grace_and_the_etcd(self) -> None:
        plan = _plan([_pod(0), _pod(1), _pending(2)], old=_running(evictions=2), spec=_spec(suspend=True))
        assert plan.status["phase"] == "Suspended"
        assert sorted(_deleted(plan)) == [("cifar-worker-0", None), ("cifar-worker-1", None), ("cifar-worker-2", None)]
        assert {d.kind for d in plan.delete} == {"Pod"}  # the etcd goes once they have left it
        assert plan.create == []
        assert _condition(plan, "Suspended")["status"] == "True"
        assert plan.status["evictions"] == 2  # the record is kept
        assert (plan.status["startTime"], plan.status["reachedMinAt"]) == (None, None)  # clocks stop
        assert _reasons(plan) == ["Suspended"]
        gone = _plan([], old=plan.status, spec=_spec(suspend=True))
        assert {d.kind for d in gone.delete} == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}

    def test_a_job_created_suspended_creates_nothing(self) -> None:
        plan = _plan([], etcd={}, spec=_spec(suspend=True))
        assert plan.create == []
        assert plan.status["phase"] == "Suspended"
        assert conditions.find(plan.status["conditions"], "Created") is None

    def test_resuming_starts_a_fresh_run_and_fresh_clocks(self) -> None:
        suspended = _plan([], etcd={}, spec=_spec(suspend=True), old=_running(resumes=0)).status
        later = T0 + timedelta(hours=2)
        plan = _plan([], etcd={}, old=suspended, now=later)
        assert plan.status["resumes"] == 1
        assert plan.status["runId"] == "default-cifar-01234567-r1"
        assert plan.status["startTime"] == conditions.timestamp(later)
        assert plan.status["phase"] == "Pending"
        assert _condition(plan, "Suspended")["status"] == "False"
        pod = next(o for o in plan.create if o["kind"] == "Pod")
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["PET_RDZV_ID"] == "default-cifar-01234567-r1"
        assert "Resumed" in _reasons(plan)

    def test_time_suspended_does_not_count_against_the_deadline(self) -> None:
        spec = _spec(activeDeadlineSeconds=3600)
        suspended = _plan(
            [], etcd={}, spec=replace(spec, suspend=True), old=_running(startTime=conditions.timestamp(T0))
        )
        resumed = _plan([], old=suspended.status, spec=spec, now=T0 + timedelta(hours=5))
        assert resumed.status["phase"] != "Failed"


class TestManagedEtcd:
    def test_an_edit_of_the_image_updates_the_deployment_in_place(self) -> None:
        spec = _spec(rendezvous={"image": "quay.io/coreos/etcd:v3.5.21"})
        plan = _plan([_pod(0), _pod(1), _pod(2)], old=_running(), spec=spec)
        assert [(u.kind, u.name) for u in plan.update] == [("Deployment", "cifar-etcd")]
        patch = plan.update[0].patch
        assert patch["spec"]["template"]["spec"]["containers"][0]["image"] == "quay.io/coreos/etcd:v3.5.21"
        assert (
            patch["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH]
            == builders.etcd_objects(JOB, spec)[0]["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH]
        )
        assert plan.create == []

    def test_a_removed_node_selector_is_removed(self) -> None:
        placed = _spec(rendezvous={"nodeSelector": {"agentpool": "system"}})
        plan = _plan([_pod(0), _pod(1), _pod(2)], old=_running(), etcd=_etcd(placed))
        assert plan.update[0].patch["spec"]["template"]["spec"]["nodeSelector"] is None

    def test_a_taken_etcd_name_blocks_the_workers_and_is_retried_after_a_while(self) -> None:
        taken = CreateFailure("Service/cifar-etcd", conditions.NAME_TAKEN, "Service default/cifar-etcd exists", T0)
        etcd = {k: v for k, v in ALL_ETCD.items() if k != "Service"}
        soon = _plan([], old={"startTime": conditions.timestamp(T0)}, etcd=etcd, create_failures=[taken])
        assert soon.create == []  # not the Service again yet, and no worker that would reach the wrong one
        assert soon.status["phase"] == "Pending"
        assert _condition(soon, "ReplicaFailure")["reason"] == "NameTaken"
        assert "name is taken" in _condition(soon, "WaitingForCapacity")["message"]
        later = _plan([], old=soon.status, etcd=etcd, create_failures=[taken],
                      now=T0 + timedelta(seconds=constants.NAME_RETRY_SECONDS))  # fmt: skip
        assert _created(later, "Service") == ["cifar-etcd"]
        assert _created(later) == []

    def test_a_finished_job_deletes_only_the_etcd_objects_it_owns_by_uid(self) -> None:
        plan = _plan([_exited(0, 0)], old=_running())
        assert {(d.kind, d.uid) for d in plan.delete if d.kind != "Pod"} == {
            ("Deployment", "etcd-Deployment"), ("Service", "etcd-Service"),
            ("PodDisruptionBudget", "etcd-PodDisruptionBudget"), ("NetworkPolicy", "etcd-NetworkPolicy"),
        }  # fmt: skip


def test_milestones_from_etcd_land_in_the_status_and_survive_gaps() -> None:
    milestones = {"round": {"round": 4, "nodes": 3}, "checkpoint": {"step": 1200, "uri": "az://c/p/", "time": "t"},
                  "step": {"step": 1234}}  # fmt: skip
    spec = _spec(nprocPerNode=2)
    first = _plan([_pod(0), _pod(1), _pod(2)], old=_running(), milestones=milestones, spec=spec).status
    assert first["rendezvousRound"] == 4
    assert first["worldSize"] == 6  # (kubectl get ej's World: 3 nodes of 2 processes)
    assert first["progress"]["step"] == 1234  # (its Step)
    assert first["lastCheckpoint"] == {"step": 1200, "uri": "az://c/p/", "time": "t"}
    later = _plan([_pod(0), _pod(1), _pod(2)], old=first, spec=spec)  # etcd unreachable this time: nothing read
    assert later.status["rendezvousRound"] == 4
    assert later.status["worldSize"] == 6
    assert later.status["lastCheckpoint"]["step"] == 1200


def test_the_same_observation_gives_the_same_plan() -> None:
    pods = [_pod(0, uid="a"), _pod(1, "Failed", reason="Evicted", uid="b")]
    assert _plan(pods) == _plan(pods)


def test_deletes_carry_the_uid_precondition() -> None:
    assert delete_options(None, "u-1") == {
        "kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background", "preconditions": {"uid": "u-1"},
    }  # fmt: skip
    assert "preconditions" not in delete_options(0, None)


class TestNodes:
    def test_full_disruption_is_every_node_or_most_of_many(self) -> None:
        def fleet(bad: int, good: int) -> list[dict[str, Any]]:
            return [_node(f"b{i}", ready=False) for i in range(bad)] + [_node(f"g{i}") for i in range(good)]

        share = constants.FULL_DISRUPTION_SHARE
        assert nodes.full_disruption(fleet(1, 0), share)  # the only node: the control plane's view
        assert not nodes.full_disruption(fleet(1, 2), share)  # one frozen spot VM of three: act
        assert not nodes.full_disruption(fleet(2, 1), share)  # two is not "more than two"
        assert nodes.full_disruption(fleet(6, 4), share)
        assert not nodes.full_disruption(fleet(5, 5), share)
        assert not nodes.full_disruption([], share)

    def test_the_rate_limiter_admits_one_node_per_interval(self) -> None:
        clock = [0.0]
        limiter = nodes.RateLimiter(0.1, clock=lambda: clock[0])
        assert limiter.admit()
        assert not limiter.admit()
        clock[0] = 9.9
        assert not limiter.admit()
        clock[0] = 10.0
        assert limiter.admit()
        assert not nodes.RateLimiter(0.0).admit()  # rate 0: never


class TestStall:
    SPEC = _spec(failurePolicy={"stallTimeoutSeconds": 600})

    def _ready(
        self, now: datetime, old: Mapping[str, Any], milestones: Mapping[str, Any], **kwargs: Any
    ) -> reconcile.Plan:
        return _plan([_pod(0), _pod(1), _pod(2)], old=old, spec=self.SPEC, now=now, milestones=milestones, **kwargs)

    def test_workers_that_never_form_a_round_stall_then_fail(self) -> None:
        old = _running()  # minReplicas reached 5 minutes before T0, no round since
        reachable = {"reachable": True}
        assert conditions.find(self._ready(T0, old, reachable).status["conditions"], "Stalled") is None
        stalled = self._ready(T0 + timedelta(minutes=6), old, reachable)
        said = _condition(stalled, "Stalled")
        assert said["status"] == "True"
        assert "no rendezvous round formed" in said["message"]
        assert stalled.status["phase"] == "Running"
        failed = self._ready(T0 + timedelta(minutes=16), stalled.status, reachable)
        assert _condition(failed, "Failed")["reason"] == "Stalled"

    def test_progress_clears_it_and_the_cause_names_the_etcd_pod(self) -> None:
        old = _running()
        moving = self._ready(T0, old, {"reachable": True, "round": {"round": 1}, "step": {"step": 10}})
        assert moving.status["progress"]["at"] == conditions.timestamp(T0)
        later = T0 + timedelta(minutes=9)
        still = self._ready(later, moving.status, {"reachable": True, "round": {"round": 1}, "step": {"step": 900}})
        assert conditions.find(still.status["conditions"], "Stalled") is None
        assert still.status["progress"]["at"] == conditions.timestamp(later)
        # The etcd's image cannot be pulled (an egress firewall): the cause is the etcd pod's waiting reason.
        etcd = _etcd()
        etcd["Deployment"] = {**etcd["Deployment"], "status": {}}
        waiting = {"reason": "ImagePullBackOff", "message": "quay.io/coreos/etcd: i/o timeout"}
        pulling = {
            "metadata": {"name": "cifar-etcd-7d9"},
            "spec": {"nodeName": "sys-1", "containers": [{"name": "etcd"}]},
            "status": {"containerStatuses": [{"name": "etcd", "state": {"waiting": waiting}}]},
        }
        blocked = self._ready(later + timedelta(minutes=11), still.status, {"reachable": False}, etcd=etcd,
                              etcd_pods=[pulling])  # fmt: skip
        said = _condition(blocked, "Stalled")["message"]
        assert "the managed etcd is not serving: its pod cifar-etcd-7d9 is not running: ImagePullBackOff" in said
        # The operator cannot read a serving etcd: it says it cannot tell, and never fails the job on a guess.
        unsure = self._ready(later + timedelta(hours=5), still.status, {"reachable": False})
        assert "cannot tell" in _condition(unsure, "Stalled")["message"]
        assert unsure.status["phase"] == "Running"


def test_a_job_is_quiet_from_its_last_progress_or_its_minimum_whichever_came_later() -> None:
    """A round its workers formed before the last of them was ready is no quiet time (no job can train
    below its minimum): the stall clock starts at the later of the two."""
    before, reached = conditions.timestamp(T0 - timedelta(minutes=20)), conditions.timestamp(T0)
    assert lifecycle.quiet_from(before, reached) == reached
    assert lifecycle.quiet_from(conditions.timestamp(T0 + timedelta(minutes=1)), reached) != reached
    assert lifecycle.quiet_from(None, reached) == reached


def test_creates_go_in_slow_start_batches_of_pods_other_objects_alone() -> None:
    etcd = [{"kind": kind} for kind in ("Service", "Deployment")]
    pods = [{"kind": "Pod", "n": n} for n in range(10)]
    batches = slow_start([*etcd, *pods])
    assert [[o["kind"] for o in b] for b in batches[:2]] == [["Service"], ["Deployment"]]
    assert [len(b) for b in batches[2:]] == [1, 2, 4, 3]  # 1, 2, 4 ..., the last one what is left
    assert [o["n"] for b in batches[2:] for o in b] == list(range(10))  # in the plan's order
    assert [len(b) for b in slow_start([{"kind": "Pod"}] * 64)] == [1, 2, 4, 8, 16, 32, 1]
    assert slow_start([]) == []


def test_a_pod_the_status_names_as_counted_is_not_counted_again() -> None:
    """Another writer (a replica overlapping in a leader change) counted this eviction and wrote it; a plan
    from that status, whose own memory never saw it counted, counts it no second time."""
    disrupted = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    evicted = _pod(0, "Failed", ready=False, reason="Evicted", uid="evicted-0")
    evicted["status"]["conditions"].append(disrupted)
    running = [_pod(1), _pod(2)]
    first = _plan([evicted, *running], old={"evictions": 0})
    assert first.status["evictions"] == 1
    assert first.status["counted"] == ["evicted-0"]
    again = _plan([evicted, *running], old=first.status)
    assert again.status["evictions"] == 1  # not 2
    assert again.status["counted"] == ["evicted-0"]
    many = _plan(
        [evicted, *running], old={"evictions": 90, "counted": [f"old-{n}" for n in range(constants.COUNTED_KEPT)]}
    )
    assert many.status["evictions"] == 91
    assert len(many.status["counted"]) == constants.COUNTED_KEPT  # capped, the newest kept
    assert many.status["counted"][-1] == "evicted-0"
