"""Pod Security `restricted`: the checker's rules, and every pod the operator builds passes them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.cluster import Cluster
from tests.operator.jobs import good_job
from torchspot_lab.kubeapi.podsecurity import restricted_violations
from torchspot_operator import builders
from torchspot_operator.builders import JobRef
from torchspot_operator.kube import ApiError
from torchspot_operator.spec import parse_spec

JOB = JobRef("cifar", "default", "0123456789abcdef")
EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"

PASSING: dict[str, Any] = {
    "spec": {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "image": "x",
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }
        ],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
    }
}


def _broken(path: str, value: Any) -> dict[str, Any]:
    """The passing pod with one field (a dotted path under spec; `c.` is its container) set."""
    pod = copy.deepcopy(PASSING)
    node: Any = pod["spec"]
    parts = path.split(".")
    if parts[0] == "c":
        node, parts = node["containers"][0], parts[1:]
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    return pod


@pytest.mark.parametrize(
    ("path", "value", "rule"),
    [
        ("hostNetwork", True, "host namespaces"),
        ("c.securityContext.privileged", True, "privileged"),
        ("c.ports", [{"containerPort": 80, "hostPort": 80}], "hostPort"),
        ("volumes", [{"name": "h", "hostPath": {"path": "/"}}], "restricted volume types"),
        ("c.securityContext.allowPrivilegeEscalation", None, "allowPrivilegeEscalation != false"),
        ("securityContext.runAsNonRoot", None, "runAsNonRoot != true"),
        ("securityContext.runAsUser", 0, "runAsUser=0"),
        ("securityContext.seccompProfile", None, "seccompProfile"),
        ("securityContext.seccompProfile", {"type": "Unconfined"}, "seccompProfile"),
        ("c.securityContext.capabilities", {"drop": ["ALL"], "add": ["IPC_LOCK"]}, "capabilities"),
        ("c.securityContext.capabilities", None, "capabilities"),
        ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "forbidden sysctls"),
    ],
)
def test_each_rule_refuses_what_it_forbids(path: str, value: Any, rule: str) -> None:
    assert restricted_violations(PASSING) == []
    found = restricted_violations(_broken(path, value))
    assert len(found) == 1, found
    assert found[0].startswith(rule), found


def test_a_container_setting_wins_over_the_pods() -> None:
    pod = _broken("c.securityContext.runAsNonRoot", False)
    assert restricted_violations(pod) == ['runAsNonRoot != true (container "c")']
    pod = _broken("securityContext.seccompProfile", None)
    pod["spec"]["containers"][0]["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
    assert restricted_violations(pod) == []


def _template(spec: dict[str, Any]) -> dict[str, Any]:
    job = good_job()
    job["spec"]["template"] = {"spec": spec}
    return job


BARE = {"containers": [{"name": "trainer", "image": "trainer:1"}]}
"""A template that says nothing about security (what most users write)."""
WITH_INIT = {
    "initContainers": [{"name": "fetch", "image": "busybox"}],
    "containers": [{"name": "trainer", "image": "trainer:1", "securityContext": {"readOnlyRootFilesystem": True}}],
    "securityContext": {"runAsUser": 1000},
}


@pytest.mark.parametrize(
    "job",
    [
        good_job(),
        _template(BARE),
        _template(WITH_INIT),
        *(yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml")) if "ElasticJob" in p.read_text()),
    ],
    ids=["good-job", "bare-template", "init-container", "example-elasticjob", "example-imagenet"],
)
def test_every_pod_the_operator_builds_passes_restricted(job: dict[str, Any]) -> None:
    spec = parse_spec(job["spec"])
    worker = builders.worker_pod(JOB, spec, 0)
    assert restricted_violations(worker) == []
    etcd = builders.etcd_deployment(JOB, spec)["spec"]["template"]
    assert restricted_violations(etcd) == []


def test_the_users_explicit_settings_are_kept_even_when_restricted_forbids_them() -> None:
    """InfiniBand's IPC_LOCK, say: kept, so a namespace that enforces the profile refuses the pod and says why."""
    trainer = {"name": "trainer", "image": "t", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}
    worker = builders.worker_pod(JOB, parse_spec(_template({"containers": [trainer]})["spec"]), 0)
    security = worker["spec"]["containers"][0]["securityContext"]
    assert security["capabilities"] == {"add": ["IPC_LOCK"]}
    assert security["allowPrivilegeEscalation"] is False  # what the user left unset is still filled in
    assert restricted_violations(worker) == [
        'capabilities (drop must include ALL, add only NET_BIND_SERVICE) (container "trainer")'
    ]


def test_the_h100_profile_breaks_restricted_only_for_infinibands_memory_locking() -> None:
    """The H100 example (opt-in, in a namespace of its own) adds IPC_LOCK, which neither `restricted`
    nor `baseline` allows (docs/aks.md says so): nothing else in it asks for more."""
    job = yaml.safe_load((EXAMPLES / "h100" / "imagenet-resnet50.yaml").read_text())
    worker = builders.worker_pod(JOB, parse_spec(job["spec"]), 0)
    security = worker["spec"]["containers"][0]["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert restricted_violations(worker) == [
        'capabilities (drop must include ALL, add only NET_BIND_SERVICE) (container "trainer")'
    ]


def test_the_etcd_budget_allows_its_eviction() -> None:
    """A drain or an AKS upgrade evicts through budgets; the etcd's must allow one disruption of its one pod."""
    budget = builders.etcd_disruption_budget(JOB)["spec"]
    assert "minAvailable" not in budget
    assert budget["maxUnavailable"] == 1
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_emulator_enforces_restricted_where_a_namespace_says_so(api: Cluster) -> None:
    """What the operator's integration tests rely on: 403 for a bad pod in an enforcing namespace only,
    and a bad Deployment stored with the ReplicaFailure its ReplicaSet would report."""
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "strict", "labels": labels}})
    bad = _broken("securityContext.seccompProfile", None)
    pod = {"apiVersion": "v1", "kind": "Pod", **bad}
    with pytest.raises(ApiError) as refused:
        api.create({**pod, "metadata": {"name": "p", "namespace": "strict"}})
    assert refused.value.status == 403
    assert 'pods "p" is forbidden: violates PodSecurity "restricted:latest": seccompProfile' in str(refused.value)
    api.create({**pod, "metadata": {"name": "p", "namespace": "default"}})  # not enforced there

    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "strict"},
                  "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}}, "template": bad}}  # fmt: skip
    api.create(deployment)
    stored = api.api.run(api.kube.get("apps/v1", "Deployment", "strict", "d"))
    assert stored is not None
    (condition,) = stored["status"]["conditions"]
    assert (condition["type"], condition["reason"]) == ("ReplicaFailure", "FailedCreate")
    assert "violates PodSecurity" in condition["message"]
