"""An ElasticJob's spec, read and defaulted; what the CRD cannot check, checked here.

Every rule about a job lives in the CRD (manifests/crd.yaml, rendered from the chart):
types and ranges in its OpenAPI schema, the rest (the checkpoint URI's scheme, host:port,
`restartPolicy: Never`, the spot-pool bans, the name's length) as CEL rules, and the
fields that cannot change as transition rules. The API server applies them, so
`kubectl apply` refuses a bad job at once, and the operator never sees one.

What stays here:
- reading the spec into a typed `JobSpec` with the CRD's defaults (a test keeps the two
  equal), for objects stored before a default existed;
- a structural guard: a job stored under an older CRD, or by an API server that did not
  apply the schema, may still hold a wrong type; it is reported in the `InvalidSpec`
  condition, naming the field, instead of crashing the reconcile;
- what depends on the operator's own settings, which no CRD can see: the default
  placement of managed etcds (`default_etcd_placement`), checked when the operator starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchspot_operator import constants

PLACEMENT_KEYS = ("nodeSelector", "tolerations", "affinity")
"""The fields of a placement beyond spot/gpu: what a job's rendezvous or the operator's default may set."""


@dataclass(frozen=True)
class Placement:
    """Where pods go: the spot pool (toleration + selector), GPUs, and the user's own constraints."""

    spot: bool = True
    gpu: bool = True
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobSpec:
    """An ElasticJob spec with every default filled in (the CRD's defaults; see docs/operator.md)."""

    min_replicas: int
    max_replicas: int
    template: dict[str, Any]
    replicas: int | None = None
    nproc_per_node: int = 1
    replica_group_size: int = 1
    """Worker pods per replica group (HSDP's unit of failure): pods are made and deleted by whole groups."""
    suspend: bool = False
    """Stop the workers and the managed etcd, keep the job (Kubernetes Job's and Kueue's `suspend`)."""
    ttl_seconds_after_finished: int | None = None
    """Delete the job this long after it finished; None keeps it."""
    active_deadline_seconds: int | None = None
    """Fail the job once it was active this long since its start or last resume; None: no deadline."""
    rdzv_endpoint: str = ""
    """An external etcd (host:port); '' = the operator runs a managed one for the job."""
    etcd_image: str = constants.ETCD_IMAGE
    etcd_pull_secrets: tuple[str, ...] = ()
    """Image pull Secrets of the managed etcd's pods (the operator's setting, for the whole cluster)."""
    etcd_placement: Placement = field(default_factory=lambda: Placement(spot=False, gpu=False))
    heartbeat_seconds: int = 1
    placement: Placement = field(default_factory=Placement)
    checkpoint_uri: str = ""
    checkpoint_interval: int = 200
    checkpoint_keep: int = 3
    credentials_secret: str = ""
    below_min_grace_seconds: int = 600
    startup_timeout_seconds: int = 3600
    stall_timeout_seconds: int = constants.STALL_SECONDS
    """No new rendezvous round or checkpoint for this long while workers are ready: Stalled; as long
    again: Failed (lifecycle.py)."""
    max_restarts: int = 3
    termination_grace_seconds: int = 90
    clean_pod_policy: str = "Running"

    @property
    def desired(self) -> int:
        """Worker pods to keep: `replicas` (the scale subresource) or else `maxReplicas`."""
        return self.max_replicas if self.replicas is None else self.replicas

    @property
    def desired_groups(self) -> int:
        """Whole replica groups to keep (the CRD makes `desired` a multiple of the group size)."""
        return self.desired // self.replica_group_size


class InvalidSpecError(ValueError):
    """Every problem found in a spec, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class _Reader:
    """Reads typed fields out of a nested dict, collecting type problems instead of stopping at the first.

    Types only: ranges, enums and every other rule are the CRD's (see the module docstring).
    """

    def __init__(self) -> None:
        self.problems: list[str] = []

    def obj(self, parent: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
        value = parent.get(key, {})
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problems.append(f"{path}: must be an object, not {type(value).__name__}")
            return {}
        return value

    def int_(self, parent: Mapping[str, Any], key: str, path: str, default: int | None) -> int:
        value = parent.get(key, default)
        if value is None:
            self.problems.append(f"{path}: required")
            return 1
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{path}: must be an integer, not {value!r}")
            return 1
        return value

    def optional_int(self, parent: Mapping[str, Any], key: str, path: str) -> int | None:
        return None if parent.get(key) is None else self.int_(parent, key, path, None)

    def bool_(self, parent: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
        value = parent.get(key, default)
        if not isinstance(value, bool):
            self.problems.append(f"{path}: must be true or false, not {value!r}")
            return default
        return value

    def str_(self, parent: Mapping[str, Any], key: str, path: str, default: str = "") -> str:
        value = parent.get(key, default)
        if not isinstance(value, str):
            self.problems.append(f"{path}: must be a string, not {value!r}")
            return default
        return value

    def labels(self, parent: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
        value = self.obj(parent, key, path)
        bad = [k for k, v in value.items() if not isinstance(v, str)]
        if bad:
            self.problems.append(f"{path}: values must be strings ({', '.join(sorted(bad))})")
        return {k: v for k, v in value.items() if isinstance(v, str)}

    def list_of_objects(self, parent: Mapping[str, Any], key: str, path: str) -> list[dict[str, Any]]:
        value = parent.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            self.problems.append(f"{path}: must be a list of objects")
            return []
        return value

    def placement(self, parent: Mapping[str, Any], path: str, *, spot: bool, gpu: bool) -> Placement:
        return Placement(
            spot=self.bool_(parent, "spot", f"{path}.spot", spot) if spot else False,
            gpu=self.bool_(parent, "gpu", f"{path}.gpu", gpu) if gpu else False,
            node_selector=self.labels(parent, "nodeSelector", f"{path}.nodeSelector"),
            tolerations=self.list_of_objects(parent, "tolerations", f"{path}.tolerations"),
            affinity=self.obj(parent, "affinity", f"{path}.affinity"),
        )


def parse_spec(
    spec: Mapping[str, Any],
    *,
    etcd_default: Placement | None = None,
    etcd_image: str = constants.ETCD_IMAGE,
    etcd_pull_secrets: tuple[str, ...] = (),
) -> JobSpec:
    """The job's spec, defaulted; raises `InvalidSpecError` naming every field of a wrong type.

    :param etcd_default: the operator's placement for managed etcds (the chart's
        `etcd.defaultPlacement`), used when the job's rendezvous names no nodeSelector,
        tolerations or affinity of its own.
    :param etcd_image: the operator's managed etcd image (the chart's `etcd.image`), used when the
        job's rendezvous names none; `etcd_pull_secrets` go with it.
    """
    if not isinstance(spec, Mapping):
        raise InvalidSpecError(["spec: must be an object"])
    read = _Reader()
    rdzv = read.obj(spec, "rendezvous", "spec.rendezvous")
    etcd_placement = read.placement(rdzv, "spec.rendezvous", spot=False, gpu=False)
    if etcd_default is not None and not any(key in rdzv for key in PLACEMENT_KEYS):
        etcd_placement = etcd_default
    checkpoint = read.obj(spec, "checkpoint", "spec.checkpoint")
    failure = read.obj(spec, "failurePolicy", "spec.failurePolicy")
    template = read.obj(spec, "template", "spec.template")
    _check_template(template, read.problems)
    result = JobSpec(
        min_replicas=read.int_(spec, "minReplicas", "spec.minReplicas", None),
        max_replicas=read.int_(spec, "maxReplicas", "spec.maxReplicas", None),
        replicas=read.optional_int(spec, "replicas", "spec.replicas"),
        template=template,
        nproc_per_node=read.int_(spec, "nprocPerNode", "spec.nprocPerNode", 1),
        replica_group_size=max(1, read.int_(spec, "replicaGroupSize", "spec.replicaGroupSize", 1)),
        suspend=read.bool_(spec, "suspend", "spec.suspend", False),
        ttl_seconds_after_finished=read.optional_int(spec, "ttlSecondsAfterFinished", "spec.ttlSecondsAfterFinished"),
        active_deadline_seconds=read.optional_int(spec, "activeDeadlineSeconds", "spec.activeDeadlineSeconds"),
        rdzv_endpoint=read.str_(rdzv, "endpoint", "spec.rendezvous.endpoint"),
        etcd_image=read.str_(rdzv, "image", "spec.rendezvous.image", etcd_image) or etcd_image,
        etcd_pull_secrets=etcd_pull_secrets,
        etcd_placement=etcd_placement,
        heartbeat_seconds=read.int_(rdzv, "heartbeatSeconds", "spec.rendezvous.heartbeatSeconds", 1),
        placement=read.placement(read.obj(spec, "placement", "spec.placement"), "spec.placement", spot=True, gpu=True),
        checkpoint_uri=read.str_(checkpoint, "uri", "spec.checkpoint.uri"),
        checkpoint_interval=read.int_(checkpoint, "intervalSteps", "spec.checkpoint.intervalSteps", 200),
        checkpoint_keep=read.int_(checkpoint, "keep", "spec.checkpoint.keep", 3),
        credentials_secret=read.str_(checkpoint, "credentialsSecret", "spec.checkpoint.credentialsSecret"),
        below_min_grace_seconds=read.int_(
            failure, "belowMinGraceSeconds", "spec.failurePolicy.belowMinGraceSeconds", 600
        ),
        startup_timeout_seconds=read.int_(
            failure, "startupTimeoutSeconds", "spec.failurePolicy.startupTimeoutSeconds", 3600
        ),
        stall_timeout_seconds=read.int_(
            failure, "stallTimeoutSeconds", "spec.failurePolicy.stallTimeoutSeconds", constants.STALL_SECONDS
        ),
        max_restarts=read.int_(failure, "maxRestarts", "spec.failurePolicy.maxRestarts", 3),
        termination_grace_seconds=read.int_(
            spec, "terminationGracePeriodSeconds", "spec.terminationGracePeriodSeconds", 90
        ),
        clean_pod_policy=read.str_(spec, "cleanPodPolicy", "spec.cleanPodPolicy", "Running"),
    )
    if read.problems:
        raise InvalidSpecError(read.problems)
    return result


def _check_template(template: Mapping[str, Any], problems: list[str]) -> None:
    """The structure the worker pod builder relies on: a pod spec with a list of container objects."""
    pod = template.get("spec")
    if not isinstance(pod, dict):
        problems.append("spec.template.spec: required (the worker pod's spec)")
        return
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers or not all(isinstance(c, dict) for c in containers):
        problems.append("spec.template.spec.containers: at least one container object is required (the trainer)")


def _etcd_placement(read: _Reader, obj: Mapping[str, Any], path: str) -> Placement:
    """A managed etcd's placement: anywhere but the spot pool (an evicted rendezvous stops the job).

    The CRD says the same of a job's own `spec.rendezvous`; this is for the operator's default.
    """
    placement = read.placement(obj, path, spot=False, gpu=False)
    if placement.node_selector.get(constants.SPOT_LABEL) == constants.SPOT_VALUE:
        read.problems.append(f"{path}.nodeSelector: the managed etcd must not run on the spot pool")
    for toleration in placement.tolerations:
        key = toleration.get("key") or ""
        if key == constants.SPOT_LABEL or (not key and toleration.get("operator") == "Exists"):
            read.problems.append(f"{path}.tolerations: the managed etcd must not tolerate the spot taint")
            break
    return placement


def default_etcd_placement(raw: str) -> Placement | None:
    """The operator's default placement of managed etcds, from the JSON in `ETCD_PLACEMENT_ENV`.

    Checked like a job's own `spec.rendezvous` (which the CRD checks); None when unset or
    empty. Raises `InvalidSpecError` naming the variable, so a bad chart value stops the
    operator at start rather than misplacing every job's etcd.
    """
    name = constants.ETCD_PLACEMENT_ENV
    keys = ", ".join(PLACEMENT_KEYS)
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidSpecError([f"{name}: not JSON ({exc.msg} at character {exc.pos})"]) from exc
    if not isinstance(value, dict):
        raise InvalidSpecError([f"{name}: must be a JSON object with {keys}"])
    read = _Reader()
    unknown = sorted(set(value) - set(PLACEMENT_KEYS))
    if unknown:
        read.problems.append(f"{name}: unknown keys {', '.join(unknown)} (expected {keys})")
    placement = _etcd_placement(read, value, name)
    if read.problems:
        raise InvalidSpecError(read.problems)
    if not (placement.node_selector or placement.tolerations or placement.affinity):
        return None
    return placement
