"""What the controller remembers of one job between reconciles (`JobMemory`), and its creates' refusal
backoff (`Refusal`): the expectations, the uids counted or deleted, what could not be created, the
versions its etcd objects are known to hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from torchspot_operator import conditions
from torchspot_operator.conditions import CreateFailure

__all__ = ["JobMemory", "Refusal"]


@dataclass
class Refusal:
    """Creates of one job the API refused in a row: the backoff before the next try, and what was said.

    One per job, not per object: the next try is one object (the first refusal stops the rest), under the
    same name; its outcome resets the backoff or doubles it. The status says how many, not which.
    """

    count: int
    message: str
    until: datetime
    said_at: datetime | None = None
    said: str = ""

    def failure(self) -> CreateFailure:
        """The ReplicaFailure entry: a count and the API's last word, no growing list of names."""
        message = (
            f"{self.count} create(s) refused in a row, next try at {conditions.timestamp(self.until)}: {self.message}"
        )
        return CreateFailure("refused", conditions.FAILED_CREATE, message, self.until)


@dataclass
class JobMemory:
    """What the controller knows about one incarnation (uid) of a job between reconciles."""

    uid: str
    body: dict[str, Any] | None = None
    """The job as last read, with the status written since: what the timer re-plans from."""
    accounted: dict[str, float] = field(default_factory=dict)
    """Uids of objects counted or deleted by the operator (monotonic time): never judged twice."""
    deleted: dict[str, float] = field(default_factory=dict)
    """Uids of pods the operator deleted (monotonic time): their DELETED events are not someone else's
    deletions, even after a refused status write made the plan that deleted them be judged again."""
    created: dict[str, tuple[dict[str, Any], float]] = field(default_factory=dict)
    """Objects created and not yet seen in a cache, by `Kind/name`: counted as there meanwhile."""
    vanished: list[dict[str, Any]] = field(default_factory=list)
    """Worker pods deleted by someone else (their last body), until a reconcile counts them."""
    failures: dict[str, CreateFailure] = field(default_factory=dict)
    """Objects the operator could not create, by `Kind/name`."""
    seen_at: float = 0.0
    """When a reconcile or a tick last looked at the job (monotonic); 0: never (read afresh)."""
    verified_at: float = 0.0
    """When the job's objects were last read from the API (monotonic); 0: never."""
    created_at: float = 0.0
    """When a create of this job last returned (monotonic): a namespace snapshot older than that misses it."""
    refusal: Refusal | None = None
    """The API's refusals of this job's creates, and the backoff they earned."""
    etcd_pods: list[dict[str, Any]] = field(default_factory=list)
    etcd_pods_at: float = 0.0
    """The managed etcd's pods, read while its Deployment has none available (at most once a minute)."""
    applied: dict[str, str] = field(default_factory=dict)
    """The resourceVersion at which each etcd object (by uid) is known to hold the build of `built_for`
    (see `Observed.applied`)."""
    built_for: tuple[int, int] = (0, 0)
    """The job's (generation, resumes) that `applied` holds for: what the etcd objects are built from,
    with the job's uid and the operator's settings, which do not change for a memory."""
    generation: int = 0
    """The job's `metadata.generation` as last reconciled: an event with another one is a spec change."""
    secret_made: bool = False
    """Whether the job's etcd Secret is known to be its own (made by this process, or its etcd exists)."""
