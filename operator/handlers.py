"""kopf registrations, and nothing else: every trigger leads to the same level-based reconcile.

Run it with `kopf run -m torchspot.operator.handlers` (or `python -m torchspot.operator`).
Triggers: an ElasticJob is created, its spec changes, the operator resumes, the timer
fires (every `RECONCILE_INTERVAL` seconds), one of its worker pods changes, or a node
carrying its workers turns bad. Whatever fired, `Controller.reconcile` reads the world
afresh and converges; so a missed or repeated trigger costs nothing but latency.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, cast

import kopf

from torchspot.operator import builders, constants
from torchspot.operator.controller import Controller
from torchspot.operator.kube import ApiError, Kube
from torchspot.operator.reconcile import node_trouble
from torchspot.operator.spec import InvalidSpecError, Placement, default_etcd_placement

RECONCILE_INTERVAL = 10.0
"""Seconds between timer reconciles of each job: bounds how stale the status and the
below-minimum clock may get when no event arrives (events reconcile at once)."""

_state: dict[str, Any] = {}


def use_endpoint_resolver(resolve: Callable[[str], str] | None) -> None:
    """Reach each job's etcd through `resolve` (the lab's sandbox: Service names to loopback ports).

    Call it before the operator starts (None: back to plain names, which DNS resolves in a cluster).
    """
    if resolve is None:
        _state.pop("resolve", None)
    else:
        _state["resolve"] = resolve


def controller() -> Controller:
    """The controller of this operator process (made at login, when the credentials are known)."""
    return cast(Controller, _state["controller"])


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations under our group and its chatter out of Events;
    read the operator's own settings from its environment (a bad one stops the operator)."""
    try:
        _state["etcd_default"] = default_etcd_placement(os.environ.get(constants.ETCD_PLACEMENT_ENV, ""))
    except InvalidSpecError as exc:
        raise kopf.PermanentError(f"invalid operator setting: {exc}") from exc
    mode = os.environ.get(constants.NODE_HANDLING_ENV, "") or constants.NODE_HANDLING_MODES[0]
    if mode not in constants.NODE_HANDLING_MODES:
        choices = " or ".join(constants.NODE_HANDLING_MODES)
        raise kopf.PermanentError(
            f"invalid operator setting: {constants.NODE_HANDLING_ENV}={mode!r}: expected {choices}"
        )
    _state["node_handling"] = mode == "proactive"
    if settings.peering.mandatory:  # --peering NAME: one ClusterKopfPeering, whatever we watch
        settings.peering.clusterwide = True
        settings.peering.lifetime = constants.PEERING_LIFETIME
        _state["peering"] = settings.peering.name
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=constants.GROUP)
    settings.persistence.finalizer = f"{constants.GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300


@kopf.on.login()
async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The service account in a pod, the kubeconfig outside; our API layer uses the same credentials.

    kopf logs in again when credentials expire; the controller (and its per-job locks)
    stays, only its API session is renewed.
    """
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        return None
    fresh = Kube.from_connection(info)
    if "controller" in _state:
        await controller().api.renew(fresh)
    else:
        _state["controller"] = Controller(
            fresh,
            etcd_default=cast(Placement | None, _state.get("etcd_default")),
            resolve=cast(Callable[[str], str] | None, _state.get("resolve")),
            node_handling=bool(_state.get("node_handling", True)),
        )
        if _state.get("peering"):
            await _ensure_peering(str(_state["peering"]))
    return info


async def _ensure_peering(name: str) -> None:
    """Create the peering object if no replica has yet, before kopf starts using it.

    kopf starts a `--peering` operator paused and only resumes it once the object tells
    it that no replica of higher priority lives; an object that never appears would keep
    it paused for ever, so a missing CRD or permission stops the operator instead.
    """
    try:
        await controller().api.create(builders.peering(name))
    except ApiError as exc:
        raise kopf.PermanentError(
            f"--peering={name}: cannot create {constants.PEERING_KIND} {name!r} ({exc}); install its CRD "
            "(the chart does, crds.peering) and allow the operator to create it, or run with --standalone"
        ) from exc


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    """Close our HTTP session with the operator."""
    done = _state.pop("controller", None)
    if done is not None:
        done.progress.close()
        await done.api.close()


@kopf.on.create(constants.GROUP, constants.VERSION, constants.PLURAL)
@kopf.on.update(constants.GROUP, constants.VERSION, constants.PLURAL, field="spec")
@kopf.on.resume(constants.GROUP, constants.VERSION, constants.PLURAL)
async def job_changed(name: str, namespace: str | None, **_: Any) -> None:
    """A job appeared, changed its spec, or was already there when the operator started."""
    await controller().reconcile(namespace or "default", name)


@kopf.timer(constants.GROUP, constants.VERSION, constants.PLURAL, interval=RECONCILE_INTERVAL)
async def job_timer(name: str, namespace: str | None, **_: Any) -> None:
    """Converge even when no event comes (clocks such as belowMinGraceSeconds run on their own)."""
    await controller().reconcile(namespace or "default", name)


@kopf.on.event("v1", "pods", labels={constants.LABEL_ROLE: constants.ROLE_WORKER})
async def worker_pod_event(labels: kopf.Labels, namespace: str | None, **_: Any) -> None:
    """A worker pod changed (scheduled, ready, failed, deleted): reconcile its job now."""
    job = labels.get(constants.LABEL_JOB)
    if job and namespace:
        await controller().reconcile(namespace, job)


@kopf.on.event("v1", "nodes")
async def node_event(body: kopf.Body, name: str, type: str | None, **_: Any) -> None:
    """A node went bad (NotReady, cordoned, tainted for eviction, deleted): move its workers off now."""
    if not controller().node_handling:
        return
    gone = type == "DELETED"
    controller().observe_node(dict(body), deleted=gone)
    if not gone and node_trouble(dict(body)) is None:
        return
    for namespace, job in controller().jobs_on_node(name):
        await controller().reconcile(namespace, job)
