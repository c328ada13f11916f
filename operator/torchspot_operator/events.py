"""The Events the operator posts on a job, each reason with its type and when it comes: one place, which the
docs' reference page is generated from (tools/docs_reference.py) and a test holds the code to."""

from __future__ import annotations

from typing import Final

from torchspot_operator import conditions, constants

EVENTS: Final[dict[str, tuple[str, str]]] = {
    "ScaledUp": ("Normal", "a worker pod created to reach the desired number"),
    "Replaced": ("Normal", "a worker pod created in place of one the cluster took or that failed"),
    "ScaledDown": ("Normal", "a worker pod deleted above the desired number (whole replica groups kept first)"),
    "Updated": ("Normal", "one of the managed etcd's objects updated in place to the job's current spec"),
    "Suspended": ("Normal", "the job suspended: its worker pods, then its managed etcd, stopped"),
    "Resumed": ("Normal", "the job resumed: a fresh rendezvous, training from its last checkpoint"),
    conditions.PHASE_SUCCEEDED: ("Normal", "the run completed: a worker exited 0"),
    conditions.PHASE_FAILED: ("Warning", "the job failed, with the reason its Failed condition gives"),
    "Evicted": ("Warning", "a worker pod the cluster took (a spot eviction, a node lost or drained, a deletion)"),
    constants.NODE_FAULT_REASON: (
        "Warning",
        "a worker's node cannot run the program (exit 75): replaced off that node",
    ),
    "WorkerFailed": ("Warning", "a worker pod failed through its program's fault: counted against maxRestarts"),
    "BackOff": ("Warning", "replacements held back after consecutive failures (10 s doubling to 5 minutes)"),
    conditions.NAME_TAKEN: ("Warning", "an object the job needs has a name another object holds: it is not taken"),
    conditions.FAILED_CREATE: ("Warning", "the API refused a create (a quota, a policy): creates back off"),
    "Drifted": ("Warning", "the managed etcd was changed by someone else: set back"),
    conditions.INVALID_SPEC: ("Warning", "the spec fails a check the operator makes; the message names the field"),
}
"""Every Event the operator posts on a job: reason -> (type, when). The docs' reference lists them from here;
a test finds each reason the operator's code names here."""
