"""Names and numbers the operator shares with the CRD, the chart and the trainer: each lives here once."""

from __future__ import annotations

from typing import Final

from torchspot_trainer import ENV_PREFIX, NODE_FAULT_EXIT
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
ANNOTATION_INDEX: Final = f"{GROUP}/index"
"""A worker pod's number n (its name is `<job>-worker-<n>` too). An annotation, not a label: a label
unique to each pod makes one network security identity per pod on Cilium (which leaves Job's
completion index out of identities for that reason); labels stay job-scoped."""
LABEL_REPLICA_GROUP: Final = f"{GROUP}/replica-group"
"""A worker pod's replica group, where groups have more than one pod: a label, as the group's pods are
placed together by it (a preferred pod affinity); one network identity per group, not per pod, on Cilium."""
ZONE_LABEL: Final = "topology.kubernetes.io/zone"
"""The well-known label of a node's availability zone: a replica group's pods prefer one zone."""
ANNOTATION_ACCOUNTED: Final = f"{GROUP}/accounted"
"""On a failed worker pod the operator keeps (for `kubectl logs`): the verdict it was counted under,
so no operator process counts it again (the count lives in the status, the mark on the pod)."""
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGER: Final = "torchspot"
FIELD_MANAGER: Final = "torchspot-operator"
"""The operator's name in server-side apply (`metadata.managedFields`): the fields of the managed etcd's
objects it sets are its own, and an apply takes them back from whoever changed them."""
ROLE_WORKER: Final = "worker"
ROLE_ETCD: Final = "etcd"

SPOT_LABEL: Final = "kubernetes.azure.com/scalesetpriority"
"""AKS puts this label (value `spot`) and a NoSchedule taint with the same key on spot nodes."""
SPOT_VALUE: Final = "spot"
SPOT_TOLERATION: Final = {"key": SPOT_LABEL, "operator": "Equal", "value": SPOT_VALUE, "effect": "NoSchedule"}
GPU_RESOURCE: Final = "nvidia.com/gpu"

DRAIN_TAINTS: Final = frozenset(
    {
        "ToBeDeletedByClusterAutoscaler",
        "remediator.kubernetes.azure.com/unschedulable",
        "remediator.aks.microsoft.com/unschedulable",
        "node.cloudprovider.kubernetes.io/shutdown",
    }
)
"""Node taints that say for certain that the node's pods are about to go: the operator moves its
workers off such a node at once (with their grace period, so the emergency checkpoint is written).

- `ToBeDeletedByClusterAutoscaler`: the cluster autoscaler's hard taint on a node it is removing
  (kubernetes/autoscaler, cluster-autoscaler/utils/taints). Its soft `DeletionCandidateOfClusterAutoscaler`
  (PreferNoSchedule, "maybe unneeded") is not one: the node may well stay.
- `remediator.kubernetes.azure.com/unschedulable`: AKS node auto-drain's taint when a scheduled event
  (a spot *Preempt*, a Redeploy, a Terminate) is about to take the VM; it then cordons and drains the
  node (learn.microsoft.com/azure/aks/node-auto-drain). Older AKS documentation spells it
  `remediator.aks.microsoft.com/unschedulable`; both are listed.
- `node.cloudprovider.kubernetes.io/shutdown`: the cloud node lifecycle controller's taint on a node
  whose VM the cloud reports shut down.
The `kubernetes.azure.com/scalesetpriority-eviction` taint once listed here does not exist."""
NOT_READY_TAINT: Final = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT: Final = "node.kubernetes.io/unreachable"
"""The node lifecycle controller's NoExecute taints for Ready False and Ready Unknown: a pod's
tolerations of them (`tolerationSeconds`) say how long it may stay on such a node."""
DEFAULT_NOT_READY_TOLERATION_SECONDS: Final = 300
"""What the API server's DefaultTolerationSeconds admission plugin gives every pod for both taints:
the grace a NotReady node's workers get when their tolerations say nothing."""
FULL_DISRUPTION_SHARE: Final = 0.55
"""More than this share of the watched nodes NotReady (with more than two of them), or every one:
the operator moves no worker off a NotReady node. That many nodes failing at once is the control
plane's or the network's trouble, not theirs (the node lifecycle controller's
`--unhealthy-zone-threshold`, 0.55, and its full-disruption rule)."""
NODE_EVICTION_RATE: Final = 0.1
"""NotReady nodes per second whose workers the operator may move off, cluster-wide (the node
lifecycle controller's `--node-eviction-rate`, 0.1): a wave of NotReady nodes is acted on slowly
enough for the full-disruption guard to see it coming."""
ETCD_PLACEMENT_ENV: Final = "TORCHSPOT_ETCD_PLACEMENT"
"""The operator's environment variable with the default placement of managed etcds (JSON:
nodeSelector, tolerations, affinity); the chart sets it from `etcd.defaultPlacement`."""
NODE_HANDLING_ENV: Final = "TORCHSPOT_NODE_HANDLING"
"""The operator's environment variable that switches its node handling: `proactive` (the
default: a worker's node that turns bad has its pods deleted at once) or `off` (only pod
failures and deletions count, as with controllers that do not watch nodes; the goodput
benchmark runs the stock recipe so)."""
NODE_HANDLING_MODES: Final = ("proactive", "off")
ALL_NAMESPACES_ENV: Final = "TORCHSPOT_ALL_NAMESPACES"
"""Set to 1 by `python -m torchspot_operator --all-namespaces` (the chart's default): the operator's
own watches of pods and etcd objects (informer.py) are then one per kind, cluster-wide. Otherwise
(`--namespace`, or kopf started some other way) one per kind in each namespace that has a job."""
NODE_SELECTOR_ENV: Final = "TORCHSPOT_NODE_SELECTOR"
"""A label selector (`key=value`, `key!=value`, `key`, `!key`, `key in (a,b)`; comma-separated) for the nodes the
operator watches: the nodes job workers run on (AKS: `kubernetes.azure.com/scalesetpriority=spot`).
Unset: every node (each kept small: `nodes.project`). A worker on a node outside it is read by a
GET at most every `UNWATCHED_NODE_SECONDS`, and its node's faults are noticed at the job's events
and timer rather than at once."""
UNWATCHED_NODE_SECONDS: Final = 30.0
NODE_GRACE_ENV: Final = "TORCHSPOT_NODE_GRACE_SECONDS"
"""How long a worker may stay on a NotReady node before the operator moves it off (seconds).
Unset: each pod's own toleration of the not-ready or unreachable taint (300 s by default, as
the taint manager reads it)."""
CORDON_HANDLING_ENV: Final = "TORCHSPOT_CORDON_HANDLING"
"""`on`: a cordoned node's workers are moved off too (rate-limited as NotReady ones are). Off by
default: an admin's cordon stops new scheduling and nothing more."""
FULL_DISRUPTION_ENV: Final = "TORCHSPOT_FULL_DISRUPTION_SHARE"
"""Overrides `FULL_DISRUPTION_SHARE` (a number between 0 and 1)."""
NODE_EVICTION_RATE_ENV: Final = "TORCHSPOT_NODE_EVICTION_RATE"
"""Overrides `NODE_EVICTION_RATE` (NotReady nodes per second)."""
PEERING_API_VERSION: Final = "kopf.dev/v1"
PEERING_KIND: Final = "ClusterKopfPeering"
"""Where replicas of the operator find each other (kopf's peering): one cluster-scoped
object named by `--peering`, whether the operator watches all namespaces or some, so
replicas of one install always meet in the same place. The chart installs its CRD."""
PEERING_LIFETIME: Final = 60
"""Seconds a replica's peering record stays valid without a keep-alive (kopf's default). A
standby takes over this long after the active replica died without saying goodbye (a crashed
node); a clean exit hands over at once. Replicas refresh it every 5-10 s. Not shorter: kopf has
no fencing (a client-go Lease holder stops itself when it cannot renew; a kopf replica does
not), so a lifetime a slow keep-alive can outlast (a throttled PATCH during a mass event, a
re-login) lets the standby act while the leader still does. Losing the operator for a minute
costs little: torchrun re-forms the group without it, and only replacements wait."""
PEERING_LIFETIME_ENV: Final = "TORCHSPOT_PEERING_LIFETIME_SECONDS"
"""Overrides `PEERING_LIFETIME` (10 to 600 s; the tests shorten it)."""
PEERING_CHECK_SECONDS: Final = 10.0
"""How often a replica reads the peering object to know whether it is the active one (`standing`):
a paused standby then reports healthy and no job metrics."""
PRIORITY_HORIZON: Final = 4_102_444_800
"""2100-01-01 in Unix seconds: a replica's default priority counts down from it with its start time
(`__main__.start_priority`), so the oldest live replica leads and a new or restarted one never
takes over from a healthy leader."""
AGENT_MAX_RESTARTS: Final = 100
"""torchrun's `--max-restarts` in every worker pod: how often a failure of the program itself is
restarted within the pod before the pod fails and counts against the job's
failurePolicy.maxRestarts. A membership change (a peer evicted, frozen or added) costs no restart:
the survivors' workers fail before their agent sees the change, and torchspot-run gives that failure
back (handover.py's `_weigh_failure`); a worker that finds its node unable to run the program
(exit 75) is not restarted at all."""
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
OPERATOR_CA_SECRET_ENV: Final = "TORCHSPOT_OPERATOR_CA_SECRET"  # noqa: S105 (a variable name, not a secret)
"""The Secret in the operator's namespace (`OPERATOR_NAMESPACE_ENV`) that holds the operator's CA and
client pair (certs.py); made by the first replica that finds none. The chart names it after the release."""
OPERATOR_CA_SECRET: Final = "torchspot-operator-ca"  # noqa: S105 (a Secret object's name)
"""The operator pod's namespace and labels (JSON), which the chart sets: each job's NetworkPolicy
admits the operator (its milestone reader) to the etcd by them. Unset (an operator run outside the
cluster, which cannot reach a job's etcd anyway): only the job's workers are admitted."""
ETCD_GATEWAY_OFF: Final = "--enable-grpc-gateway=false"
"""A TLS etcd's flag: no JSON gateway. etcd's gateway dials the server's own gRPC presenting the server's
certificate as a client's, and ours has serverAuth only (certs.py: a server certificate opens no etcd as
a client), so under `--client-cert-auth` each dial was refused and both ends logged it ("incompatible key
usage", "bad certificate") every few seconds, as if TLS were broken. Every client of ours speaks gRPC,
and the kubelet's probes read the plain /health of `--listen-metrics-urls`."""
ETCD_IMAGE: Final = "quay.io/coreos/etcd:v3.5.17"
ETCD_IMAGE_ENV: Final = "TORCHSPOT_ETCD_IMAGE"
"""The operator's environment variable with the managed etcd's image for the whole cluster (the chart's
`etcd.image`); a job's `spec.rendezvous.image` still wins."""
ETCD_PULL_SECRETS_ENV: Final = "TORCHSPOT_ETCD_PULL_SECRETS"
"""Comma-separated image pull Secrets for the managed etcd's pods (the chart's `etcd.imagePullSecrets`),
each in the job's namespace."""
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
EXPECTATION_SECONDS: Final = 300
"""How long a pod the operator created counts as there before its watch event arrives (the
controller's expectations; client-go's `ExpectationsTimeout` is 5 minutes too): longer means the
watch lost it, and it is looked for afresh. Shorter made an extra pod under watch lag."""
COUNTED_KEPT: Final = 64
"""How many of the most recently counted pods' uids the status keeps (`status.counted`): two replicas
overlapping in a leader change, or a reconcile that must plan again after a conflicting write, then
count none twice. More than any one reconcile counts; the CRD caps the list at this."""
MILESTONE_READERS: Final = 8
"""Threads that read runs' milestones from their etcds (their own pool: a dead etcd's read blocks a
thread for its timeout, and a node lost with dozens of etcds on it must not hold up logins)."""
MILESTONE_READS_PER_SECOND: Final = 20.0
"""How many milestone reads the operator makes a second across all runs, at most (each run's own limit,
a quarter of its stallTimeoutSeconds, aside): a run is read at every timer tick while there are up to
100 runs, every 50 s at 1,000. The status's progress then lags that much; the stall rule's clocks are
minutes."""
MILESTONE_CHANNELS: Final = 64
"""How many runs' etcd clients stay open between reads (the least recently used is closed first). A
gRPC channel holds about 40 KiB of the process's memory connected (500 plain channels to one etcd:
+20 MiB) and 30 KiB while its name does not resolve (1,000: +30 MiB), a TLS one more: one per run,
as before, grows with the jobs without bound. A run read again after its client was closed opens a
new one: about 0.7 ms of CPU on these cores where a kept one reads in 0.12, plus the TLS handshake."""
NODE_LIST_WAIT_SECONDS: Final = 10.0
"""How long a reconcile waits for the node watch's first listing before it reads its workers' nodes itself
(8,000 GETs at a start of 1,000 jobs if it never waited)."""
FIRST_LISTING_WAIT_SECONDS: Final = 60.0
"""How long a job's check waits for the first listing of the operator's own watches (at a start, or in a
namespace's first job) before it lists the namespace itself: 8,000 AKS-sized pods take about 20 s to
list on a busy API, and a listing that fails is tried again by its watch."""
SNAPSHOT_SECONDS: Final = 10
"""How old a namespace's list of the jobs' objects may be and still serve a job's check (one taken before
the job's last create, or before the last relist, never does): the jobs that fall due together share it."""
REFUSAL_BACKOFF_BASE: Final = 5.0
REFUSAL_BACKOFF_CAP: Final = 600.0
"""After the API refuses a job's create (a quota, a policy webhook, Pod Security, a bad template),
the job's creates wait 5 s, doubling per refusal up to 10 minutes; a round of creates without a refusal
resets it (the workqueue's per-item exponential requeue). Worker pods go in slow-start batches of 1, 2,
4 ... (the ReplicaSet and Job controllers' slowStartBatch) and a refused batch ends the round, so a full
quota costs one refused request per wait."""
EVICTION_BUDGET: Final = 6
EVICTION_WINDOW_SECONDS: Final = 600
"""More than this many evictions of one job within this window, or `EVICTION_REPEAT` of the same
kind in a row, is no longer the cloud taking spot capacity but something about the job (its pods
evicted for memory pressure they cause, a node fault that follows it): further replacements wait
the failure backoff, and the EvictionBudgetExceeded condition says so."""
EVICTION_REPEAT: Final = 3
FAILED_PODS_KEPT: Final = 5
"""Failed worker pods kept per job (the newest), so `kubectl logs` can read a crashed or OOMKilled
worker, as Job, JobSet and Kubeflow keep theirs; older ones are deleted. All go with the job."""
PERMANENT_WAIT_SECONDS: Final = 120
"""A worker waiting with a reason that does not fix itself (a bad image name, a missing Secret or
ConfigMap, a root image under runAsNonRoot) this long is failed and replaced: it counts against
maxRestarts, so a broken template fails the job instead of waiting for ever."""
PERMANENT_WAIT_REASONS: Final = frozenset(
    {"InvalidImageName", "CreateContainerConfigError", "CreateContainerError", "ErrImageNeverPull"}
)
"""Container waiting reasons that retrying does not cure. ImagePullBackOff and ErrImagePull are not
among them (a registry blip, an egress rule being fixed); they are shown in the status."""
NODE_FAULT_REASONS: Final = ("UnexpectedAdmissionError", "OutOf")
"""A pod the kubelet refused for a reason that is the node's, not the job's: its device plugin not
registered yet on a fresh spot VM (`UnexpectedAdmissionError`, `OutOfnvidia.com/gpu`). An eviction,
subject to the eviction budget, not a failure."""
NODE_FAULT_EXIT_CODE: Final = NODE_FAULT_EXIT
"""The trainer container's exit code that says its node cannot run the program (the trainer's GPU
refused: an Xid, an ECC error, a lost device; torchspot_trainer's NODE_FAULT_EXIT): an eviction, not
a failure, and the job's replacements avoid that node (`AVOIDED_NODES_KEPT`)."""
NODE_FAULT_REASON: Final = "NodeFault"
"""The verdict's reason, and the Event's, for a worker that exited with NODE_FAULT_EXIT_CODE."""
AVOIDED_NODES_KEPT: Final = 16
"""Nodes a job's new workers avoid at most (`status.avoidedNodes`, the newest): each node a worker
found unable to run the program. A repaired node keeps its name, so the oldest are let go; spot VMs
come and go under new names anyway."""
STALL_SECONDS: Final = 900
"""No new rendezvous round and no new checkpoint for this long, while the job had workers ready and
had reported one before: the Stalled condition (the job's `failurePolicy.stallTimeoutSeconds`
overrides it; the job fails after it once more)."""
