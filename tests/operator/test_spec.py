"""The ElasticJob schema and the operator's own checks reject bad specs, each naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator.jobs import BAD_FOR_OPERATOR_ONLY, BAD_FOR_SCHEMA, crd, good_job
from tests.operator.schema import schema_errors
from torchspot.operator.spec import InvalidSpecError, JobSpec, default_etcd_placement, parse_spec


def _parse(body: dict[str, Any]) -> JobSpec:
    return parse_spec(body["metadata"]["name"], body["spec"])


def test_the_good_job_passes_both() -> None:
    body = good_job()
    assert schema_errors(body) == []
    spec = _parse(body)
    assert (spec.min_replicas, spec.max_replicas, spec.desired) == (1, 3, 3)
    assert spec.checkpoint_uri == "az://checkpoints/cifar"


@pytest.mark.parametrize(("case", "body", "said", "field"), BAD_FOR_SCHEMA, ids=[c[0] for c in BAD_FOR_SCHEMA])
def test_schema_rejects(case: str, body: dict[str, Any], said: str, field: str) -> None:
    errors = schema_errors(body)
    assert errors, f"{case}: accepted by the schema"
    assert any(said in error for error in errors), errors


@pytest.mark.parametrize(("case", "body", "said", "field"), BAD_FOR_SCHEMA, ids=[c[0] for c in BAD_FOR_SCHEMA])
def test_operator_also_rejects_what_the_schema_rejects(case: str, body: dict[str, Any], said: str, field: str) -> None:
    """An emulator or an API server without CEL lets these through; the operator does not."""
    with pytest.raises(InvalidSpecError) as info:
        _parse(body)
    assert any(problem.startswith(field + ":") for problem in info.value.problems), info.value.problems


@pytest.mark.parametrize(("case", "body", "field"), BAD_FOR_OPERATOR_ONLY, ids=[c[0] for c in BAD_FOR_OPERATOR_ONLY])
def test_operator_rejects_what_the_schema_cannot(case: str, body: dict[str, Any], field: str) -> None:
    assert schema_errors(body) == [], f"{case}: the schema catches it after all; move it to BAD_FOR_SCHEMA"
    with pytest.raises(InvalidSpecError) as info:
        _parse(body)
    assert any(problem.startswith(field) or field in problem for problem in info.value.problems), info.value.problems


def test_every_problem_is_reported_at_once() -> None:
    body = good_job(minReplicas=4, checkpoint={"uri": "s3://x/y"}, rendezvous={"endpoint": "nope"})
    with pytest.raises(InvalidSpecError) as info:
        _parse(body)
    fields = {problem.split(":")[0] for problem in info.value.problems}
    assert {"spec.minReplicas", "spec.checkpoint.uri", "spec.rendezvous.endpoint"} <= fields


def _crd_defaults(schema: dict[str, Any], path: str = "") -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, sub in schema.get("properties", {}).items():
        here = f"{path}.{key}" if path else key
        if "default" in sub and sub["default"] != {}:
            found[here] = sub["default"]
        found.update(_crd_defaults(sub, here))
    return found


def test_operator_defaults_match_the_crd_defaults() -> None:
    """kmock (and a job created before a default was added) has no defaults applied: the code fills them in."""
    spec_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaults = _crd_defaults(spec_schema)
    parsed = _parse(good_job(checkpoint={"uri": "/ckpt"}))
    ours = {
        "nprocPerNode": parsed.nproc_per_node,
        "rendezvous.image": parsed.etcd_image,
        "rendezvous.heartbeatSeconds": parsed.heartbeat_seconds,
        "placement.spot": parsed.placement.spot,
        "placement.gpu": parsed.placement.gpu,
        "checkpoint.intervalSteps": parsed.checkpoint_interval,
        "checkpoint.keep": parsed.checkpoint_keep,
        "failurePolicy.belowMinGraceSeconds": parsed.below_min_grace_seconds,
        "failurePolicy.maxRestarts": parsed.max_restarts,
        "terminationGracePeriodSeconds": parsed.termination_grace_seconds,
        "cleanPodPolicy": parsed.clean_pod_policy,
    }
    assert ours == defaults


def test_there_are_at_least_twenty_bad_specs() -> None:
    assert len(BAD_FOR_SCHEMA) + len(BAD_FOR_OPERATOR_ONLY) >= 20


def test_default_etcd_placement_is_used_only_when_the_job_names_none() -> None:
    default = default_etcd_placement('{"nodeSelector": {"agentpool": "system"}}')
    assert default is not None
    assert parse_spec("a", good_job()["spec"], etcd_default=default).etcd_placement == default
    own = good_job(rendezvous={"tolerations": [{"key": "dedicated", "operator": "Exists"}]})["spec"]
    placed = parse_spec("a", own, etcd_default=default).etcd_placement
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
        ('{"nodeSelector": {"pool": 3}}', "values must be strings"),
    ],
    ids=["not-json", "not-object", "unknown-key", "spot-selector", "spot-toleration", "non-string-label"],
)
def test_bad_default_etcd_placement_names_the_variable(raw: str, said: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        default_etcd_placement(raw)
    assert "TORCHSPOT_ETCD_PLACEMENT" in str(caught.value)
    assert said in str(caught.value)


@pytest.mark.parametrize("raw", ["", "  ", '{"nodeSelector": {}, "tolerations": [], "affinity": {}}'])
def test_empty_default_etcd_placement_means_none(raw: str) -> None:
    assert default_etcd_placement(raw) is None
