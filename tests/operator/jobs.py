"""ElasticJob bodies for the operator's tests: one valid job and many ways to break it."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "manifests" / "crd.yaml"


def crd() -> dict[str, Any]:
    """The CRD as shipped: a copy of one parse per process (each operator test's API applies it, and
    PyYAML's pure-Python parser took 0.56 s of CPU a time on these cores: 3 minutes over the suite)."""
    return copy.deepcopy(_parsed_crd())


@functools.cache
def _parsed_crd() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.load(CRD_PATH.read_text(), Loader=yaml.CSafeLoader)
    return loaded


def good_job(name: str = "cifar", **spec: Any) -> dict[str, Any]:
    """A valid ElasticJob; keyword arguments replace top-level spec fields."""
    body: dict[str, Any] = {
        "apiVersion": "torchspot.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": 3,
            "nprocPerNode": 1,
            "checkpoint": {"uri": "az://checkpoints/cifar", "intervalSteps": 100},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "ghcr.io/torchspot/trainer:0.1.0",
                            "args": ["python", "-m", "torchspot_trainer", "--data", "/data/cifar"],
                        }
                    ]
                }
            },
        },
    }
    body["spec"].update(copy.deepcopy(spec))
    return body


def with_path(path: str, value: Any, name: str = "cifar", body: dict[str, Any] | None = None) -> dict[str, Any]:
    """A good job (or a copy of `body`) with one nested spec field set (dotted path; `[n]` indexes a list;
    `<del>` removes)."""
    body = good_job(name) if body is None else copy.deepcopy(body)
    node: Any = body["spec"]
    parts = path.split(".")
    for part in parts[:-1]:
        if part.endswith("]"):
            key, index = part[:-1].split("[")
            node = node[key][int(index)]
        else:
            node = node.setdefault(part, {})
    if value == "<del>":
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    return body


BAD = [
    # (case, body, the field the API server's message names, what it says): `kubectl apply` refuses each.
    ("min above max", with_path("minReplicas", 5), "spec.minReplicas", "minReplicas must not exceed maxReplicas"),
    ("min zero", with_path("minReplicas", 0), "spec.minReplicas", "less than the minimum"),
    ("max missing", with_path("maxReplicas", "<del>"), "spec", "'maxReplicas' is a required property"),
    ("min a string", with_path("minReplicas", "two"), "spec.minReplicas", "is not of type 'integer'"),
    ("replicas above max", with_path("replicas", 4), "spec.replicas", "replicas must lie between"),
    ("nproc zero", with_path("nprocPerNode", 0), "spec.nprocPerNode", "less than the minimum"),
    (
        "max not whole groups",
        good_job(minReplicas=2, maxReplicas=3, replicaGroupSize=2),
        "spec.minReplicas",
        "each must be a multiple of replicaGroupSize",
    ),
    (
        "replicas not whole groups",
        good_job(minReplicas=2, maxReplicas=4, replicas=3, replicaGroupSize=2),
        "spec.replicas",
        "replicas counts whole replica groups",
    ),
    ("group size zero", with_path("replicaGroupSize", 0), "spec.replicaGroupSize", "less than the minimum"),
    ("template missing", with_path("template", "<del>"), "spec", "'template' is a required property"),
    (
        "no containers",
        with_path("template.spec.containers", []),
        "spec.template.spec.containers",
        "should be non-empty",
    ),
    (
        "container without image",
        with_path("template.spec.containers[0].image", "<del>"),
        "spec.template.spec.containers.0",
        "'image' is a required property",
    ),
    # The template is checked against Kubernetes' PodSpec (tools/pod_schema.py), deep inside too.
    (
        "template grace a word",
        with_path("template.spec.terminationGracePeriodSeconds", "ninety"),
        "spec.template.spec.terminationGracePeriodSeconds",
        "is not of type 'integer'",
    ),
    (
        "env without a name",
        with_path("template.spec.containers[0].env", [{"value": "1"}]),
        "spec.template.spec.containers.0.env.0",
        "'name' is a required property",
    ),
    (
        "container port a word",
        with_path("template.spec.containers[0].ports", [{"containerPort": "http"}]),
        "spec.template.spec.containers.0.ports.0.containerPort",
        "is not of type 'integer'",
    ),
    (
        "toleration seconds a list",
        with_path("template.spec.tolerations", [{"key": "a", "tolerationSeconds": [1]}]),
        "spec.template.spec.tolerations.0.tolerationSeconds",
        "is not of type 'integer'",
    ),
    ("clean policy unknown", with_path("cleanPodPolicy", "Sometimes"), "spec.cleanPodPolicy", "is not one of"),
    (
        "interval zero",
        with_path("checkpoint.intervalSteps", 0),
        "spec.checkpoint.intervalSteps",
        "less than the minimum",
    ),
    ("grace too short", with_path("terminationGracePeriodSeconds", 5), "spec.terminationGracePeriodSeconds", "minimum"),
    (
        "negative grace below min",
        with_path("failurePolicy.belowMinGraceSeconds", -1),
        "spec.failurePolicy.belowMinGraceSeconds",
        "minimum",
    ),
    ("negative restarts", with_path("failurePolicy.maxRestarts", -2), "spec.failurePolicy.maxRestarts", "minimum"),
    (
        "start-up timeout zero",
        with_path("failurePolicy.startupTimeoutSeconds", 0),
        "spec.failurePolicy.startupTimeoutSeconds",
        "minimum",
    ),
    ("negative ttl", with_path("ttlSecondsAfterFinished", -1), "spec.ttlSecondsAfterFinished", "minimum"),
    ("deadline zero", with_path("activeDeadlineSeconds", 0), "spec.activeDeadlineSeconds", "minimum"),
    ("suspend not a bool", with_path("suspend", "yes"), "spec.suspend", "is not of type 'boolean'"),
    ("spot not a bool", with_path("placement.spot", "yes"), "spec.placement.spot", "is not of type 'boolean'"),
    (
        "heartbeat too long",
        with_path("rendezvous.heartbeatSeconds", 120),
        "spec.rendezvous.heartbeatSeconds",
        "maximum",
    ),
    (
        "node selector value not a string",
        with_path("placement.nodeSelector", {"pool": 3}),
        "spec.placement.nodeSelector.pool",
        "is not of type 'string'",
    ),
    ("keep zero", with_path("checkpoint.keep", 0), "spec.checkpoint.keep", "less than the minimum"),
    # Rules that need CEL (the operator checked these itself before they moved into the CRD):
    (
        "unknown checkpoint scheme",
        with_path("checkpoint.uri", "s3://bucket/run"),
        "spec.checkpoint.uri",
        "expected az://",
    ),
    ("relative checkpoint path", with_path("checkpoint.uri", "ckpt/run"), "spec.checkpoint.uri", "expected az://"),
    ("az uri without container", with_path("checkpoint.uri", "az:///run"), "spec.checkpoint.uri", "expected az://"),
    (
        "container name too long",
        with_path("checkpoint.uri", "az://" + "c" * 64 + "/run"),
        "spec.checkpoint.uri",
        "3-63",
    ),
    (
        "endpoint without port",
        with_path("rendezvous.endpoint", "etcd.example.com"),
        "spec.rendezvous.endpoint",
        "expected host:port",
    ),
    (
        "endpoint port out of range",
        with_path("rendezvous.endpoint", "etcd:99999"),
        "spec.rendezvous.endpoint",
        "expected host:port",
    ),
    (
        "endpoint with scheme",
        with_path("rendezvous.endpoint", "http://etcd:2379"),
        "spec.rendezvous.endpoint",
        "no scheme",
    ),
    (
        "restart policy Always",
        with_path("template.spec.restartPolicy", "Always"),
        "spec.template.spec.restartPolicy",
        "must be Never",
    ),
    (
        "etcd on the spot pool",
        with_path("rendezvous.nodeSelector", {"kubernetes.azure.com/scalesetpriority": "spot"}),
        "spec.rendezvous.nodeSelector",
        "must not run on the spot pool",
    ),
    (
        "etcd tolerates spot",
        with_path("rendezvous.tolerations", [{"key": "kubernetes.azure.com/scalesetpriority", "operator": "Exists"}]),
        "spec.rendezvous.tolerations",
        "must not tolerate the spot taint",
    ),
    (
        "etcd tolerates everything",
        with_path("rendezvous.tolerations", [{"operator": "Exists"}]),
        "spec.rendezvous.tolerations",
        "nor every taint",
    ),
    (
        "spot placement on the regular pool",
        with_path("placement.nodeSelector", {"kubernetes.azure.com/scalesetpriority": "regular"}),
        "spec.placement.nodeSelector",
        "must be spot when placement.spot is true",
    ),
    (
        "secret name with capitals",
        with_path("checkpoint.credentialsSecret", "Blob_Creds"),
        "spec.checkpoint.credentialsSecret",
        "must be a Secret's name",
    ),
    ("job name too long", good_job("x" * 60), "<root>", "metadata.name must be a DNS label"),
    ("job name with capitals", good_job("Cifar"), "<root>", "metadata.name must be a DNS label"),
]

IMMUTABLE = [
    # (spec field, new value, what the API server says): refused on an update, by transition rules.
    ("minReplicas", 2, "minReplicas and maxReplicas are immutable"),
    ("maxReplicas", 5, "minReplicas and maxReplicas are immutable"),
    ("nprocPerNode", 2, "nprocPerNode is immutable"),
    ("replicaGroupSize", 3, "replicaGroupSize is immutable"),
    ("rendezvous.endpoint", "etcd.shared:2379", "rendezvous.endpoint is immutable"),
    ("rendezvous.heartbeatSeconds", 5, "rendezvous.heartbeatSeconds is immutable"),
    ("checkpoint.uri", "az://checkpoints/other", "checkpoint.uri is immutable"),
    ("checkpoint.intervalSteps", 50, "checkpoint.intervalSteps is immutable"),
]

MUTABLE = [
    # (spec field, new value): accepted on an update (docs/operator.md says how each takes effect).
    ("replicas", 2),
    ("suspend", True),
    ("ttlSecondsAfterFinished", 600),
    ("activeDeadlineSeconds", 86400),
    ("rendezvous.image", "quay.io/coreos/etcd:v3.5.21"),
    ("rendezvous.nodeSelector", {"agentpool": "system"}),
    ("placement.nodeSelector", {"gpu-sku": "a100"}),
    ("template.spec.containers[0].image", "ghcr.io/torchspot/trainer:0.2.0"),
    ("checkpoint.keep", 5),
    ("checkpoint.credentialsSecret", "blob-rotated"),
    ("failurePolicy.maxRestarts", 10),
    ("terminationGracePeriodSeconds", 120),
    ("cleanPodPolicy", "All"),
]
