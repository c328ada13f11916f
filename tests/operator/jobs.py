"""ElasticJob bodies for the operator's tests: one valid job and many ways to break it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "manifests" / "crd.yaml"


def crd() -> dict[str, Any]:
    """The CRD as shipped."""
    loaded: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
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
                            "args": ["python", "-m", "torchspot.trainer", "--data", "/data/cifar"],
                        }
                    ]
                }
            },
        },
    }
    body["spec"].update(copy.deepcopy(spec))
    return body


def with_path(path: str, value: Any, name: str = "cifar") -> dict[str, Any]:
    """A good job with one nested spec field set (dotted path; `[n]` indexes a list; `<del>` removes)."""
    body = good_job(name)
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


BAD_FOR_SCHEMA = [
    # (case, body, what the schema says, the field the operator's message names): the operator rejects each too.
    ("min above max", with_path("minReplicas", 5), "minReplicas must not exceed maxReplicas", "spec.minReplicas"),
    ("min zero", with_path("minReplicas", 0), "minReplicas", "spec.minReplicas"),
    ("max missing", with_path("maxReplicas", "<del>"), "maxReplicas", "spec.maxReplicas"),
    ("min a string", with_path("minReplicas", "two"), "minReplicas", "spec.minReplicas"),
    ("replicas above max", with_path("replicas", 4), "replicas must lie between", "spec.replicas"),
    ("nproc zero", with_path("nprocPerNode", 0), "nprocPerNode", "spec.nprocPerNode"),
    ("template missing", with_path("template", "<del>"), "template", "spec.template.spec"),
    ("no containers", with_path("template.spec.containers", []), "containers", "spec.template.spec.containers"),
    (
        "container without image",
        with_path("template.spec.containers[0].image", "<del>"),
        "image",
        "spec.template.spec.containers[0].image",
    ),
    ("clean policy unknown", with_path("cleanPodPolicy", "Sometimes"), "cleanPodPolicy", "spec.cleanPodPolicy"),
    ("interval zero", with_path("checkpoint.intervalSteps", 0), "intervalSteps", "spec.checkpoint.intervalSteps"),
    (
        "grace too short",
        with_path("terminationGracePeriodSeconds", 5),
        "terminationGracePeriodSeconds",
        "spec.terminationGracePeriodSeconds",
    ),
    (
        "negative grace below min",
        with_path("failurePolicy.belowMinGraceSeconds", -1),
        "belowMinGraceSeconds",
        "spec.failurePolicy.belowMinGraceSeconds",
    ),
    ("negative restarts", with_path("failurePolicy.maxRestarts", -2), "maxRestarts", "spec.failurePolicy.maxRestarts"),
    ("spot not a bool", with_path("placement.spot", "yes"), "spot", "spec.placement.spot"),
    (
        "heartbeat too long",
        with_path("rendezvous.heartbeatSeconds", 120),
        "heartbeatSeconds",
        "spec.rendezvous.heartbeatSeconds",
    ),
    (
        "node selector value not a string",
        with_path("placement.nodeSelector", {"pool": 3}),
        "nodeSelector",
        "spec.placement.nodeSelector",
    ),
    ("keep zero", with_path("checkpoint.keep", 0), "keep", "spec.checkpoint.keep"),
]

BAD_FOR_OPERATOR_ONLY = [
    # (case, body, the field the InvalidSpec message must name): valid for the schema, not runnable.
    ("unknown checkpoint scheme", with_path("checkpoint.uri", "s3://bucket/run"), "spec.checkpoint.uri"),
    ("relative checkpoint path", with_path("checkpoint.uri", "ckpt/run"), "spec.checkpoint.uri"),
    ("az uri without container", with_path("checkpoint.uri", "az:///run"), "spec.checkpoint.uri"),
    ("endpoint without port", with_path("rendezvous.endpoint", "etcd.example.com"), "spec.rendezvous.endpoint"),
    ("endpoint port out of range", with_path("rendezvous.endpoint", "etcd:99999"), "spec.rendezvous.endpoint"),
    ("endpoint with scheme", with_path("rendezvous.endpoint", "http://etcd:2379"), "spec.rendezvous.endpoint"),
    ("restart policy Always", with_path("template.spec.restartPolicy", "Always"), "spec.template.spec.restartPolicy"),
    (
        "etcd on the spot pool",
        with_path("rendezvous.nodeSelector", {"kubernetes.azure.com/scalesetpriority": "spot"}),
        "spec.rendezvous.nodeSelector",
    ),
    (
        "spot placement on the regular pool",
        with_path("placement.nodeSelector", {"kubernetes.azure.com/scalesetpriority": "regular"}),
        "spec.placement.nodeSelector",
    ),
    ("secret name with capitals", with_path("checkpoint.credentialsSecret", "Blob_Creds"), "credentialsSecret"),
    ("job name too long", good_job("x" * 60), "metadata.name"),
    (
        "etcd tolerates spot",
        with_path("rendezvous.tolerations", [{"key": "kubernetes.azure.com/scalesetpriority", "operator": "Exists"}]),
        "spec.rendezvous.tolerations",
    ),
]
