"""One reconcile's writes: the plan's creates (worker pods in slow-start batches, the etcd's objects one
at a time, the job's etcd Secret before them), deletes and updates, the marks on the failed pods it keeps,
and the job's status, each remembered in the job's memory (memory.py) so that the next plan counts what
was done and backs off what was refused.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from torchspot_operator import builders, certs, conditions, constants, events
from torchspot_operator.builders import JobRef
from torchspot_operator.caches import Caches, compact, owner
from torchspot_operator.conditions import CreateFailure
from torchspot_operator.kube import ApiError, Kube
from torchspot_operator.memory import JobMemory, Refusal
from torchspot_operator.reconcile import Plan, Update

__all__ = ["Writes", "slow_start"]

log = logging.getLogger(__name__)


class Writes:
    """A reconcile's requests (module docstring).

    :param api: where they go.
    :param caches: what the watches showed (whether the job's etcd exists, for its Secret).
    :param certificates: the operator's CA, which signs each job's etcd certificates.
    """

    def __init__(self, api: Kube, caches: Caches, certificates: certs.OperatorCertificates) -> None:
        self.api, self.caches, self.certificates = api, caches, certificates

    async def act(
        self, job: JobRef, decided: Plan, memory: JobMemory, now: datetime
    ) -> tuple[list[tuple[str, str, str]], set[str]]:
        """Create, delete, update and mark as planned; the events of what could not be created, and the
        `Kind/name` of what was.

        Worker pods go in slow-start batches of 1, 2, 4 ... sent together, as the ReplicaSet and
        Job controllers send theirs, and a batch with a refusal ends the round: a namespace out
        of quota costs one refused request, not one per missing pod, and 64 workers cost seven
        round trips, not 64. Other objects (the etcd's, in order) go one at a time. A refusal
        backs the job's creates off (`_failed`); a success resets that.
        """
        clock = time.monotonic()
        memory.accounted.update({uid: clock for uid in decided.accounted})  # before any request: see pod_deleted
        memory.deleted.update({d.uid: clock for d in decided.delete if d.uid and d.kind == "Pod"})
        memory.vanished.clear()  # the plan counted them
        events: list[tuple[str, str, str]] = []
        etcd_blocked = refused = False
        if any(_mounts(obj, job.tls_secret) for obj in decided.create):
            failure = await self._secret(job, memory, now)
            if failure is not None:
                etcd_blocked, refused = True, failure.reason == conditions.FAILED_CREATE
                events += self._failed(memory, failure, now)
        created = set[str]()
        for batch in slow_start(decided.create):
            if refused or (etcd_blocked and (batch[0]["kind"] == "Pod" or _mounts(batch[0], job.tls_secret))):
                continue  # refused: wait for the backoff; blocked: workers would meet somewhere else
            failures = await asyncio.gather(*(self._create(job, obj, memory, now) for obj in batch))
            for obj, failure in zip(batch, failures, strict=True):
                if failure is None:
                    created.add(f"{obj['kind']}/{obj['metadata']['name']}")
                    continue
                etcd_blocked = etcd_blocked or obj["kind"] != "Pod"
                if failure.reason == conditions.FAILED_CREATE and refused:
                    log.info("%s (same round)", failure.message)  # one round's refusals back off once
                    continue
                refused = refused or failure.reason == conditions.FAILED_CREATE
                events += self._failed(memory, failure, now)
        if created and not refused:
            memory.refusal = None  # as the workqueue forgets an item only after a sync without error
        for delete in decided.delete:
            log.info("deleting %s %s/%s: %s", delete.kind, job.namespace, delete.name, delete.why)
            await self.api.delete(
                delete.api_version, delete.kind, job.namespace, delete.name, delete.grace, uid=delete.uid or None
            )
        for update in decided.update:
            await self._update(job, update, memory)
        for key, failure in list(memory.failures.items()):  # a taken pod name is tried again after a while
            if key.startswith("Pod/") and (now - failure.at).total_seconds() >= constants.NAME_RETRY_SECONDS:
                del memory.failures[key]
        return events, created

    async def _update(self, job: JobRef, update: Update, memory: JobMemory) -> None:
        """Patch (a job edit) or apply (someone else's change undone) a managed etcd object; remember the
        version it has after, so a field the API server stores its own way is not taken for drift."""
        log.info("updating %s %s/%s in place", update.kind, job.namespace, update.name)
        if update.apply:
            stored = await self.api.apply(update.patch, constants.FIELD_MANAGER)
        else:
            stored = await self.api.patch(update.api_version, update.kind, job.namespace, update.name, update.patch)
        meta = (stored or {}).get("metadata") or {}
        memory.applied[str(meta.get("uid", ""))] = str(meta.get("resourceVersion", ""))

    def _failed(self, memory: JobMemory, failure: CreateFailure, now: datetime) -> list[tuple[str, str, str]]:
        """Note what could not be created: a taken name by its key; a refusal as the job's refusal backoff.
        The events to post: a taken name once; a refusal when its message is new or the last one was said
        longer than the cap ago (one Event per distinct refusal per backoff period)."""
        if failure.reason != conditions.FAILED_CREATE:
            memory.failures[failure.key] = failure
            return [events.of(failure.reason, failure.message)]
        old = memory.refusal
        count = 1 if old is None else old.count + 1
        wait = min(constants.REFUSAL_BACKOFF_BASE * 2 ** (count - 1), constants.REFUSAL_BACKOFF_CAP)
        refusal = Refusal(count, failure.message, now + timedelta(seconds=wait))
        if old is not None:
            refusal.said_at, refusal.said = old.said_at, old.said
        memory.refusal = refusal
        said = _without_names(failure.message)
        quiet = refusal.said_at is None or (now - refusal.said_at).total_seconds() >= constants.REFUSAL_BACKOFF_CAP
        log.info("%s (refusal %d in a row; next try in %.0f s)", failure.message, count, wait)
        if said != refusal.said or quiet:
            refusal.said_at, refusal.said = now, said
            return [events.of(failure.reason, f"{failure.message} (creates back off: next try in {wait:.0f} s)")]
        return []

    async def keep(self, job: JobRef, decided: Plan) -> None:
        """Mark the failed pods the plan keeps, so no later reconcile (of any replica) counts them again."""
        for kept in decided.keep:
            patch = {"metadata": {"annotations": {constants.ANNOTATION_ACCOUNTED: kept.verdict}}}
            try:
                await self.api.patch("v1", "Pod", job.namespace, kept.name, patch)
            except ApiError as exc:
                if exc.status != 404:  # gone meanwhile: nothing to keep
                    raise

    async def _secret(self, job: JobRef, memory: JobMemory, now: datetime) -> CreateFailure | None:
        """Make the job's etcd certificates and their Secret, unless made already; what went wrong, if the
        API refused or the name is taken.

        The operator may create Secrets in job namespaces but read none (least privilege), so a
        Secret is taken to be the job's own once the job's status records it (`status.etcdSecret`,
        written with the first status after it was made: a suspended job resumed by a restarted
        operator has its Secret and no etcd), this process made it, or the job's etcd Deployment
        (made only after it) exists; a name that exists otherwise is reported, not used."""
        key = f"Secret/{job.tls_secret}"
        recorded = ((memory.body or {}).get("status") or {}).get("etcdSecret") == job.tls_secret
        if memory.secret_made or recorded or self.caches.owned("Deployment", job.namespace, memory.uid):
            memory.secret_made = True
            return None
        bundle = await asyncio.to_thread(certs.etcd_certificates, job.etcd_name, job.namespace, self.certificates)
        try:
            made = await self.api.create(builders.etcd_secret(job, bundle))
        except ApiError as exc:
            if exc.transient:
                raise
            return CreateFailure(
                key, conditions.FAILED_CREATE, f"Secret {job.namespace}/{job.tls_secret} was refused: {exc}", now
            )
        if made is None:  # 409
            message = (
                f"Secret {job.namespace}/{job.tls_secret} exists and this job's etcd does not: the operator does not "
                "read Secrets, so it cannot tell whose it is; delete it (it is made again) or rename the job"
            )
            return CreateFailure(key, conditions.NAME_TAKEN, message, now)
        memory.failures.pop(key, None)
        memory.secret_made = True
        return None

    async def _create(self, job: JobRef, obj: dict[str, Any], memory: JobMemory, now: datetime) -> CreateFailure | None:
        """Create one object; what went wrong, if the API refused it or the name is someone else's."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        key = f"{kind}/{name}"
        try:
            created = await self.api.create(obj)
        except ApiError as exc:
            if exc.transient:
                raise  # the API's trouble, not the object's: kopf retries the handler
            return CreateFailure(
                key, conditions.FAILED_CREATE, f"{kind} {job.namespace}/{name} was refused: {exc}", now
            )
        if created is None:  # 409: the name exists; the cache did not show it as this job's, so ask once
            existing = await self.api.get(obj["apiVersion"], kind, job.namespace, name)
            if existing is None or (owner(existing) or ("", ""))[1] != job.uid:
                message = f"{kind} {job.namespace}/{name} exists and is not owned by this job; rename or delete it"
                return CreateFailure(key, conditions.NAME_TAKEN, message, now)
            created = existing  # ours, made by an earlier reconcile the cache has not caught up with
        memory.failures.pop(key, None)
        memory.created[key] = (created, time.monotonic())
        memory.created_at = time.monotonic()
        return None

    async def write_status(self, job: JobRef, memory: JobMemory, new: Mapping[str, Any], version: str) -> bool:
        """Write the status if the job is still at `version`, the one it was planned from; False if it
        changed meanwhile (another writer: a replica overlapping this one, kopf's own annotations, an
        edit), so the caller reads it again and plans afresh rather than count anything twice."""
        try:
            stored = await self.api.patch_status(
                constants.API_VERSION, constants.PLURAL, job.namespace, job.name, dict(new), resource_version=version
            )
        except ApiError as exc:
            if exc.status == 409:
                log.info("job %s/%s changed since it was read; reading it again", job.namespace, job.name)
                memory.body = None
                return False
            if exc.status != 404:  # the job was deleted meanwhile
                raise
            return True
        if memory.body is not None and isinstance(stored, dict) and stored.get("metadata"):
            memory.body = compact(stored)  # what the ticker re-plans from, at its new version
        elif memory.body is not None:
            merged = {**(memory.body.get("status") or {}), **new}
            memory.body = {**memory.body, "status": {k: v for k, v in merged.items() if v is not None}}
        return True


def slow_start(objects: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The creates in the order to send them: runs of worker pods in batches of 1, 2, 4 ... (the
    ReplicaSet controller's slowStartBatch, initial size 1), any other object alone."""
    batches: list[list[dict[str, Any]]] = []
    size, open_batch = 1, False
    for obj in objects:
        if obj["kind"] != "Pod":
            batches.append([obj])
            open_batch = False
        elif open_batch and len(batches[-1]) < size:
            batches[-1].append(obj)
        else:
            if open_batch:
                size *= 2
            batches.append([obj])
            open_batch = True
    return batches


def _without_names(message: str) -> str:
    """An API refusal's message without the object's name, to tell one refusal from another."""
    return re.sub(r'"[^"]*"', '""', message)


def _mounts(obj: Mapping[str, Any], secret: str) -> bool:
    """Whether a pod, or a Deployment's pods, mount the named Secret."""
    spec = obj.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") or {} if obj.get("kind") == "Deployment" else spec
    return any((v.get("secret") or {}).get("secretName") == secret for v in pod.get("volumes") or [])
