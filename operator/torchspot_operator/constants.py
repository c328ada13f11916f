"""Names and numbers the operator shares with the CRD, the chart and the trainer: each lives here once."""

from __future__ import annotations

from typing import Final

from torchspot_trainer import ENV_PREFIX
from torchspot_trainer.rendezvous.settings import BACKEND_NAME

GROUP: Final = "torchspot.dev"
VERSION: Final = "v1alpha1"
PLURAL: Final = "elasticjobs"
KIND: Final = "ElasticJob"
API_VERSION: Final = f"{GROUP}/{VERSION}"

LABEL_JOB: Final = f"{GROUP}/job"
"""On every object the operator makes for a job: the job's name (pods are found by it)."""
LABEL_ROLE: Final = f"{GROUP}/role"
"""`worker` or `etcd`."""
LABEL_INDEX: Final = f"{GROUP}/index"
"""A worker pod's number n (its name is `<job>-worker-<n>`)."""
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGER: Final = "torchspot"
ROLE_WORKER: Final = "worker"
ROLE_ETCD: Final = "etcd"

SPOT_LABEL: Final = "kubernetes.azure.com/scalesetpriority"
"""AKS puts this label (value `spot`) and a NoSchedule taint with the same key on spot nodes."""
SPOT_VALUE: Final = "spot"
SPOT_TOLERATION: Final = {"key": SPOT_LABEL, "operator": "Equal", "value": SPOT_VALUE, "effect": "NoSchedule"}
GPU_RESOURCE: Final = "nvidia.com/gpu"

EVICTION_TAINTS: Final = frozenset(
    {
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/unschedulable",
        "ToBeDeletedByClusterAutoscaler",
        "DeletionCandidateOfClusterAutoscaler",
        "kubernetes.azure.com/scalesetpriority-eviction",
    }
)
"""Node taints that mean the node's pods are about to go (the autoscaler's and AKS's
spot-eviction taints among them): the operator deletes its workers there at once, so the
survivors re-form without waiting for heartbeats or timeouts."""

ETCD_PLACEMENT_ENV: Final = "TORCHSPOT_ETCD_PLACEMENT"
"""The operator's environment variable with the default placement of managed etcds (JSON:
nodeSelector, tolerations, affinity); the chart sets it from `etcd.defaultPlacement`."""
NODE_HANDLING_ENV: Final = "TORCHSPOT_NODE_HANDLING"
"""The operator's environment variable that switches its node handling: `proactive` (the
default: a worker's node that turns bad has its pods deleted at once) or `off` (only pod
failures and deletions count, as with controllers that do not watch nodes; the goodput
benchmark runs the stock recipe so)."""
NODE_HANDLING_MODES: Final = ("proactive", "off")
PEERING_API_VERSION: Final = "kopf.dev/v1"
PEERING_KIND: Final = "ClusterKopfPeering"
"""Where replicas of the operator find each other (kopf's peering): one cluster-scoped
object named by `--peering`, whether the operator watches all namespaces or some, so
replicas of one install always meet in the same place. The chart installs its CRD."""
PEERING_LIFETIME: Final = 15
"""Seconds a replica's peering record stays valid without a keep-alive (kopf's default: 60).
A standby takes over this long after the active replica died without saying goodbye (a
crashed node); a clean exit hands over at once. Replicas refresh it every 5-10 s."""
AGENT_MAX_RESTARTS: Final = 100
"""torchrun's `--max-restarts` in every worker pod. Each membership change (a peer evicted,
frozen or added) fails the survivors' collectives and costs each surviving agent one
restart of its workers; with torchrun's default of 0 the survivors of the first eviction
would give up and be counted as application failures (the lab's sandbox showed it). A
crash of the training code itself repeats within the pod until this budget is spent,
then the pod fails and counts against the job's failurePolicy.maxRestarts."""
ETCD_PORT: Final = 2379
ETCD_HEALTH_PORT: Final = 2381
"""The managed etcd's plain-HTTP /health (`--listen-metrics-urls`) for the kubelet's probes: its
client port demands a client certificate, which probes cannot present. No NetworkPolicy rule
admits other pods to it."""
ETCD_TLS_DIR: Final = "/etc/etcd/tls"
"""Where the managed etcd's pod mounts its server certificate, key and the job's CA."""
WORKER_TLS_DIR: Final = "/etc/torchspot/etcd"
"""Where a worker pod mounts the job's CA and client certificate and key."""
SHM_DIR: Final = "/dev/shm"  # noqa: S108 - a mount path in the pod, not a file we write
"""Where DataLoader workers hand batches to the trainer (shared memory). A container runtime
gives a pod 64 MiB there; one uint8 ImageNet batch of 256 is 37 MiB, and each loader worker
keeps several in flight."""
OPERATOR_NAMESPACE_ENV: Final = "TORCHSPOT_OPERATOR_NAMESPACE"
OPERATOR_LABELS_ENV: Final = "TORCHSPOT_OPERATOR_LABELS"
"""The operator pod's namespace and labels (JSON), which the chart sets: each job's NetworkPolicy
admits the operator (its milestone reader) to the etcd by them. Unset (an operator run outside the
cluster, which cannot reach a job's etcd anyway): only the job's workers are admitted."""
ETCD_IMAGE: Final = "quay.io/coreos/etcd:v3.5.17"
RDZV_BACKEND: Final = BACKEND_NAME
TRAINER_ENV_PREFIX: Final = ENV_PREFIX

MAX_JOB_NAME: Final = 50
"""Longest job name: `<job>-worker-<n>` and `<job>-etcd` must stay valid DNS-1035 labels (63)."""

ANNOTATION_SPEC_HASH: Final = f"{GROUP}/spec-hash"
"""On each managed etcd object: a hash of what the operator built. A job edit that changes the
built object (the rendezvous image or placement) changes the hash, and the operator updates the
object in place; comparing whole objects would not do, as the API server adds its defaults."""

BACKOFF_BASE_SECONDS: Final = 10
"""The first replacement after a worker failure waits this long; each further consecutive failure
doubles it (as Kubernetes Job's pod failure backoff does). Evictions never wait."""
BACKOFF_CAP_SECONDS: Final = 300
"""The longest a replacement waits after consecutive failures (kubelet's crash-loop cap)."""
BACKOFF_RESET_SECONDS: Final = 600
"""A failure this long after the previous one starts the count of consecutive failures afresh
(kubelet forgets a crash loop after 10 minutes of running)."""
NAME_RETRY_SECONDS: Final = 60
"""How long the operator leaves a name alone once it found it taken by an object the job does not
own: it tries again after this (the owner may have deleted it), at most once a minute."""
STALE_AFTER_SECONDS: Final = 20
"""A job the operator has not looked at for this long while its timer should have run (every few
seconds) was not looked at because the operator was paused (a standby) or stalled: its watches were
closed meanwhile and the indices may still hold objects deleted then. The next reconcile reads the
job's pods and etcd objects from the API once (as on the first reconcile of a job by this process)."""
EXPECTATION_SECONDS: Final = 30
"""How long a pod the operator created counts as there before its watch event arrives (the
controller's expectations): longer means the watch lost it, and it is looked for afresh."""
