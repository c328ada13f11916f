"""The operator's settings from its environment: defaults, and a bad value named."""

from __future__ import annotations

import pytest

from torchspot_operator import constants, metrics
from torchspot_operator.nodes import NodePolicy
from torchspot_operator.settings import OperatorSettings, SettingsError, read_settings


def test_an_empty_environment_gives_the_defaults() -> None:
    assert read_settings({}) == OperatorSettings()


def test_each_setting_is_read() -> None:
    got = read_settings({
        constants.NODE_HANDLING_ENV: "off",
        metrics.METRICS_PORT_ENV: "0",
        constants.OPERATOR_NAMESPACE_ENV: "torchspot",
        constants.OPERATOR_LABELS_ENV: '{"b": "2", "a": "1"}',
        constants.ETCD_PLACEMENT_ENV: '{"nodeSelector": {"pool": "cpu"}}',
        constants.ETCD_IMAGE_ENV: "myacr.azurecr.io/coreos/etcd:v3.5.17",
        constants.ETCD_PULL_SECRETS_ENV: "acr, other",
        constants.NODE_GRACE_ENV: "45",
        constants.CORDON_HANDLING_ENV: "on",
        constants.FULL_DISRUPTION_ENV: "0.3",
        constants.NODE_EVICTION_RATE_ENV: "2",
        constants.PEERING_LIFETIME_ENV: "90",
        constants.NODE_SELECTOR_ENV: "kubernetes.azure.com/scalesetpriority=spot, !example.com/retired, pool in (a, b)",
    })  # fmt: skip
    assert got.node_selector == "kubernetes.azure.com/scalesetpriority=spot,!example.com/retired,pool in (a, b)"
    assert (got.node_handling, got.metrics_port, got.peering_lifetime) == (False, 0, 90)
    assert (got.etcd_image, got.etcd_pull_secrets) == ("myacr.azurecr.io/coreos/etcd:v3.5.17", ("acr", "other"))
    assert got.nodes == NodePolicy(grace_seconds=45, cordon=True, full_disruption_share=0.3, eviction_rate=2)
    assert got.identity == ("torchspot", (("a", "1"), ("b", "2")))
    assert got.etcd_default is not None


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        (constants.NODE_HANDLING_ENV, "sometimes"),
        (metrics.METRICS_PORT_ENV, "80000"),
        (metrics.METRICS_PORT_ENV, "http"),
        (constants.OPERATOR_LABELS_ENV, "[1, 2]"),
        (constants.OPERATOR_LABELS_ENV, "{not json"),
        (constants.ETCD_PLACEMENT_ENV, '{"nodeSelector": 3}'),
        (constants.NODE_GRACE_ENV, "-1"),
        (constants.NODE_GRACE_ENV, "five"),
        (constants.CORDON_HANDLING_ENV, "yes"),
        (constants.FULL_DISRUPTION_ENV, "1.5"),
        (constants.NODE_EVICTION_RATE_ENV, "fast"),
        (constants.ETCD_IMAGE_ENV, "quay.io/etcd v3"),
        (constants.PEERING_LIFETIME_ENV, "5"),
        (constants.NODE_SELECTOR_ENV, "pool in spot"),
        (constants.NODE_SELECTOR_ENV, "pool=spot=1"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(variable: str, value: str) -> None:
    environ = {variable: value, constants.OPERATOR_NAMESPACE_ENV: "torchspot"}
    with pytest.raises(SettingsError, match="invalid operator setting") as caught:
        read_settings(environ)
    assert variable in str(caught.value) or "etcd" in str(caught.value).lower()
