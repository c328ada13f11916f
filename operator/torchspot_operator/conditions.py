"""Conditions, phases and times of an ElasticJob's status. Pure.

A condition's `lastTransitionTime` changes only when its status flips; a new reason
or message alone keeps it (as Kubernetes' own controllers do), so `kubectl describe`
says since when a job has been below its minimum, not when it was last looked at.
Messages hold nothing that changes by itself (no "for N seconds"): an unchanged job
gives an unchanged status, and the operator writes none.

The phases and what each condition says are in docs/operator.md ("Lifecycle").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

# Condition types.
CREATED: Final = "Created"
RUNNING: Final = "Running"
BELOW_MIN: Final = "BelowMin"
SCALING: Final = "Scaling"
WAITING_FOR_CAPACITY: Final = "WaitingForCapacity"
SUSPENDED: Final = "Suspended"
SUCCEEDED: Final = "Succeeded"
FAILED: Final = "Failed"
INVALID_SPEC: Final = "InvalidSpec"
STALLED: Final = "Stalled"
"""The job has its workers but makes no progress: no rendezvous round, step or checkpoint for
`failurePolicy.stallTimeoutSeconds`; the message names the likeliest cause."""
EVICTION_BUDGET: Final = "EvictionBudgetExceeded"
"""More evictions in a window than spot capacity explains, or the same suspect kind repeating:
replacements wait the failure backoff."""
REPLICA_FAILURE: Final = "ReplicaFailure"
"""An object the job needs could not be created: its name is taken by an object the job does not
own (reason NameTaken), or the API refused it (reason FailedCreate, with the API's message).
The name and meaning are those of Deployments' and ReplicaSets' own condition."""

# Phases.
PENDING: Final = "Pending"
"""Active, and minReplicas not yet reached since the start or the last resume."""
PHASE_RUNNING: Final = "Running"
PHASE_SCALING: Final = "Scaling"
PHASE_BELOW_MIN: Final = "BelowMin"
PHASE_SUSPENDED: Final = "Suspended"
PHASE_SUCCEEDED: Final = "Succeeded"
PHASE_FAILED: Final = "Failed"
PHASE_INVALID: Final = "Invalid"
FINISHED_PHASES: Final = frozenset({PHASE_SUCCEEDED, PHASE_FAILED})
"""Phases a job never leaves: nothing is created for it any more, its managed etcd goes."""

# Reasons of the Failed condition.
TOO_MANY_FAILURES: Final = "TooManyFailures"
BELOW_MIN_TOO_LONG: Final = "BelowMinTooLong"
STARTUP_TIMEOUT: Final = "StartupTimeout"
DEADLINE_EXCEEDED: Final = "DeadlineExceeded"
STALLED_TOO_LONG: Final = "Stalled"
# Reasons of the ReplicaFailure condition.
NAME_TAKEN: Final = "NameTaken"
FAILED_CREATE: Final = "FailedCreate"


@dataclass(frozen=True)
class CreateFailure:
    """An object the operator could not create, and when it last tried.

    :param key: `Kind/name`, what the status names.
    :param reason: `NAME_TAKEN` or `FAILED_CREATE`.
    :param message: for the status and the event; the API's own message for a refusal.
    """

    key: str
    reason: str
    message: str
    at: datetime


def timestamp(when: datetime) -> str:
    """RFC 3339 in UTC with a Z, as Kubernetes writes times."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def not_before(when: datetime) -> datetime:
    """`when` rounded up to the whole second: a time that `timestamp` keeps as it is. A time the status
    carries is read back in whole seconds, so a wait that ends at `when` must be written this way or
    it ends up to a second early (a 1 s backoff in a test once let a replacement come 0.3 s after the
    failure)."""
    whole = when.replace(microsecond=0)
    return whole if whole == when else whole + timedelta(seconds=1)


def parse_timestamp(text: str) -> datetime:
    """The inverse of `timestamp` (also takes fractional seconds and offsets)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def find(conditions: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    """The condition of a type, or None."""
    return next((c for c in conditions if c.get("type") == kind), None)


def is_true(conditions: Sequence[Mapping[str, Any]], kind: str) -> bool:
    """Whether a condition of this type is there with status True."""
    found = find(conditions, kind)
    return found is not None and found.get("status") == "True"


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


def clear_condition(
    conditions: Sequence[Mapping[str, Any]], kind: str, reason: str, message: str, now: datetime
) -> list[dict[str, Any]]:
    """`kind` set False if the job carries it; left out if it never did (no condition that never applied)."""
    if find(conditions, kind) is None:
        return [dict(c) for c in conditions]
    return set_condition(conditions, kind, False, reason, message, now)


def invalid(
    conditions: Sequence[Mapping[str, Any]], problems: Sequence[str], now: datetime, *, generation: int
) -> dict[str, Any]:
    """The status of a job whose spec cannot be run: phase Invalid and every problem in the message, of
    the job's `generation` (its metadata.generation)."""
    message = "; ".join(problems) + " (the CRD's schema should have refused this: is manifests/crd.yaml installed?)"
    updated = set_condition(conditions, INVALID_SPEC, True, "InvalidSpec", message, now)
    return {"phase": PHASE_INVALID, "observedGeneration": generation, "conditions": observed(updated, generation)}


def observed(conditions: Sequence[Mapping[str, Any]], generation: int) -> list[dict[str, Any]]:
    """`conditions`, each stamped with the spec's `generation` they were judged against (Kubernetes'
    `metav1.Condition.observedGeneration`): a client that changed the spec tells the conditions of its
    change from those of the spec before it."""
    return [{**condition, "observedGeneration": generation} for condition in conditions]


def replica_failure(
    conditions: Sequence[Mapping[str, Any]], failures: Sequence[CreateFailure], now: datetime
) -> list[dict[str, Any]]:
    """The ReplicaFailure condition for the objects the job could not create (none: False, if it was set)."""
    if not failures:
        return clear_condition(conditions, REPLICA_FAILURE, "Created", "every object the job needs was created", now)
    ordered = sorted(failures, key=lambda f: f.key)
    reason = NAME_TAKEN if any(f.reason == NAME_TAKEN for f in ordered) else FAILED_CREATE
    return set_condition(conditions, REPLICA_FAILURE, True, reason, "; ".join(f.message for f in ordered), now)
