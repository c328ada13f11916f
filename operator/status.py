"""Conditions and phase of an ElasticJob. Pure.

A condition's `lastTransitionTime` changes only when its status flips; a new reason
or message alone keeps it (as Kubernetes' own controllers do), so `kubectl describe`
says since when a job has been below its minimum, not when it was last looked at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from torchspot.operator.spec import JobSpec

CREATED = "Created"
RUNNING = "Running"
BELOW_MIN = "BelowMin"
SCALING = "Scaling"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
INVALID_SPEC = "InvalidSpec"
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
"""Phases a job never leaves: nothing is created for it any more, its managed etcd goes."""


def timestamp(when: datetime) -> str:
    """RFC 3339 in UTC with a Z, as Kubernetes writes times."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(text: str) -> datetime:
    """The inverse of `timestamp` (also takes fractional seconds and offsets)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def set_condition(  # noqa: PLR0917 - reads as a sentence: set <kind> to <value> because <reason>: <message>
    conditions: Sequence[Mapping[str, Any]], kind: str, value: bool, reason: str, message: str, now: datetime
) -> list[dict[str, Any]]:
    """A copy of `conditions` with `kind` set; its transition time moves only if its status flips."""
    text = "True" if value else "False"
    result: list[dict[str, Any]] = []
    found = False
    for condition in conditions:
        if condition.get("type") != kind:
            result.append(dict(condition))
            continue
        found = True
        changed = condition.get("status") != text
        result.append({
            "type": kind, "status": text, "reason": reason, "message": message,
            "lastTransitionTime": timestamp(now) if changed else condition.get("lastTransitionTime", timestamp(now)),
        })  # fmt: skip
    if not found:
        result.append(
            {"type": kind, "status": text, "reason": reason, "message": message, "lastTransitionTime": timestamp(now)}
        )
    return result


def invalid(conditions: Sequence[Mapping[str, Any]], problems: Sequence[str], now: datetime) -> dict[str, Any]:
    """The status of a job whose spec cannot be run: phase Invalid and every problem in the message."""
    updated = set_condition(conditions, INVALID_SPEC, True, "InvalidSpec", "; ".join(problems), now)
    return {"phase": "Invalid", "conditions": updated}


def conditions_for(
    old: Sequence[Mapping[str, Any]],
    now: datetime,
    *,
    ready: int,
    desired: int,
    spec: JobSpec,
    started: bool,
    succeeded: bool,
    finishing: bool,
    failed_reason: tuple[str, str] | None,
) -> tuple[str, list[dict[str, Any]]]:
    """The phase and the full set of conditions for what reconcile saw.

    `started`: the job reached minReplicas before (below it now it is BelowMin, not Pending).
    """
    conditions = set_condition(old, INVALID_SPEC, False, "SpecValid", "the spec is valid", now)
    conditions = set_condition(conditions, CREATED, True, "ObjectsCreated", "the job's objects were created", now)
    if failed_reason is not None:
        reason, message = failed_reason
        conditions = set_condition(conditions, FAILED, True, reason, message, now)
        conditions = set_condition(conditions, RUNNING, False, reason, "the job failed", now)
        conditions = set_condition(conditions, SCALING, False, reason, "the job failed", now)
        return "Failed", conditions
    if succeeded or finishing:
        message = "a worker finished the run with exit code 0" + ("" if succeeded else "; waiting for the others")
        conditions = set_condition(conditions, SUCCEEDED, succeeded, "RunCompleted", message, now)
        conditions = set_condition(conditions, RUNNING, not succeeded, "RunCompleted", message, now)
        conditions = set_condition(conditions, SCALING, False, "RunCompleted", message, now)
        conditions = set_condition(conditions, BELOW_MIN, False, "RunCompleted", message, now)
        return ("Succeeded" if succeeded else "Running"), conditions
    below = ready < spec.min_replicas
    conditions = set_condition(
        conditions, BELOW_MIN, below, "NotEnoughWorkers" if below else "EnoughWorkers",
        f"{ready} ready worker(s), minReplicas {spec.min_replicas}", now,
    )  # fmt: skip
    conditions = set_condition(
        conditions, RUNNING, not below, "Training" if not below else "WaitingForWorkers",
        f"training with {ready} worker(s)" if not below else f"{ready} of at least {spec.min_replicas} ready", now,
    )  # fmt: skip
    scaling = ready != desired
    conditions = set_condition(
        conditions, SCALING, scaling, "ScalingToDesired" if scaling else "AtDesired",
        f"{ready} ready of {desired} desired", now,
    )  # fmt: skip
    if below:
        return ("BelowMin" if started else "Pending"), conditions
    return ("Scaling" if scaling else "Running"), conditions
