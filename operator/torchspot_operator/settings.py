"""The operator's own settings: read once at start-up from its environment (the chart sets each one).

Pure: `read_settings` takes the environment and returns the settings, or raises `SettingsError`
naming the variable, so a bad value stops the operator at once (handlers.py turns it into a
kopf.PermanentError) instead of surfacing at the first job that needs it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from torchspot_operator import constants, metrics
from torchspot_operator.nodes import NodePolicy
from torchspot_operator.spec import InvalidSpecError, Placement, default_etcd_placement

DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
"""An object name as the API server accepts one (RFC 1123 subdomain)."""
_LABEL_KEY = r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
SELECTOR_TERM = re.compile(
    rf"!?{_LABEL_KEY}|{_LABEL_KEY}\s*(=|==|!=)\s*{_LABEL_VALUE}?"
    rf"|{_LABEL_KEY}\s+(in|notin)\s+\(\s*{_LABEL_VALUE}(\s*,\s*{_LABEL_VALUE})*\s*\)"
)
"""One term of a label selector (equality- or set-based), as the API server parses them."""


class SettingsError(ValueError):
    """An operator setting the operator cannot run with; the message names the variable."""


@dataclass(frozen=True)
class OperatorSettings:
    """What the operator process is configured with, beside kopf's own command-line flags."""

    etcd_default: Placement | None = None
    """Where managed etcds go unless a job says (`constants.ETCD_PLACEMENT_ENV`, the chart's
    `etcd.defaultPlacement`): the on-demand CPU pool, never the spot nodes the etcd must outlive."""
    node_handling: bool = True
    """True (`proactive`, the default): a worker's node that turns bad has its pods deleted at once, so
    they are replaced elsewhere while the rest of the group re-forms. False (`off`): only pod failures
    and deletions count, as with controllers that do not watch nodes; then nodes are not watched at
    all (`constants.NODE_HANDLING_ENV`)."""
    identity: tuple[str, tuple[tuple[str, str], ...]] | None = None
    """The operator pod's namespace and sorted labels (`constants.OPERATOR_NAMESPACE_ENV`,
    `constants.OPERATOR_LABELS_ENV`): each job's NetworkPolicy admits the operator's progress reader
    to its etcd by them. None outside a cluster, where no job's etcd is reachable anyway."""
    nodes: NodePolicy = field(default_factory=NodePolicy)
    """How NotReady and cordoned nodes are judged (nodes.py): the grace
    (`constants.NODE_GRACE_ENV`), cordon handling (`constants.CORDON_HANDLING_ENV`), the
    full-disruption share (`constants.FULL_DISRUPTION_ENV`) and the rate
    (`constants.NODE_EVICTION_RATE_ENV`)."""
    etcd_image: str = constants.ETCD_IMAGE
    """The managed etcd's image unless a job says (`constants.ETCD_IMAGE_ENV`, the chart's `etcd.image`):
    a cluster whose egress admits only its own registry mirrors it there."""
    etcd_pull_secrets: tuple[str, ...] = ()
    """Image pull Secrets of the managed etcd's pods (`constants.ETCD_PULL_SECRETS_ENV`, comma-separated)."""
    ca_secret: tuple[str, str] | None = None
    """Where the operator's CA is kept: (its namespace, the Secret's name; `constants.OPERATOR_CA_SECRET_ENV`).
    None outside a cluster (no `constants.OPERATOR_NAMESPACE_ENV`): a CA made for the process."""
    peering_lifetime: int = constants.PEERING_LIFETIME
    """Seconds a replica's peering record lives without a keep-alive (`constants.PEERING_LIFETIME_ENV`)."""
    node_selector: str = ""
    """The label selector of the node watch (`constants.NODE_SELECTOR_ENV`); empty: every node."""
    metrics_port: int = metrics.DEFAULT_METRICS_PORT
    """Where /metrics is served (`metrics.METRICS_PORT_ENV`); 0 asks for a free port (tests, which
    start several operators on one machine)."""


def read_settings(environ: Mapping[str, str]) -> OperatorSettings:
    """The settings in `environ`; the first bad one raises SettingsError."""
    try:
        etcd_default = default_etcd_placement(environ.get(constants.ETCD_PLACEMENT_ENV, ""))
    except InvalidSpecError as exc:
        raise SettingsError(f"invalid operator setting: {exc}") from exc
    mode = environ.get(constants.NODE_HANDLING_ENV, "") or constants.NODE_HANDLING_MODES[0]
    if mode not in constants.NODE_HANDLING_MODES:
        choices = " or ".join(constants.NODE_HANDLING_MODES)
        raise SettingsError(f"invalid operator setting: {constants.NODE_HANDLING_ENV}={mode!r}: expected {choices}")
    port = environ.get(metrics.METRICS_PORT_ENV, "") or str(metrics.DEFAULT_METRICS_PORT)
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise SettingsError(f"invalid operator setting: {metrics.METRICS_PORT_ENV}={port!r}: expected a port")
    image = environ.get(constants.ETCD_IMAGE_ENV, "").strip() or constants.ETCD_IMAGE
    if any(c.isspace() for c in image):
        raise SettingsError(f"invalid operator setting: {constants.ETCD_IMAGE_ENV}={image!r}: expected an image")
    secrets = tuple(n.strip() for n in environ.get(constants.ETCD_PULL_SECRETS_ENV, "").split(",") if n.strip())
    given = environ.get(constants.NODE_SELECTOR_ENV, "").strip()
    terms = [term.strip() for term in re.split(r",(?![^()]*\))", given)] if given else []
    if not all(SELECTOR_TERM.fullmatch(term) for term in terms):
        raise SettingsError(
            f"invalid operator setting: {constants.NODE_SELECTOR_ENV}={given!r}: expected a label selector "
            "(key=value, key!=value, key, !key, key in (a,b), key notin (a,b); comma-separated)"
        )
    selector = ",".join(terms)
    return OperatorSettings(
        etcd_default=etcd_default,
        node_handling=mode == "proactive",
        identity=_identity(environ),
        nodes=_node_policy(environ),
        etcd_image=image,
        etcd_pull_secrets=secrets,
        metrics_port=int(port),
        node_selector=selector,
        ca_secret=_ca_secret(environ),
        peering_lifetime=int(_number(environ, constants.PEERING_LIFETIME_ENV, 10, 600) or constants.PEERING_LIFETIME),
    )


def _number(environ: Mapping[str, str], name: str, low: float, high: float) -> float | None:
    """A number setting within [low, high]; None if unset."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise SettingsError(f"invalid operator setting: {name}={text!r}: expected a number from {low:g} to {high:g}")
    return value


def _node_policy(environ: Mapping[str, str]) -> NodePolicy:
    cordon = environ.get(constants.CORDON_HANDLING_ENV, "").strip() or "off"
    if cordon not in ("on", "off"):
        raise SettingsError(f"invalid operator setting: {constants.CORDON_HANDLING_ENV}={cordon!r}: expected on or off")
    share = _number(environ, constants.FULL_DISRUPTION_ENV, 0.0, 1.0)
    rate = _number(environ, constants.NODE_EVICTION_RATE_ENV, 0.0, 1000.0)
    return NodePolicy(
        grace_seconds=_number(environ, constants.NODE_GRACE_ENV, 0.0, 86400.0),
        cordon=cordon == "on",
        full_disruption_share=constants.FULL_DISRUPTION_SHARE if share is None else share,
        eviction_rate=constants.NODE_EVICTION_RATE if rate is None else rate,
    )


def _identity(environ: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    namespace = environ.get(constants.OPERATOR_NAMESPACE_ENV, "")
    text = environ.get(constants.OPERATOR_LABELS_ENV, "")
    if not namespace or not text:
        return None
    try:
        labels = json.loads(text)
    except ValueError as exc:
        raise SettingsError(f"invalid operator setting: {constants.OPERATOR_LABELS_ENV}: {exc}") from exc
    if not isinstance(labels, dict) or not labels or not all(isinstance(v, str) for v in labels.values()):
        raise SettingsError(
            f"invalid operator setting: {constants.OPERATOR_LABELS_ENV}: expected a JSON object of label strings"
        )
    return namespace, tuple(sorted(labels.items()))


def _ca_secret(environ: Mapping[str, str]) -> tuple[str, str] | None:
    namespace = environ.get(constants.OPERATOR_NAMESPACE_ENV, "").strip()
    name = environ.get(constants.OPERATOR_CA_SECRET_ENV, "").strip() or constants.OPERATOR_CA_SECRET
    if not namespace:
        return None
    if not DNS_NAME.fullmatch(name):
        raise SettingsError(
            f"invalid operator setting: {constants.OPERATOR_CA_SECRET_ENV}={name!r}: expected a Secret name"
        )
    return namespace, name
