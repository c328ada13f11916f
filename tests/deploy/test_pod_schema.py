"""The worker template's schema is Kubernetes' PodSpec, generated (tools/pod_schema.py), structural, and
what the chart ships."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml

from tests.deploy.helm import one, template
from tools import pod_schema


def _nodes(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _nodes(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from _nodes(schema[key], f"{path}[{key}]")


def test_the_chart_ships_a_fresh_generation() -> None:
    """Edit tools/pod_schema.py and run `make manifests`; this fails when the file was edited by hand or
    kubernetes-validate's pin moved without a regeneration."""
    assert pod_schema.OUT.read_text() == pod_schema.render()


def test_the_crd_carries_it_and_it_is_structural() -> None:
    """What the API server requires of a CRD schema: a type on every node (or int-or-string, or kept
    unknown fields), no list-map keys it would have to check, and properties or additionalProperties,
    never both."""
    crd = one(template(), "CustomResourceDefinition", "elasticjobs.torchspot.dev")
    version = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = version["properties"]["spec"]["properties"]["template"]["properties"]["spec"]
    assert spec == yaml.safe_load(pod_schema.render())
    nodes = list(_nodes(spec))
    assert len(nodes) > 1000  # the whole PodSpec, volumes and probes included
    for where, node in nodes:
        assert (
            node.get("type")
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ), where
        assert not ("properties" in node and "additionalProperties" in node), where
        assert "x-kubernetes-list-map-keys" not in node, where
        assert "$ref" not in node, where
    assert not spec.get("x-kubernetes-preserve-unknown-fields")  # the template itself keeps no unknown field


def test_a_self_referring_type_is_refused_and_null_is_not_a_type() -> None:
    definitions = {
        "a": {"type": ["object", "null"], "properties": {"next": {"$ref": "#/$defs/a"}}},
        "b": {"type": ["integer", "null"], "format": "int32"},
    }
    with pytest.raises(ValueError, match="refers to itself"):
        pod_schema.structural({"$ref": "#/$defs/a"}, definitions)
    assert pod_schema.structural({"$ref": "#/$defs/b"}, definitions) == {"type": "integer", "format": "int32"}
