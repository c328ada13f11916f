"""What the ElasticJob CRD refuses at admission (schema, CEL, transition rules), and what the operator still checks.

Each bad spec goes through `torchspot_lab.kubeapi.admission`, which applies the shipped CRD's
defaults, OpenAPI schema (jsonschema) and CEL rules (cel-python) the way the API server
does; the same admission runs in the lab's API emulator, so the operator's integration
tests meet a server that refuses these too.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.operator.jobs import BAD, IMMUTABLE, MUTABLE, crd, good_job, with_path
from torchspot_lab.kubeapi.admission import Admission, AdmissionError, UnknownFieldsError, apply_defaults
from torchspot_operator import constants
from torchspot_operator.spec import InvalidSpecError, JobSpec, default_etcd_placement, parse_spec

ADMISSION = Admission(crd())


def _admit(body: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    return ADMISSION.admit(body, old)


def _parse(body: dict[str, Any]) -> JobSpec:
    return parse_spec(body["spec"])


def test_the_good_job_is_admitted_defaulted_and_parsed() -> None:
    stored = _admit(good_job())
    assert stored["spec"]["failurePolicy"] == {
        "belowMinGraceSeconds": 600,
        "startupTimeoutSeconds": 3600,
        "stallTimeoutSeconds": 900,
        "maxRestarts": 3,
    }
    assert stored["spec"]["suspend"] is False
    spec = _parse(stored)
    assert (spec.min_replicas, spec.max_replicas, spec.desired) == (1, 3, 3)
    assert spec.checkpoint_uri == "az://checkpoints/cifar"


@pytest.mark.parametrize(("case", "body", "field", "said"), BAD, ids=[c[0] for c in BAD])
def test_the_api_server_refuses(case: str, body: dict[str, Any], field: str, said: str) -> None:
    with pytest.raises(AdmissionError) as info:
        _admit(body)
    assert any(problem.startswith(field) and said in problem for problem in info.value.problems), info.value.problems
    assert 'ElasticJob.torchspot.dev "' in str(info.value)


def test_a_typo_in_the_pod_template_is_refused_by_name_under_strict_and_pruned_otherwise() -> None:
    """kubectl sends fieldValidation=Strict: the misspelt field is named at `kubectl apply`. Other clients
    get it dropped (as the API server prunes a field its schema does not declare), never stored."""
    body = with_path("template.spec.nodeSelecter", {"pool": "gpu"})
    with pytest.raises(UnknownFieldsError) as info:
        ADMISSION.admit(body, strict=True)
    assert info.value.problems == ['unknown field "spec.template.spec.nodeSelecter"']
    assert info.value.status == 400
    stored = ADMISSION.admit(body)
    assert "nodeSelecter" not in stored["spec"]["template"]["spec"]
    assert stored["spec"]["template"]["spec"]["containers"][0]["image"]  # the rest is kept


def test_quantities_and_ports_take_a_number_or_a_string() -> None:
    container = {
        "name": "trainer", "image": "trainer:1",
        "resources": {"limits": {"cpu": 2, "memory": "8Gi", "nvidia.com/gpu": 8}, "requests": {"cpu": "500m"}},
        "livenessProbe": {"httpGet": {"port": "metrics"}}, "readinessProbe": {"httpGet": {"port": 8080}},
    }  # fmt: skip
    stored = ADMISSION.admit(with_path("template.spec.containers", [container]), strict=True)
    assert stored["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == 2


def test_every_problem_is_reported_at_once() -> None:
    body = with_path("checkpoint.uri", "s3://x/y", body=with_path("rendezvous.endpoint", "nope"))
    with pytest.raises(AdmissionError) as info:
        _admit(body)
    assert {p.split(":")[0] for p in info.value.problems} == {"spec.checkpoint.uri", "spec.rendezvous.endpoint"}


@pytest.mark.parametrize(("path", "value", "said"), IMMUTABLE, ids=[c[0] for c in IMMUTABLE])
def test_immutable_fields_cannot_change(path: str, value: Any, said: str) -> None:
    old = _admit(good_job())
    with pytest.raises(AdmissionError, match=said):
        _admit(with_path(path, value, body=old), old)
    _admit(copy.deepcopy(old), old)  # the unchanged object passes its transition rules


def test_an_external_endpoint_can_be_neither_added_nor_removed() -> None:
    managed = _admit(good_job())
    with pytest.raises(AdmissionError, match=r"rendezvous\.endpoint is immutable"):
        _admit(with_path("rendezvous.endpoint", "etcd:2379", body=managed), managed)
    external = _admit(with_path("rendezvous.endpoint", "etcd:2379"))
    with pytest.raises(AdmissionError, match=r"rendezvous\.endpoint is immutable"):
        _admit(with_path("rendezvous.endpoint", "<del>", body=external), external)


@pytest.mark.parametrize(("path", "value"), MUTABLE, ids=[c[0] for c in MUTABLE])
def test_mutable_fields_can_change(path: str, value: Any) -> None:
    """Admitted on an update, and stored as sent (not defaulted away nor left at the old value)."""
    old = _admit(good_job())
    assert _at(old, path) != value
    stored = _admit(with_path(path, value, body=old), old)
    assert _at(stored, path) == value


def _at(body: dict[str, Any], path: str) -> Any:
    """The spec field at `path` (as `with_path` names it), or None where it is absent."""
    node: Any = body["spec"]
    for part in path.split("."):
        key, _, index = part.rstrip("]").partition("[")
        node = node.get(key) if isinstance(node, dict) else None
        if index and node is not None:
            node = node[int(index)]
    return node


def test_defaults_fill_nested_objects_the_user_left_out() -> None:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    body = good_job()
    del body["spec"]["checkpoint"]
    defaulted = apply_defaults(schema, body)
    assert defaulted["spec"]["checkpoint"] == {"intervalSteps": 200, "keep": 3}
    assert defaulted["spec"]["placement"] == {"spot": True, "gpu": True}
    assert "checkpoint" not in body["spec"]  # a copy: the caller's object is untouched


def _crd_defaults(schema: dict[str, Any], path: str = "") -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, sub in schema.get("properties", {}).items():
        here = f"{path}.{key}" if path else key
        if "default" in sub and sub["default"] != {}:
            found[here] = sub["default"]
        found.update(_crd_defaults(sub, here))
    return found


def test_operator_defaults_match_the_crd_defaults() -> None:
    """A job stored before a default was added has it filled in by the operator, with the same value."""
    spec_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaults = _crd_defaults(spec_schema)
    parsed = _parse(good_job(checkpoint={"uri": "/ckpt"}))
    ours = {
        "nprocPerNode": parsed.nproc_per_node,
        "replicaGroupSize": parsed.replica_group_size,
        "suspend": parsed.suspend,
        "rendezvous.heartbeatSeconds": parsed.heartbeat_seconds,
        "placement.spot": parsed.placement.spot,
        "placement.gpu": parsed.placement.gpu,
        "checkpoint.intervalSteps": parsed.checkpoint_interval,
        "checkpoint.keep": parsed.checkpoint_keep,
        "failurePolicy.belowMinGraceSeconds": parsed.below_min_grace_seconds,
        "failurePolicy.startupTimeoutSeconds": parsed.startup_timeout_seconds,
        "failurePolicy.stallTimeoutSeconds": parsed.stall_timeout_seconds,
        "failurePolicy.maxRestarts": parsed.max_restarts,
        "terminationGracePeriodSeconds": parsed.termination_grace_seconds,
        "cleanPodPolicy": parsed.clean_pod_policy,
    }
    assert ours == defaults
    assert parsed.etcd_image == constants.ETCD_IMAGE  # no CRD default: the operator's setting applies
    mirrored = parse_spec(good_job()["spec"], etcd_image="myacr.azurecr.io/etcd:v3.5.17", etcd_pull_secrets=("acr",))
    assert (mirrored.etcd_image, mirrored.etcd_pull_secrets) == ("myacr.azurecr.io/etcd:v3.5.17", ("acr",))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (with_path("minReplicas", "two"), "spec.minReplicas: must be an integer"),
        (with_path("suspend", "yes"), "spec.suspend: must be true or false"),
        (with_path("template.spec.containers", "trainer"), "spec.template.spec.containers: at least one"),
        (with_path("checkpoint", ["uri"]), "spec.checkpoint: must be an object"),
    ],
    ids=["int", "bool", "containers", "object"],
)
def test_the_operator_guards_against_a_spec_no_schema_checked(body: dict[str, Any], field: str) -> None:
    """Stored under an old CRD (or none): a wrong type is reported naming the field, not a crash."""
    with pytest.raises(InvalidSpecError) as info:
        _parse(body)
    assert any(problem.startswith(field) for problem in info.value.problems), info.value.problems


def test_there_are_at_least_twenty_bad_specs() -> None:
    assert len(BAD) >= 20


def test_default_etcd_placement_is_used_only_when_the_job_names_none() -> None:
    default = default_etcd_placement('{"nodeSelector": {"agentpool": "system"}}')
    assert default is not None
    assert parse_spec(good_job()["spec"], etcd_default=default).etcd_placement == default
    own = good_job(rendezvous={"tolerations": [{"key": "dedicated", "operator": "Exists"}]})["spec"]
    placed = parse_spec(own, etcd_default=default).etcd_placement
    assert placed.node_selector == {}
    assert placed.tolerations == [{"key": "dedicated", "operator": "Exists"}]


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ("{nodeSelector: 1}", "not JSON"),
        ("[]", "must be a JSON object"),
        ('{"nodeSelecter": {}}', "unknown keys nodeSelecter"),
        ('{"nodeSelector": {"kubernetes.azure.com/scalesetpriority": "spot"}}', "must not run on the spot pool"),
        ('{"tolerations": [{"key": "kubernetes.azure.com/scalesetpriority"}]}', "must not tolerate the spot taint"),
        ('{"tolerations": [{"operator": "Exists"}]}', "must not tolerate the spot taint"),
        ('{"nodeSelector": {"pool": 3}}', "values must be strings"),
    ],
    ids=[
        "not-json",
        "not-object",
        "unknown-key",
        "spot-selector",
        "spot-toleration",
        "every-taint",
        "non-string-label",
    ],
)
def test_bad_default_etcd_placement_names_the_variable(raw: str, said: str) -> None:
    """The operator's own setting: no CRD sees it, so the operator checks it as the CRD checks a job's."""
    with pytest.raises(InvalidSpecError) as caught:
        default_etcd_placement(raw)
    assert "TORCHSPOT_ETCD_PLACEMENT" in str(caught.value)
    assert said in str(caught.value)


@pytest.mark.parametrize("raw", ["", "  ", '{"nodeSelector": {}, "tolerations": [], "affinity": {}}'])
def test_empty_default_etcd_placement_means_none(raw: str) -> None:
    assert default_etcd_placement(raw) is None
