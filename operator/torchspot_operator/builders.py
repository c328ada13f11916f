"""Pure builders: the objects an ElasticJob owns, as plain dicts. No I/O here.

Each takes the job's identity (`JobRef`) and its checked spec (`JobSpec`) and returns
what the API layer creates. Keeping them pure makes the placement rules (spot pool for
workers, never for etcd), the launcher's settings and the security defaults testable
one by one.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchspot_operator import certs, constants
from torchspot_operator.spec import JobSpec, Placement
from torchspot_trainer import REPLICA_GROUP_ENV, REPLICA_GROUP_SIZE_ENV


@dataclass(frozen=True)
class JobRef:
    """Who a job is: enough to name, label and own its objects."""

    name: str
    namespace: str
    uid: str
    resumes: int = 0
    """How often the job was resumed after a suspension (`status.resumes`)."""

    @property
    def run_id(self) -> str:
        """The rendezvous id of this incarnation and active period: a job deleted and re-created,
        or resumed after a suspension, gets a fresh one, so it never meets the old run's keys
        (the stale-state trap of reusing a rendezvous id) on an external etcd either."""
        base = f"{self.namespace}-{self.name}-{self.uid[:8]}"
        return f"{base}-r{self.resumes}" if self.resumes else base

    etcd_tls: bool = True
    """Whether the managed etcd speaks mutual TLS (False only for a job whose etcd was made before
    the operator did TLS: its running workers hold no certificate; a resume makes it TLS)."""
    operator: tuple[str, tuple[tuple[str, str], ...]] | None = None
    """The operator pod's namespace and labels, which the etcd's NetworkPolicy admits (None: unknown)."""

    @property
    def etcd_name(self) -> str:
        """The managed etcd's Deployment, Service, PodDisruptionBudget and NetworkPolicy."""
        return f"{self.name}-etcd"

    @property
    def tls_secret(self) -> str:
        """The Secret with the managed etcd's CA and certificates (see certs.py)."""
        return f"{self.name}-etcd-tls"

    def worker_name(self, index: int) -> str:
        """Worker pod n."""
        return f"{self.name}-worker-{index}"

    def owner_reference(self) -> dict[str, Any]:
        """Makes the job the controller of an object, so deleting the job deletes it."""
        return {
            "apiVersion": constants.API_VERSION,
            "kind": constants.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def labels(self, role: str) -> dict[str, str]:
        """The labels the operator finds its objects by."""
        return {
            constants.LABEL_JOB: self.name,
            constants.LABEL_ROLE: role,
            constants.LABEL_MANAGED_BY: constants.MANAGER,
        }

    def selector(self, role: str = constants.ROLE_WORKER) -> str:
        """A label selector string (the scale subresource's `status.selector`, list queries)."""
        return ",".join(f"{key}={value}" for key, value in self.labels(role).items())

    def metadata(self, name: str, role: str) -> dict[str, Any]:
        """Name, namespace, labels and owner of one object."""
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": self.labels(role),
            "ownerReferences": [self.owner_reference()],
        }


def rdzv_endpoint(job: JobRef, spec: JobSpec) -> str:
    """host:port of the job's etcd: the external one, or the managed one's Service."""
    return spec.rdzv_endpoint or f"{job.etcd_name}.{job.namespace}.svc:{constants.ETCD_PORT}"


def launcher_env(job: JobRef, spec: JobSpec) -> list[dict[str, Any]]:
    """The settings of torchspot-run and the trainer, as environment variables.

    torchrun reads PET_<FLAG> for each of its flags and the trainer TORCHSPOT_<FLAG>,
    so the user's command line stays as written and a flag given there still wins.
    The node's address is the pod IP: pod host names do not resolve in a cluster.
    """
    conf = f"keep_alive_interval={spec.heartbeat_seconds},keep_alive_max_attempt=3"
    if _managed_tls(job, spec):
        files = {"cacert": certs.CA_FILE, "cert": certs.CLIENT_CERT_FILE, "key": certs.CLIENT_KEY_FILE}
        conf += "".join(f",{key}={constants.WORKER_TLS_DIR}/{name}" for key, name in files.items())
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "PET_LOCAL_ADDR", "value": "$(POD_IP)"},
        {"name": "PET_NNODES", "value": f"{spec.min_replicas}:{spec.max_replicas}"},
        {"name": "PET_NPROC_PER_NODE", "value": str(spec.nproc_per_node)},
        {"name": "PET_MAX_RESTARTS", "value": str(constants.AGENT_MAX_RESTARTS)},
        {"name": "PET_RDZV_BACKEND", "value": constants.RDZV_BACKEND},
        {"name": "PET_RDZV_ENDPOINT", "value": rdzv_endpoint(job, spec)},
        {"name": "PET_RDZV_ID", "value": job.run_id},
        {"name": "PET_RDZV_CONF", "value": conf},
    ]
    prefix = constants.TRAINER_ENV_PREFIX
    if spec.checkpoint_uri:
        env += [
            {"name": f"{prefix}CHECKPOINT_URI", "value": spec.checkpoint_uri},
            {"name": f"{prefix}CHECKPOINT_EVERY", "value": str(spec.checkpoint_interval)},
            {"name": f"{prefix}KEEP_CHECKPOINTS", "value": str(spec.checkpoint_keep)},
        ]
    return env


def _managed_tls(job: JobRef, spec: JobSpec) -> bool:
    """Whether the job's pods reach a managed etcd over mutual TLS."""
    return job.etcd_tls and not spec.rdzv_endpoint


def _secret_volume(job: JobRef, files: tuple[str, ...], mode: int) -> dict[str, Any]:
    items = [{"key": name, "path": name} for name in files]
    return {"name": "etcd-tls", "secret": {"secretName": job.tls_secret, "items": items, "defaultMode": mode}}


def _place(pod_spec: dict[str, Any], placement: Placement) -> None:
    """Merge a placement into a pod spec: user selectors and tolerations, plus the spot pool's."""
    selector = {**pod_spec.get("nodeSelector", {}), **placement.node_selector}
    tolerations = [*pod_spec.get("tolerations", []), *placement.tolerations]
    if placement.spot:
        selector[constants.SPOT_LABEL] = constants.SPOT_VALUE
        if constants.SPOT_TOLERATION not in tolerations:
            tolerations.append(dict(constants.SPOT_TOLERATION))
    if selector:
        pod_spec["nodeSelector"] = selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if placement.affinity:
        pod_spec["affinity"] = placement.affinity


def _avoid(pod_spec: dict[str, Any], nodes: Sequence[str]) -> None:
    """Keep the pod off `nodes` (nodes a worker of the job found unable to run the program: reconcile.py's
    `avoided_nodes`): a required node affinity on the node names, added to each term of the pod's own
    required node affinity (its terms are alternatives: each must now exclude them too)."""
    if not nodes:
        return
    excluded = {"key": "metadata.name", "operator": "NotIn", "values": sorted(set(nodes))}
    affinity = copy.deepcopy(pod_spec.get("affinity") or {})  # the placement's own may be shared
    required = affinity.setdefault("nodeAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchFields": [*term.get("matchFields", []), excluded]} for term in terms
    ]
    pod_spec["affinity"] = affinity


def _join_group(meta: dict[str, Any], pod_spec: dict[str, Any], job: JobRef, size: int, group: int) -> None:
    """A worker pod of replica group `group` (of `size` pods): its label, its trainer told the group and
    its size, and a preference for the zone of the group's other pods (a preferred pod affinity, beside
    the pod's own affinity): a group's shards are gathered and reduced within it at every step, which a
    zone's links carry faster and more cheaply than links across zones. Preferred, not required: a group
    whose zone has no spot capacity left still forms elsewhere."""
    meta["labels"][constants.LABEL_REPLICA_GROUP] = str(group)
    trainer = pod_spec["containers"][0]
    trainer["env"] += [
        {"name": REPLICA_GROUP_ENV, "value": str(group)},
        {"name": REPLICA_GROUP_SIZE_ENV, "value": str(size)},
    ]
    members = {constants.LABEL_JOB: job.name, constants.LABEL_REPLICA_GROUP: str(group)}
    together = {
        "weight": 100,
        "podAffinityTerm": {"labelSelector": {"matchLabels": members}, "topologyKey": constants.ZONE_LABEL},
    }
    affinity = copy.deepcopy(pod_spec.get("affinity") or {})  # the placement's own may be shared
    preferred = affinity.setdefault("podAffinity", {}).setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
    preferred.append(together)
    pod_spec["affinity"] = affinity


def restricted_defaults(pod_spec: dict[str, Any]) -> None:
    """Fill in what Pod Security's `restricted` profile requires and the user left unset.

    A namespace labelled `pod-security.kubernetes.io/enforce: restricted` (what a shared
    cluster's platform team sets) refuses any pod without these, and a training process
    needs none of what they forbid: the pod runs as non-root under the runtime's default
    seccomp profile, and every container (init containers too) without privilege
    escalation and with no Linux capabilities. A value the user set explicitly is kept,
    even one the profile forbids (InfiniBand's IPC_LOCK, say): in a namespace that
    enforces the profile such a pod is refused, and the job's status says why.
    """
    pod_security = pod_spec.setdefault("securityContext", {})
    pod_security.setdefault("runAsNonRoot", True)
    pod_security.setdefault("seccompProfile", {"type": "RuntimeDefault"})
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key) or []:
            security = container.setdefault("securityContext", {})
            security.setdefault("allowPrivilegeEscalation", False)
            security.setdefault("capabilities", {"drop": ["ALL"]})


SHM_FALLBACK_SIZE = "16Gi"
"""The shared-memory volume's size for a trainer container that states no memory limit or request."""


def _shared_memory(pod_spec: dict[str, Any], trainer: dict[str, Any]) -> None:
    """Mount a memory-backed emptyDir at /dev/shm, unless the template mounts something there.

    Data-loader workers pass batches through shared memory, and the runtime's 64 MiB default
    fails a loader of ImageNet batches with "No space left on device" (or a bus error). The
    volume is sized: its pages count against the container's memory, so it gets the
    container's memory limit (else its request, else `SHM_FALLBACK_SIZE`). Unsized, it could
    grow to the node's memory and get the pod evicted under node memory pressure, a disruption
    the job itself caused; sized, overfilling it is a limit eviction, which counts as a failure.
    """
    if any(m.get("mountPath") == constants.SHM_DIR for m in trainer.get("volumeMounts", [])):
        return
    resources = trainer.get("resources") or {}
    size = (resources.get("limits") or {}).get("memory") or (resources.get("requests") or {}).get("memory")
    volume = {"name": "torchspot-shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(size or SHM_FALLBACK_SIZE)}}
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), volume]
    trainer["volumeMounts"] = [
        *trainer.get("volumeMounts", []),
        {"name": "torchspot-shm", "mountPath": constants.SHM_DIR},
    ]


def worker_pod(
    job: JobRef, spec: JobSpec, index: int, *, avoid: Sequence[str] = (), group: int | None = None
) -> dict[str, Any]:
    """Worker pod n: the user's template, placed on the spot pool (off the nodes in `avoid`), with the
    launcher's settings; where replica groups have more than one pod, its `group` (default its index's:
    replica_groups.py)."""
    template = copy.deepcopy(spec.template)
    pod_spec: dict[str, Any] = template["spec"]
    meta = job.metadata(job.worker_name(index), constants.ROLE_WORKER)
    meta["labels"] = {**template.get("metadata", {}).get("labels", {}), **meta["labels"]}
    meta["annotations"] = {
        **(template.get("metadata", {}).get("annotations") or {}),
        constants.ANNOTATION_INDEX: str(index),
    }
    pod_spec["restartPolicy"] = "Never"
    pod_spec["terminationGracePeriodSeconds"] = spec.termination_grace_seconds
    restricted_defaults(pod_spec)
    _place(pod_spec, spec.placement)
    _avoid(pod_spec, avoid)
    trainer = pod_spec["containers"][0]
    trainer["env"] = [*trainer.get("env", []), *launcher_env(job, spec)]
    if spec.replica_group_size > 1:
        _join_group(
            meta, pod_spec, job, spec.replica_group_size, index // spec.replica_group_size if group is None else group
        )
    if spec.credentials_secret:
        trainer["envFrom"] = [*trainer.get("envFrom", []), {"secretRef": {"name": spec.credentials_secret}}]
    if _managed_tls(job, spec):  # the client side only, never the server's key; 0444: the trainer's uid is the user's
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), _secret_volume(job, certs.CLIENT_FILES, 0o444)]
        mount = {"name": "etcd-tls", "mountPath": constants.WORKER_TLS_DIR, "readOnly": True}
        trainer["volumeMounts"] = [*trainer.get("volumeMounts", []), mount]
    _shared_memory(pod_spec, trainer)
    if spec.placement.gpu:
        resources = trainer.setdefault("resources", {})
        for kind in ("limits", "requests"):
            resources.setdefault(kind, {})[constants.GPU_RESOURCE] = spec.nproc_per_node
        device = f"{constants.TRAINER_ENV_PREFIX}DEVICE"
        if not any(item.get("name") == device for item in trainer["env"]):  # the user's own setting stays
            # A GPU job's workers require CUDA: a node whose GPU or driver failed stops its worker with a
            # message naming it, where `--device auto` made it a gloo rank that hangs the NCCL group.
            trainer["env"].append({"name": device, "value": "cuda"})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


ETCD_SIZING: tuple[str, ...] = (
    "--auto-compaction-mode=periodic",
    "--auto-compaction-retention=5m",
    "--snapshot-count=10000",
    "--max-wals=2",
    "--max-snapshots=2",
    "--quota-backend-bytes=67108864",
)
"""The managed etcd's size limits, sized by a soak of a day of an 8-node job's heartbeats
(691,200 state writes) with membership changes. History is
compacted every 5 minutes (the rendezvous reads only the latest revision), so the backend
stayed under 10 MiB (etcd's defaults: 1.1 GiB); a snapshot every 10,000 writes and at most
2 kept WAL files bound the WAL at four 61 MiB segments, the live one and the preallocated
next included (defaults: 427 MiB and growing with the snapshot interval); the 64 MiB
backend quota stops a runaway writer long before the volume fills. Peak data directory:
254 MiB (defaults: 1.5 GiB); resident memory 86 MiB (defaults: 663 MiB)."""
ETCD_DATA_LIMIT = "384Mi"
"""The etcd's memory-backed data volume: the soak's 254 MiB peak plus half again. The kubelet
evicts a pod whose emptyDir exceeds its limit; the old 256Mi with etcd's default WAL
retention would have been exceeded within hours."""
ETCD_MEMORY = {"requests": {"cpu": "100m", "memory": "320Mi"}, "limits": {"memory": "512Mi"}}
"""A memory-backed volume counts against the container's memory: the data (up to 254 MiB)
plus etcd itself (86 MiB at peak) is what is requested; the limit leaves room above it."""


def etcd_deployment(job: JobRef, spec: JobSpec) -> dict[str, Any]:
    """One etcd for the job's rendezvous, on the on-demand pool, non-root, data in memory.

    The rendezvous state is small and short-lived (a run's keys expire with their
    lease); when the pod moves and comes back empty, the agents of the running round write
    it back (the trainer's rounds.py, `restored`), so nothing re-forms and no training is
    lost. A volume that survives the move would cost more at each move (a zonal disk's
    detach and attach while no join can be served) than the loss it saves: an emptyDir in
    memory, and no volume to provision or clean up (docs/operator.md, "Drains and upgrades")."""
    scheme = "https" if job.etcd_tls else "http"
    url = f"{scheme}://{job.etcd_name}.{job.namespace}.svc:{constants.ETCD_PORT}"
    command = [
        "etcd",
        "--name=etcd",
        "--data-dir=/var/lib/etcd/data",
        f"--listen-client-urls={scheme}://0.0.0.0:{constants.ETCD_PORT}",
        f"--advertise-client-urls={url}",
        "--listen-peer-urls=http://127.0.0.1:2380",
        f"--listen-metrics-urls=http://0.0.0.0:{constants.ETCD_HEALTH_PORT}",
        *ETCD_SIZING,
    ]
    mounts: list[dict[str, Any]] = [{"name": "data", "mountPath": "/var/lib/etcd"}]
    volumes: list[dict[str, Any]] = [{"name": "data", "emptyDir": {"medium": "Memory", "sizeLimit": ETCD_DATA_LIMIT}}]
    if job.etcd_tls:
        tls = constants.ETCD_TLS_DIR
        command += [
            "--client-cert-auth",
            constants.ETCD_GATEWAY_OFF,
            f"--trusted-ca-file={tls}/{certs.CA_FILE}",
            f"--cert-file={tls}/{certs.SERVER_CERT_FILE}",
            f"--key-file={tls}/{certs.SERVER_KEY_FILE}",
        ]
        mounts.append({"name": "etcd-tls", "mountPath": tls, "readOnly": True})
        volumes.append(_secret_volume(job, certs.SERVER_FILES, 0o440))  # group: the pod's fsGroup
    health = {"path": "/health", "port": constants.ETCD_HEALTH_PORT}
    pod_spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "etcd",
                "image": spec.etcd_image,
                "command": command,
                "ports": [
                    {"name": "client", "containerPort": constants.ETCD_PORT},
                    {"name": "health", "containerPort": constants.ETCD_HEALTH_PORT},
                ],
                "readinessProbe": {"httpGet": health, "periodSeconds": 2},
                "livenessProbe": {"httpGet": health, "periodSeconds": 10, "failureThreshold": 6},
                "resources": copy.deepcopy(ETCD_MEMORY),
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if spec.etcd_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec.etcd_pull_secrets]
    _place(pod_spec, spec.etcd_placement)
    labels = job.labels(constants.ROLE_ETCD)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": job.metadata(job.etcd_name, constants.ROLE_ETCD),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def etcd_service(job: JobRef) -> dict[str, Any]:
    """The name workers reach the managed etcd by."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": job.metadata(job.etcd_name, constants.ROLE_ETCD),
        "spec": {
            "selector": job.labels(constants.ROLE_ETCD),
            "ports": [{"name": "client", "port": constants.ETCD_PORT, "targetPort": constants.ETCD_PORT}],
        },
    }


def etcd_disruption_budget(job: JobRef) -> dict[str, Any]:
    """A budget that lets a drain evict the managed etcd, one pod at a time.

    A node drain, an AKS node-image upgrade or the cluster autoscaler's scale-down all
    evict through the Eviction API, which honours budgets: `minAvailable: 1` on a
    Deployment of one allows zero disruptions, and every drain of the pool the etcd
    runs on would hang for as long as any job runs. An evicted etcd comes back empty on
    another node (its data is in memory): training goes on, since workers do not talk
    to etcd, and the next membership change starts a fresh round
    (tests/trainer/test_elastic.py runs both an etcd restart and a data loss under a
    running job). That is far cheaper than a blocked upgrade. `maxUnavailable: 1` says
    so explicitly, and `AlwaysAllow` lets an etcd that is not ready be evicted too.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": job.metadata(job.etcd_name, constants.ROLE_ETCD),
        "spec": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": job.labels(constants.ROLE_ETCD)},
        },
    }


def etcd_network_policy(job: JobRef) -> dict[str, Any]:
    """Only the job's own worker pods, and the operator, may open a connection to its etcd.

    The etcd's state is what torch's rendezvous unpickles in every agent, and the workers
    hold the job's Blob credentials: a pod that could write it could run code there. The
    certificates (mutual TLS) are the lock; this policy keeps everyone else from even
    reaching the port, where the cluster's network plugin enforces policies (AKS: Azure
    NPM, Calico or Cilium). The health port is left to the kubelet's probes, which come
    from the node.
    """
    workers: dict[str, Any] = {"podSelector": {"matchLabels": job.labels(constants.ROLE_WORKER)}}
    sources = [workers]
    if job.operator is not None:
        namespace, labels = job.operator
        sources.append({
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "podSelector": {"matchLabels": dict(labels)},
        })  # fmt: skip
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": job.metadata(job.etcd_name, constants.ROLE_ETCD),
        "spec": {
            "podSelector": {"matchLabels": job.labels(constants.ROLE_ETCD)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": sources, "ports": [{"protocol": "TCP", "port": constants.ETCD_PORT}]}],
        },
    }


def etcd_secret(job: JobRef, bundle: certs.EtcdCertificates) -> dict[str, Any]:
    """The Secret holding the job's etcd certificates, owned by the job (deleted with it). Immutable: its
    certificates never change for the job's life, and the kubelet then watches none of the mounts."""
    data = {name: base64.b64encode(value).decode() for name, value in certs.secret_files(bundle).items()}
    meta = job.metadata(job.tls_secret, constants.ROLE_ETCD)
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "immutable": True, "data": data}


def operator_ca_secret(namespace: str, name: str, bundle: certs.OperatorCertificates) -> dict[str, Any]:
    """The Secret in the operator's own namespace that holds its CA and client pair (only the operator's
    namespaced Role may read it). Immutable: replicas and restarts must agree on one CA."""
    data = {file: base64.b64encode(value).decode() for file, value in certs.operator_files(bundle).items()}
    labels = {"app.kubernetes.io/managed-by": "torchspot", constants.LABEL_ROLE: "operator-ca"}
    meta = {"name": name, "namespace": namespace, "labels": labels}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "immutable": True, "data": data}


def spec_hash(obj: Mapping[str, Any]) -> str:
    """A short hash of what the operator built (`constants.ANNOTATION_SPEC_HASH` holds it)."""
    built = {key: value for key, value in obj.items() if key != "metadata"}
    built["labels"] = obj.get("metadata", {}).get("labels", {})
    return hashlib.sha256(json.dumps(built, sort_keys=True).encode()).hexdigest()[:16]


def _hashed(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].setdefault("annotations", {})[constants.ANNOTATION_SPEC_HASH] = spec_hash(obj)
    return obj


def etcd_objects(job: JobRef, spec: JobSpec) -> list[dict[str, Any]]:
    """The managed etcd's objects, each carrying the hash of what was built (for updates in place)."""
    made = [etcd_deployment(job, spec), etcd_service(job), etcd_disruption_budget(job), etcd_network_policy(job)]
    return [_hashed(obj) for obj in made]


def covers(actual: Any, desired: Any) -> bool:
    """Whether an object as stored holds every field the operator sets, with the value it sets (what it
    does not set, such as the API server's defaults and a Service's cluster IPs, may be anything).
    Lists match item by item; metadata other than labels, annotations and ownerReferences is the
    API server's."""
    if isinstance(desired, Mapping):
        if not isinstance(actual, Mapping):
            return False
        keys = set(desired.keys())
        if "apiVersion" in desired and "metadata" in desired:  # the object itself
            mine = ("labels", "annotations", "ownerReferences")
            meta = {k: v for k, v in desired["metadata"].items() if k in mine}
            if not covers(actual.get("metadata") or {}, meta):
                return False
            keys -= {"metadata", "status"}
        return all(key in actual and covers(actual[key], desired[key]) for key in keys)
    if isinstance(desired, list):
        return isinstance(actual, list) and len(actual) == len(desired) and all(map(covers, actual, desired))
    return bool(actual == desired)


def update_patch(actual: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that brings a managed etcd object the operator made in line with `desired`.

    The spec is diffed against the object as stored (`merge_patch`), so fields the edit
    removed go; a Service keeps what the API server allocated (its cluster IPs), only its
    ports and selector are ours. The new hash comes with it.
    """
    annotations = {constants.ANNOTATION_SPEC_HASH: desired["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH]}
    if desired["kind"] == "Service":
        spec: Any = {"ports": desired["spec"]["ports"], "selector": desired["spec"]["selector"]}
    else:
        spec = merge_patch(actual.get("spec") or {}, desired["spec"])
    return {"metadata": {"labels": desired["metadata"]["labels"], "annotations": annotations}, "spec": spec}


def peering(name: str) -> dict[str, Any]:
    """The peering object replicas of the operator share (kopf keeps their records in its status).

    The operator creates it when it starts with `--peering NAME`, so no install step has to
    create an instance of a CRD it installs in the same go (Helm cannot).
    """
    return {
        "apiVersion": constants.PEERING_API_VERSION,
        "kind": constants.PEERING_KIND,
        "metadata": {"name": name, "labels": {constants.LABEL_MANAGED_BY: constants.MANAGER}},
    }


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: changed keys, and null for removed ones.

    A merge patch of the whole desired value would leave behind every key the desired
    value dropped (a node selector removed by an edit, say); this one removes them.
    Lists are replaced whole, as merge patches do.
    """
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch
