"""kopf registrations, and the process state they share: every trigger leads to the same level-based reconcile.

Run it with `kopf run -m torchspot_operator.handlers` (or `python -m torchspot_operator`).
Triggers: an ElasticJob appears (or is there when the operator starts), its spec changes (a new
`metadata.generation`), it is deleted, the ticker reaches it
(every `RECONCILE_INTERVAL` seconds, for jobs that are neither finished, invalid
nor suspended; it asks the API nothing unless something is due), one of its worker pods
or managed etcd objects changes, or a node carrying its workers turns bad. Whatever
fired, `Controller.reconcile` reads the job afresh and converges; so a missed or
repeated trigger costs nothing but latency.

What the operator watches, it watches narrowly: pods, Deployments, Services,
PodDisruptionBudgets and NetworkPolicies only with the operator's role label (the API server
filters them), through its own watches (informer.py: kopf's per-object machinery cost memory and,
in a wave of evictions, most of a replacement's latency), cached by the uid of the job that owns
them (caches.py); nodes (only when node handling is on) through another of its own watches, keeping
a few fields of each (`nodes.project`); ElasticJobs through kopf's.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, cast

import kopf
import prometheus_client

from torchspot_operator import builders, certs, conditions, constants, leader, metrics, nodes, verdicts
from torchspot_operator.caches import owner
from torchspot_operator.controller import Controller
from torchspot_operator.informer import Informer
from torchspot_operator.kube import LIST_PAGE, NODE_PAGE, ApiError, Kube, LoginError
from torchspot_operator.kube import login as kubeconfig_login
from torchspot_operator.listings import OWNED_KINDS
from torchspot_operator.settings import OperatorSettings, SettingsError, read_settings

log = logging.getLogger(__name__)


KOPF_WORKER_IDLE_SECONDS = 0.2
"""How long kopf keeps an object's worker (and the last body it handled) after its last event."""
RECONCILE_INTERVAL = 5.0
"""Seconds between ticks of each active job (`_tick_jobs`): bounds how late a clock (belowMinGraceSeconds,
the start-up timeout, activeDeadlineSeconds, a failure backoff) or a milestone is acted on.
A tick that finds nothing due makes no API request."""


ROUTINE_HANDLERS = frozenset({"job_changed"})
"""Handlers that run for every watch event: kopf logs each success at INFO."""

_state: dict[str, Any] = {}


class QuietRoutine(logging.Filter):
    """Drops kopf's "Handler '...' succeeded." INFO line for `ROUTINE_HANDLERS`; failures, retries and
    every other line pass.

    kopf logs a line per handler run. With 1,000 jobs and kopf's timers that was 200 lines a second
    while nothing happened, and one per listed object at every watch restart (158,000 lines in one benchmark run):
    log storage a platform pays for, and the operator's CPU. What the operator did is in its own lines
    (a phase change, a replacement, a refusal), its Events and its metrics."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not isinstance(record.msg, str) or not record.msg.endswith(" succeeded."):
            return True
        quoted = record.msg.split("'")  # "Handler 'job_changed' succeeded."
        return not (len(quoted) >= 3 and quoted[1] in ROUTINE_HANDLERS)


QUIET_ROUTINE = QuietRoutine()


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
    """Keep kopf's bookkeeping in annotations under our group (no handler compares specs: job_changed
    reads metadata.generation, so kopf keeps no copy of the spec) and its chatter out of Events;
    watch only our own objects; read the operator's own settings (settings.py: a bad one stops it)."""
    try:
        ours = read_settings(os.environ)
    except SettingsError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    _state["settings"] = ours
    _state["all_namespaces"] = os.environ.get(constants.ALL_NAMESPACES_ENV) == "1"
    logging.getLogger("kopf.objects").addFilter(QUIET_ROUTINE)  # once: a filter added twice is kept once
    _serve_metrics(ours.metrics_port)
    if settings.peering.mandatory:  # --peering NAME: one ClusterKopfPeering, whatever we watch
        settings.peering.clusterwide = True
        settings.peering.lifetime = ours.peering_lifetime
        _state["peering"] = settings.peering.name
        _state["priority"] = settings.peering.priority
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.GROUP)
    settings.persistence.finalizer = f"{constants.GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.chunk_size = LIST_PAGE  # kopf's listings page too: 8,000 pods never arrive in one answer
    # kopf's per-object worker waits this long for the object's next event before it exits, holding
    # the last event's whole body meanwhile (kopf/_core/reactor/queueing.py): at its 5 s default, a
    # start that lists 8,000 AKS-sized pods held thousands of them at once (about 250 KiB each, parsed).
    settings.queueing.idle_timeout = KOPF_WORKER_IDLE_SECONDS


async def _credentials(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo | None:
    """A login (`kube.login`: the `kubernetes` client's loaders) off the event loop: an exec plugin may
    take seconds."""
    try:
        return await asyncio.to_thread(kubeconfig_login, trust_env=settings.networking.trust_env)
    except LoginError as exc:
        raise kopf.PermanentError(str(exc)) from exc


def _serve_metrics(port: int) -> None:
    """Serve /metrics once per process (tests start the operator many times in one)."""
    if "metrics_port" in _state:
        return
    try:
        server, _ = prometheus_client.start_http_server(port)
    except OSError as exc:
        raise kopf.PermanentError(f"cannot serve metrics on port {port} ({metrics.METRICS_PORT_ENV}): {exc}") from exc
    prometheus_client.REGISTRY.register(
        metrics.Jobs(lambda: controller().phases if "controller" in _state and not controller().paused else {})
    )
    _state["metrics_port"] = server.server_port  # 0 asks for a free port (tests)


def metrics_port() -> int | None:
    """The port /metrics is served on in this process (None until the operator has started)."""
    port = _state.get("metrics_port")
    return None if port is None else int(port)


@kopf.on.probe(id="reconciling")
def reconciling(**_: Any) -> str:
    """kopf's liveness endpoint fails (500) while reconciles have stalled (metrics.py); a paused standby,
    whose reconciles stopped on purpose, is healthy and says so."""
    if "controller" in _state and controller().paused:
        return "standby"
    if "controller" in _state and not controller().alive():
        raise kopf.PermanentError(f"no reconcile finished for {metrics.STALL_SECONDS:.0f} s while jobs are active")
    return "ok"


@kopf.on.login()
async def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    """The service account in a pod, the kubeconfig outside (exec plugins included), as the `kubernetes`
    client reads them (`kube.login`); kopf's watches and our API layer use the same credentials.

    kopf logs in again when credentials expire (a token read from a file: every few
    minutes, to pick up the rotated one; an exec plugin's: at its expiry) or the API says
    401; the controller (and its per-job state) stays, only its API session is renewed.
    """
    info = await _credentials(settings)
    if info is None:
        return None
    fresh = Kube.from_connection(info, relogin=lambda: _credentials(settings))
    if "controller" in _state:
        await controller().api.renew(fresh)
    else:
        ours = cast(OperatorSettings, _state.get("settings") or OperatorSettings())
        _state["controller"] = Controller(
            fresh,
            etcd_default=ours.etcd_default,
            resolve=cast(Callable[[str], str] | None, _state.get("resolve")),
            node_handling=ours.node_handling,
            node_policy=ours.nodes,
            etcd_image=ours.etcd_image,
            etcd_pull_secrets=ours.etcd_pull_secrets,
            operator=ours.identity,
            operator_certificates=await _operator_certificates(fresh, ours.ca_secret),
        )
        if _state.get("peering"):
            await _ensure_peering(str(_state["peering"]))
            _state["standing"] = asyncio.get_running_loop().create_task(_follow_standing())
    return info


async def _operator_certificates(api: Kube, where: tuple[str, str] | None) -> certs.OperatorCertificates:
    """The operator's CA and client pair from its Secret in its own namespace, made there by the first
    replica that finds none (another's, if two race); outside a cluster, made for this process."""
    if where is None:
        return await asyncio.to_thread(certs.operator_certificates)
    namespace, name = where
    try:
        for _ in range(2):
            found = await api.get("v1", "Secret", namespace, name)
            if found is not None:
                files = {key: base64.b64decode(value) for key, value in (found.get("data") or {}).items()}
                try:
                    return certs.from_operator_files(files)
                except (KeyError, ValueError) as exc:
                    raise kopf.PermanentError(
                        f"Secret {namespace}/{name} lacks the operator's CA ({exc}); delete it and restart the "
                        "operator (it makes a new one; running jobs then report no progress until re-created)"
                    ) from exc
            made = await asyncio.to_thread(certs.operator_certificates)
            if await api.create(builders.operator_ca_secret(namespace, name, made)) is not None:
                log.info("made the operator CA in Secret %s/%s", namespace, name)
                return made
    except ApiError as exc:
        raise kopf.PermanentError(
            f"cannot read or create the operator CA Secret {namespace}/{name} ({exc}): the operator's Role in its "
            "namespace must allow get and create on it (the chart's does)"
        ) from exc
    raise kopf.PermanentError(f"Secret {namespace}/{name} was created and then not found; is something deleting it?")


async def _follow_standing() -> None:
    """Keep `Controller.paused` as kopf's peering decides it (leader.py), every `PEERING_CHECK_SECONDS`.

    Runs beside kopf, not as a daemon (kopf stops daemons while paused, which is when this matters).
    An unreadable peering object leaves the last answer."""
    name, priority = str(_state["peering"]), int(cast(int, _state["priority"]))
    while True:
        try:
            found = await controller().api.get(constants.PEERING_API_VERSION, constants.PEERING_KIND, None, name)
        except (ApiError, OSError, TimeoutError) as exc:
            log.warning("cannot read %s %s to know whether this replica leads: %s", constants.PEERING_KIND, name, exc)
        else:
            ahead = leader.outranked_by((found or {}).get("status") or {}, priority, datetime.now(UTC))
            if ahead:
                controller().pause(ahead)
            else:
                _lead()
        await asyncio.sleep(constants.PEERING_CHECK_SECONDS)


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
    for held in ("standing", "ticker"):
        task = _state.pop(held, None)
        if isinstance(task, asyncio.Task):
            task.cancel()
    _state.pop("jobs", None)
    _state.pop("context", None)  # kopf's event queue of this run: a later run in the process has its own
    watches = [task for tasks in _state.pop("informers", {}).values() for task in tasks]
    pending = [*watches, *_state.pop("tasks", set())]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    done = _state.pop("controller", None)
    if done is not None:
        done.milestones.close()
        await done.api.close()


@kopf.on.event(constants.GROUP, constants.VERSION, constants.PLURAL)
async def job_changed(body: kopf.Body, name: str, namespace: str | None, type: str | None, **_: Any) -> None:
    """A job appeared (or was there when the operator started), its spec changed (suspend included: a new
    `metadata.generation`), it is being deleted or is gone: reconcile it. Its own status writes (no new
    generation) are not a reason.

    An event handler, not kopf's create/update/resume handlers: those need kopf's copy of the last
    handled spec in an annotation on the job (capped at 256 KiB with the rest, and a write to the job
    at every change, each a 409 for a status write planned before it)."""
    # What the jobs own is watched from the first job event on: started here, the watches' reconcile
    # tasks inherit kopf's context, which its Event posting needs (started at login, every reconcile a
    # watch event caused failed at its first Event: kopf's event queue is a context variable).
    _state.setdefault("context", contextvars.copy_context())
    if _state.get("all_namespaces"):
        _watch(None)
    elif namespace:
        _watch(namespace)
    _lead()
    jobs: dict[tuple[str, str], Tracked] = _state.setdefault("jobs", {})
    if type == "DELETED":
        jobs.pop((namespace or "default", name), None)
    else:
        jobs[namespace or "default", name] = Tracked.of(body)
    if "ticker" not in _state:
        _state["ticker"] = asyncio.get_running_loop().create_task(_tick_jobs(), name="ticker")
    if controller().job_news(dict(body), deleted=type == "DELETED"):
        # In a task of its own, not awaited: kopf holds the event's body, its own records of the object
        # and the handler's context until the handler returns, and at a start every job's first
        # reconcile waits its turn in the client's rate limit (1,000 jobs: about 25 s).
        _reconcile_soon(namespace or "default", name)


@dataclass(frozen=True)
class Tracked:
    """What the ticker needs of a job, from its last event: whether its clocks run, and when a finished
    job's `ttlSecondsAfterFinished` runs out."""

    active: bool
    """Not finished, not invalid, not suspended (inactive jobs are never ticked)."""
    uid: str
    expires: datetime | None = None

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Tracked:
        status: Mapping[str, Any] = body.get("status") or {}
        spec: Mapping[str, Any] = body.get("spec") or {}
        phase = status.get("phase")
        uid = str((body.get("metadata") or {}).get("uid", ""))
        active = phase not in (*conditions.FINISHED_PHASES, conditions.PHASE_INVALID) and not spec.get("suspend")
        ttl, finished = spec.get("ttlSecondsAfterFinished"), status.get("completionTime")
        if phase not in conditions.FINISHED_PHASES or ttl is None or not finished:
            return cls(active, uid)
        return cls(active, uid, conditions.parse_timestamp(finished) + timedelta(seconds=ttl))


async def _tick_jobs() -> None:
    """Act on clocks and milestones when no event comes: every active job (`Tracked`, as its last event
    showed it) is ticked once per `RECONCILE_INTERVAL`, the ticks spread evenly over it; a tick is free
    when nothing is due (`Controller.tick`). A job whose last tick still runs is skipped; a finished job
    whose `ttlSecondsAfterFinished` ran out is deleted; a paused standby does nothing.

    One task for all jobs, not kopf's timers and daemons: for any resource with one, kopf keeps a task
    per timed object and the live body of every object (several MiB of live objects at a thousand
    jobs), and a finalizer on each, which made a job
    outlive an uninstalled operator. Started with the first job event, in kopf's context (Events need
    it)."""
    jobs: dict[tuple[str, str], Tracked] = _state.setdefault("jobs", {})
    running: dict[tuple[str, str], asyncio.Task[None]] = {}
    loop = asyncio.get_running_loop()

    def idle(key: tuple[str, str]) -> bool:
        held = running.get(key)
        return held is None or held.done()

    while True:
        for key in [key for key, task in running.items() if task.done()]:
            del running[key]
        if controller().paused:
            await asyncio.sleep(RECONCILE_INTERVAL)
            continue
        now = datetime.now(UTC)
        for key, job in list(jobs.items()):
            if job.expires is not None and job.expires <= now and idle(key):
                running[key] = loop.create_task(_expire(*key, job.uid))
        due = [key for key, job in jobs.items() if job.active]
        if not due:
            await asyncio.sleep(RECONCILE_INTERVAL)
        for key in due:
            job_now = jobs.get(key)
            if job_now is not None and job_now.active and not controller().paused and idle(key):
                running[key] = loop.create_task(_tick(*key))
            await asyncio.sleep(RECONCILE_INTERVAL / len(due))


async def _tick(namespace: str, name: str) -> None:
    """One job's tick; a failure is logged and the next tick tries again, as kopf's timers did."""
    try:
        await controller().tick(namespace, name)
    except Exception:
        log.exception("tick of job %s/%s failed; the next one tries again", namespace, name)


async def _expire(namespace: str, name: str, uid: str) -> None:
    """Delete a finished job whose TTL ran out (this incarnation only); a failure is tried again next round."""
    try:
        await controller().expire(namespace, name, uid)
    except (ApiError, OSError, TimeoutError) as exc:
        log.warning("job %s/%s: cannot delete it after its ttlSecondsAfterFinished: %s", namespace, name, exc)


def owned_object_event(type: str | None, body: dict[str, Any]) -> None:
    """A worker pod (scheduled, ready, failed, deleted) or managed etcd object (changed, or deleted by
    someone, or its job's predecessor's collected) changed: cache it, and reconcile the job that owns
    it now. From the operator's own watches (informer.py; a listed object has type None); a paused
    standby ignores it, as kopf's paused watches did (its caches are checked against the API when it
    resumes)."""
    if "controller" not in _state or _standing_by(body):
        return
    kind = str(body.get("kind", ""))
    controller().caches.observe(kind, body, deleted=type == "DELETED")
    found = owner(body)
    meta = body.get("metadata") or {}
    namespace = meta.get("namespace")
    if found is None or not namespace or not controller().news(body, type):
        return
    if type == "DELETED" and kind == "Pod":
        controller().pod_deleted(namespace, found[0], found[1], verdicts.project(body))
    elif type == "DELETED":
        controller().object_deleted(namespace, found[0], kind, str(meta.get("name", "")))
    _reconcile_soon(namespace, found[0])


def _standing_by(body: Mapping[str, Any]) -> bool:
    """Whether this replica is a paused standby: then an event is not acted on (as kopf's paused watches
    delivered none), only its job noted, to be reconciled when this replica leads (`_lead`)."""
    if not controller().paused:
        return False
    found = owner(body)
    namespace = (body.get("metadata") or {}).get("namespace")
    if found is not None and namespace:
        cast(set[tuple[str, str]], _state.setdefault("missed", set())).add((str(namespace), found[0]))
    return True


def _lead() -> None:
    """This replica leads (kopf runs job handlers only then; `_follow_standing` may not have read the
    peering object since): act on what the watches showed while it stood by. Every job's caches are
    checked against the API at its next reconcile (`Controller.pause`), and the jobs whose objects
    changed meanwhile are reconciled now."""
    if controller().paused:
        controller().pause([])
    for namespace, job in sorted(cast(set[tuple[str, str]], _state.pop("missed", set()))):
        _reconcile_soon(namespace, job)


def _listed(kind: str, namespace: str | None, uids: set[str], started: float) -> None:
    """A watch listed its kind (at its start, or again after a 410): see `Listings.listed`.
    A paused standby checks every job when it leads instead (its listing, which its caches did not take,
    serves no check: only its end is noted, so no check waits for it)."""
    if "controller" not in _state:
        return
    if controller().paused:
        controller().listings.ended(kind, namespace)
    else:
        controller().listings.listed(kind, namespace, uids, started)


def _reconcile_soon(namespace: str, job: str) -> None:
    """Reconcile a job in a task of its own (the watch reads on): its failure is logged, and the job's tick
    or next event tries again, as kopf does for an event handler that raised.

    The task runs in a copy of the context of the first job event, whatever starts it: it has kopf's
    event queue (Events need it), where a task started in a kopf handler would keep that handler's
    cause, the event's whole body, for as long as it runs."""
    base: contextvars.Context | None = _state.get("context")
    context = base.copy() if base is not None else None
    task = asyncio.get_running_loop().create_task(controller().reconcile(namespace, job), context=context)
    tasks: set[asyncio.Task[Any]] = _state.setdefault("tasks", set())
    tasks.add(task)
    task.add_done_callback(partial(_reconciled, namespace, job))


def _reconciled(namespace: str, job: str, task: asyncio.Task[Any]) -> None:
    cast(set[asyncio.Task[Any]], _state.get("tasks", set())).discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("reconcile of job %s/%s after a watch event failed: %r", namespace, job, task.exception())


def _watch(namespace: str | None) -> None:
    """Start the operator's own watches (informer.py) of what the jobs own in a namespace (None: every
    namespace), once."""
    informers: dict[str | None, list[asyncio.Task[None]]] = _state.setdefault("informers", {})
    if namespace in informers or (None in informers and namespace is not None):
        return
    loop = asyncio.get_running_loop()
    started = []
    if controller().node_handling and not controller().listings.watching("Node", None):  # once, whatever the namespaces
        controller().listings.started("Node", None)
        chosen = cast(OperatorSettings, _state.get("settings") or OperatorSettings()).node_selector
        watch = Informer(lambda: controller().api, "v1", "Node", chosen, None, node_seen, _nodes_listed, NODE_PAGE)
        started.append(loop.create_task(watch.run(), name="watch Node"))
    for (api_version, kind), role in OWNED_KINDS:
        controller().listings.started(kind, namespace)
        labels = {constants.LABEL_ROLE: role}
        listed = partial(_listed, kind, namespace)
        informer = Informer(lambda: controller().api, api_version, kind, labels, namespace, owned_object_event, listed)
        started.append(loop.create_task(informer.run(), name=f"watch {kind} {namespace or '(all)'}"))
    informers[namespace] = started


def node_seen(type: str | None, body: dict[str, Any]) -> None:
    """A node was listed or changed (the node watch, informer.py): kept as `nodes.project` keeps it, and if
    it is gone, drained or NotReady (nodes.py) its jobs are reconciled now (a definite signal moves their
    workers off at once; NotReady only after the grace, which the jobs' timers then watch). A paused
    standby keeps its node cache current and reconciles nothing.

    Why the operator's own watch and not kopf's: kopf parses every node whole and keeps each body in a
    worker for a while after its event; at a start or a relist of a thousand AKS nodes (about 100 KiB
    each as served) that was the operator's largest transient."""
    if "controller" not in _state:
        return
    chosen = cast(OperatorSettings, _state.get("settings") or OperatorSettings()).node_selector
    meta = body.get("metadata") or {}
    if chosen and not nodes.selected(meta.get("labels") or {}, chosen):
        controller().node_view.observe(body, deleted=True)  # outside the watch's selector: not kept
        return
    gone = type == "DELETED"
    controller().node_view.observe(body, deleted=gone)
    policy = controller().node_policy
    if controller().paused or (not gone and nodes.definite(body) is None and nodes.soft(body, policy) is None):
        return
    for namespace, job in sorted(controller().node_view.jobs_on(str(meta.get("name", "")))):
        _reconcile_soon(namespace, job)


def _nodes_listed(uids: set[str], _started: float) -> None:
    """The node watch listed the nodes: the jobs of nodes deleted while it was down are due now."""
    gone = controller().node_view.relisted(uids)
    controller().listings.ended("Node", None)
    if controller().paused:
        return
    for namespace, job in sorted({found for name in gone for found in controller().node_view.jobs_on(name)}):
        _reconcile_soon(namespace, job)
