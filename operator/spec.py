"""An ElasticJob's spec, checked and defaulted: what the CRD schema cannot say, said here.

The API server applies the CRD's schema (types, minimums, enums, CEL rules) before the
operator sees a job, but not everywhere: an emulator does not, an older API server
skips CEL, and some rules need code (a URI's scheme, host:port, label conflicts).
So `parse_spec` checks everything again and returns every problem, each naming its
field; the operator puts them in the `InvalidSpec` condition and creates nothing.
The defaults below are the CRD's defaults (a test keeps the two equal).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from torchspot.operator import constants

CLEAN_POD_POLICIES = ("All", "Running", "None")
PLACEMENT_KEYS = ("nodeSelector", "tolerations", "affinity")
"""The fields of a placement beyond spot/gpu: what a job's rendezvous or the operator's default may set."""
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_HOST = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$")


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
    """A valid ElasticJob spec with every default filled in."""

    min_replicas: int
    max_replicas: int
    template: dict[str, Any]
    replicas: int | None = None
    nproc_per_node: int = 1
    rdzv_endpoint: str = ""
    """An external etcd (host:port); '' = the operator runs a managed one for the job."""
    etcd_image: str = constants.ETCD_IMAGE
    etcd_placement: Placement = field(default_factory=lambda: Placement(spot=False, gpu=False))
    heartbeat_seconds: int = 1
    placement: Placement = field(default_factory=Placement)
    checkpoint_uri: str = ""
    checkpoint_interval: int = 200
    checkpoint_keep: int = 3
    credentials_secret: str = ""
    below_min_grace_seconds: int = 600
    max_restarts: int = 3
    termination_grace_seconds: int = 90
    clean_pod_policy: str = "Running"

    @property
    def desired(self) -> int:
        """Worker pods to keep: `replicas` (the scale subresource) or else `maxReplicas`."""
        return self.max_replicas if self.replicas is None else self.replicas


class InvalidSpecError(ValueError):
    """Every problem found in a spec, each naming its field."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class _Reader:
    """Reads typed fields out of a nested dict, collecting problems instead of stopping at the first."""

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

    def int_(self, parent: Mapping[str, Any], key: str, path: str, default: int | None, *, low: int, high: int) -> int:
        value = parent.get(key, default)
        if value is None:
            self.problems.append(f"{path}: required")
            return low
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{path}: must be an integer, not {value!r}")
            return low
        if not low <= value <= high:
            self.problems.append(f"{path}: {value} is outside {low}..{high}")
            return max(low, min(value, high))
        return value

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


def check_checkpoint_uri(uri: str) -> str | None:
    """Why a checkpoint URI is unusable, or None: the trainer's storage takes az:// and local paths."""
    parsed = urlparse(uri)
    if parsed.scheme == "az":
        if not parsed.netloc or not _DNS_LABEL.match(parsed.netloc) or not 3 <= len(parsed.netloc) <= 63:
            return f"{uri!r}: expected az://CONTAINER/PREFIX with a valid container name"
        return None
    if parsed.scheme == "file":
        return None if parsed.path.startswith("/") else f"{uri!r}: file:// needs an absolute path"
    if parsed.scheme:
        return f"{uri!r}: unknown scheme {parsed.scheme!r} (use az://container/prefix or file:///path)"
    return None if uri.startswith("/") else f"{uri!r}: a local path must be absolute"


def check_endpoint(endpoint: str) -> str | None:
    """Why an external etcd endpoint is not host:port, or None."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not _HOST.match(host):
        return f"{endpoint!r}: expected host:port"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{endpoint!r}: port must be a number in 1..65535"
    return None


def parse_spec(name: str, spec: Mapping[str, Any], *, etcd_default: Placement | None = None) -> JobSpec:
    """The job's spec, defaulted; raises `InvalidSpecError` listing every problem.

    :param etcd_default: the operator's placement for managed etcds (the chart's
        `etcd.defaultPlacement`), used when the job's rendezvous names no nodeSelector,
        tolerations or affinity of its own.
    """
    read = _Reader()
    if not isinstance(spec, Mapping):
        raise InvalidSpecError(["spec: must be an object"])
    problems = read.problems
    if len(name) > constants.MAX_JOB_NAME or not _DNS_LABEL.match(name):
        problems.append(
            f"metadata.name: {name!r} must be a DNS label of at most {constants.MAX_JOB_NAME} characters "
            "(worker pods and the etcd Service are named after it)"
        )
    low = read.int_(spec, "minReplicas", "spec.minReplicas", None, low=1, high=1000)
    high = read.int_(spec, "maxReplicas", "spec.maxReplicas", None, low=1, high=1000)
    if low > high:
        problems.append(f"spec.minReplicas: {low} exceeds spec.maxReplicas {high}")
    replicas = spec.get("replicas")
    if replicas is not None:
        replicas = read.int_(spec, "replicas", "spec.replicas", None, low=1, high=1000)
        if not low <= replicas <= high:
            problems.append(f"spec.replicas: {replicas} must lie between minReplicas {low} and maxReplicas {high}")

    rdzv = read.obj(spec, "rendezvous", "spec.rendezvous")
    endpoint, etcd_placement = _rendezvous(read, rdzv)
    if etcd_default is not None and not any(key in rdzv for key in PLACEMENT_KEYS):
        etcd_placement = etcd_default
    placement = read.placement(read.obj(spec, "placement", "spec.placement"), "spec.placement", spot=True, gpu=True)
    pool = placement.node_selector.get(constants.SPOT_LABEL)
    if placement.spot and pool not in (None, constants.SPOT_VALUE):
        problems.append(f"spec.placement.nodeSelector: {constants.SPOT_LABEL}={pool} contradicts placement.spot")

    checkpoint = read.obj(spec, "checkpoint", "spec.checkpoint")
    uri = read.str_(checkpoint, "uri", "spec.checkpoint.uri")
    if uri and (why := check_checkpoint_uri(uri)):
        problems.append(f"spec.checkpoint.uri: {why}")
    secret = read.str_(checkpoint, "credentialsSecret", "spec.checkpoint.credentialsSecret")
    if secret and not _DNS_SUBDOMAIN.match(secret):
        problems.append(f"spec.checkpoint.credentialsSecret: {secret!r} is not a valid Secret name")

    failure = read.obj(spec, "failurePolicy", "spec.failurePolicy")
    policy = read.str_(spec, "cleanPodPolicy", "spec.cleanPodPolicy", "Running")
    if policy not in CLEAN_POD_POLICIES:
        problems.append(f"spec.cleanPodPolicy: {policy!r}: choose one of {', '.join(CLEAN_POD_POLICIES)}")

    template = read.obj(spec, "template", "spec.template")
    _check_template(template, problems)

    result = JobSpec(
        min_replicas=low,
        max_replicas=high,
        replicas=replicas,
        template=template,
        nproc_per_node=read.int_(spec, "nprocPerNode", "spec.nprocPerNode", 1, low=1, high=64),
        rdzv_endpoint=endpoint,
        etcd_image=read.str_(rdzv, "image", "spec.rendezvous.image", constants.ETCD_IMAGE) or constants.ETCD_IMAGE,
        etcd_placement=etcd_placement,
        heartbeat_seconds=read.int_(rdzv, "heartbeatSeconds", "spec.rendezvous.heartbeatSeconds", 1, low=1, high=60),
        placement=placement,
        checkpoint_uri=uri,
        checkpoint_interval=read.int_(
            checkpoint, "intervalSteps", "spec.checkpoint.intervalSteps", 200, low=1, high=10**9
        ),
        checkpoint_keep=read.int_(checkpoint, "keep", "spec.checkpoint.keep", 3, low=1, high=100),
        credentials_secret=secret,
        below_min_grace_seconds=read.int_(
            failure, "belowMinGraceSeconds", "spec.failurePolicy.belowMinGraceSeconds", 600, low=0, high=10**7
        ),
        max_restarts=read.int_(failure, "maxRestarts", "spec.failurePolicy.maxRestarts", 3, low=0, high=10**6),
        termination_grace_seconds=read.int_(
            spec, "terminationGracePeriodSeconds", "spec.terminationGracePeriodSeconds", 90, low=10, high=3600
        ),
        clean_pod_policy=policy,
    )
    if problems:
        raise InvalidSpecError(problems)
    return result


def _rendezvous(read: _Reader, rdzv: Mapping[str, Any]) -> tuple[str, Placement]:
    """The external endpoint (or '') and the managed etcd's placement, which must avoid the spot pool."""
    problems = read.problems
    endpoint = read.str_(rdzv, "endpoint", "spec.rendezvous.endpoint")
    if endpoint and (why := check_endpoint(endpoint)):
        problems.append(f"spec.rendezvous.endpoint: {why}")
    return endpoint, _etcd_placement(read, rdzv, "spec.rendezvous")


def _etcd_placement(read: _Reader, obj: Mapping[str, Any], path: str) -> Placement:
    """A managed etcd's placement: anywhere but the spot pool (an evicted rendezvous stops the job)."""
    placement = read.placement(obj, path, spot=False, gpu=False)
    if placement.node_selector.get(constants.SPOT_LABEL) == constants.SPOT_VALUE:
        read.problems.append(f"{path}.nodeSelector: the managed etcd must not run on the spot pool")
    if any(t.get("key") == constants.SPOT_LABEL for t in placement.tolerations):
        read.problems.append(f"{path}.tolerations: the managed etcd must not tolerate the spot taint")
    return placement


def default_etcd_placement(raw: str) -> Placement | None:
    """The operator's default placement of managed etcds, from the JSON in `ETCD_PLACEMENT_ENV`.

    Checked like a job's own (`spec.rendezvous`); None when unset or empty. Raises
    `InvalidSpecError` naming the variable, so a bad chart value stops the operator
    at start rather than misplacing every job's etcd.
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


def _check_template(template: Mapping[str, Any], problems: list[str]) -> None:
    """The pod template: a spec with at least one named container with an image, restartPolicy Never."""
    pod = template.get("spec")
    if not isinstance(pod, dict):
        problems.append("spec.template.spec: required (the worker pod's spec)")
        return
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers:
        problems.append("spec.template.spec.containers: at least one container is required (the trainer)")
        return
    for index, container in enumerate(containers):
        path = f"spec.template.spec.containers[{index}]"
        if not isinstance(container, dict):
            problems.append(f"{path}: must be an object")
            continue
        if not isinstance(container.get("name"), str) or not container.get("name"):
            problems.append(f"{path}.name: required")
        if not isinstance(container.get("image"), str) or not container.get("image"):
            problems.append(f"{path}.image: required")
    restart = pod.get("restartPolicy", "Never")
    if restart != "Never":
        problems.append(
            f"spec.template.spec.restartPolicy: {restart!r}: must be Never (the operator replaces worker pods itself)"
        )
