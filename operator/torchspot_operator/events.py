"""The Events the operator posts on a job, each reason with its type and when it comes: one place, which the
code posts from (`Reason.event`), the docs' reference page is generated from (tools/docs_reference.py) and a
test holds the code to (no Event type or reason written as a literal elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from torchspot_operator import conditions, constants

__all__ = ["EVENTS", "Reason", "of"]


@dataclass(frozen=True)
class Reason:
    """One Event reason: its name (the Event's `reason`), its type, and when it comes."""

    name: str
    type: Literal["Normal", "Warning"]
    when: str

    def event(self, message: str) -> tuple[str, str, str]:
        """(type, reason, message): what an Event is posted from."""
        return (self.type, self.name, message)


SCALED_UP: Final = Reason("ScaledUp", "Normal", "a worker pod created to reach the desired number")
REPLACED: Final = Reason("Replaced", "Normal", "a worker pod created in place of one the cluster took or that failed")
SCALED_DOWN: Final = Reason(
    "ScaledDown", "Normal", "a worker pod deleted above the desired number (whole replica groups kept first)"
)
UPDATED: Final = Reason(
    "Updated", "Normal", "one of the managed etcd's objects updated in place to the job's current spec"
)
SUSPENDED: Final = Reason("Suspended", "Normal", "the job suspended: its worker pods, then its managed etcd, stopped")
RESUMED: Final = Reason("Resumed", "Normal", "the job resumed: a fresh rendezvous, training from its last checkpoint")
SUCCEEDED: Final = Reason(conditions.PHASE_SUCCEEDED, "Normal", "the run completed: a worker exited 0")
FAILED: Final = Reason(conditions.PHASE_FAILED, "Warning", "the job failed, with the reason its Failed condition gives")
EVICTED: Final = Reason(
    "Evicted", "Warning", "a worker pod the cluster took (a spot eviction, a node lost or drained, a deletion)"
)
NODE_FAULT: Final = Reason(
    constants.NODE_FAULT_REASON, "Warning", "a worker's node cannot run the program (exit 75): replaced off that node"
)
WORKER_FAILED: Final = Reason(
    "WorkerFailed", "Warning", "a worker pod failed through its program's fault: counted against maxRestarts"
)
BACK_OFF: Final = Reason(
    "BackOff", "Warning", "replacements held back after consecutive failures (10 s doubling to 5 minutes)"
)
NAME_TAKEN: Final = Reason(
    conditions.NAME_TAKEN, "Warning", "an object the job needs has a name another object holds: it is not taken"
)
FAILED_CREATE: Final = Reason(
    conditions.FAILED_CREATE, "Warning", "the API refused a create (a quota, a policy): creates back off"
)
DRIFTED: Final = Reason("Drifted", "Warning", "the managed etcd was changed by someone else: set back")
INVALID_SPEC: Final = Reason(
    conditions.INVALID_SPEC, "Warning", "the spec fails a check the operator makes; the message names the field"
)

_LISTED: Final = (SCALED_UP, REPLACED, SCALED_DOWN, UPDATED, SUSPENDED, RESUMED, SUCCEEDED, FAILED, EVICTED,
                  NODE_FAULT, WORKER_FAILED, BACK_OFF, NAME_TAKEN, FAILED_CREATE, DRIFTED, INVALID_SPEC)  # fmt: skip
EVENTS: Final[dict[str, Reason]] = {reason.name: reason for reason in _LISTED}
"""Every Event the operator posts on a job, by reason, in the order the docs' reference lists them."""


def of(reason: str, message: str) -> tuple[str, str, str]:
    """The Event of a reason known only at run time (a job's final phase, a refused create's): one of
    `EVENTS` (KeyError otherwise: a reason posted unlisted would be missing from the reference)."""
    return EVENTS[reason].event(message)
