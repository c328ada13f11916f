"""Which replica leads: read from kopf's peering object, as kopf itself reads it. Pure.

kopf pauses a replica while a live peer of higher priority is recorded in the peering object's
status, but tells its handlers nothing; the operator needs to know too, so that a paused standby
neither fails its own liveness probe (its reconciles stopped on purpose) nor reports the jobs'
phases beside the leader (`torchspot_jobs` counted twice).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from torchspot_operator import conditions


def outranked_by(peers: Mapping[str, Any], priority: int, now: datetime) -> list[str]:
    """The live peers of higher priority than `priority` in a peering object's status (kopf's record
    per replica: `priority`, `lastseen`, `lifetime`); a replica is paused while there is any.

    A peer of equal priority is left out: that is this replica itself (start priorities are unique);
    kopf pauses both of two replicas given the same `--priority` by hand, which this does not see."""
    found = []
    for identity, record in peers.items():
        if not isinstance(record, Mapping):
            continue
        try:
            their = int(record.get("priority", 0))
            seen = conditions.parse_timestamp(str(record["lastseen"]))
            seen = seen if seen.tzinfo is not None else seen.replace(tzinfo=UTC)
            lifetime = timedelta(seconds=int(record.get("lifetime", 60)))
        except (KeyError, TypeError, ValueError):
            continue  # not a record kopf wrote
        if their > priority and seen + lifetime > now:
            found.append(identity)
    return sorted(found)
