"""The operator's own settings: read once at start-up from its environment (the chart sets each one).

Pure: `read_settings` takes the environment and returns the settings, or raises `SettingsError`
naming the variable, so a bad value stops the operator at once (handlers.py turns it into a
kopf.PermanentError) instead of surfacing at the first job that needs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from torchspot_operator import constants, metrics
from torchspot_operator.spec import InvalidSpecError, Placement, default_etcd_placement


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
    return OperatorSettings(
        etcd_default=etcd_default,
        node_handling=mode == "proactive",
        identity=_identity(environ),
        metrics_port=int(port),
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
