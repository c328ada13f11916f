"""The `etcd-v3` rendezvous backend: torch's dynamic rendezvous state, kept in etcd v3.

torch.distributed.elastic's `DynamicRendezvousHandler` keeps the whole rendezvous
(round, participants, wait list, heartbeats) in one opaque blob and needs only a
compare-and-set on it. We store that blob under `<run prefix>state`. The key's etcd
`mod_revision` is the fencing token: a write succeeds only if nobody wrote since the
writer read, so a node that was frozen and wakes up with an old view can never
overwrite the current round.

Every key a run writes is attached to a lease that the writing agent keeps alive.
While any agent of the run lives, the state key is rewritten by its heartbeats under
a live lease; when every agent is gone, the keys expire after `lease_ttl`.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError, EtcdLeaseNotFoundError
from torchspot_trainer.rendezvous.settings import BACKEND_NAME, EtcdV3Settings

log = logging.getLogger(__name__)

T = TypeVar("T")


class RunLease:
    """The lease this agent attaches its writes to, refreshed as it is used.

    Refreshing on use (rather than from a thread of its own) means a frozen agent
    stops refreshing exactly when it stops heartbeating. If etcd no longer knows the
    lease (it expired while we were stopped, or etcd lost its data), a new one is
    granted on the next write.
    """

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        self._client = client
        self._ttl = ttl
        self._id: int | None = None
        self._refreshed_at = 0.0
        self._lock = threading.Lock()

    def id(self) -> int:
        """The current lease id, granting or refreshing it when due."""
        with self._lock:
            now = time.monotonic()
            if self._id is None:
                self._id = self._client.grant_lease(self._ttl)
                self._refreshed_at = now
            elif now - self._refreshed_at > self._ttl / 3:
                if not self._client.refresh_lease(self._id):
                    self._id = self._client.grant_lease(self._ttl)
                self._refreshed_at = now
            return self._id

    def forget(self) -> None:
        """Drop the lease id after etcd reported it unknown, so the next write re-grants."""
        with self._lock:
            self._id = None


def forgive_heartbeats(bits: bytes, ended: datetime) -> bytes:
    """torch's state blob with every heartbeat older than `ended` moved up to it. Pure."""
    state = pickle.loads(bits)  # noqa: S301 - torch's own state blob, written by our agents
    state.last_heartbeats = {node: max(beat, ended) for node, beat in state.last_heartbeats.items()}
    return pickle.dumps(state)


def with_lease(lease: RunLease, write: Callable[[int], T]) -> T:
    """Run `write(lease_id)`, re-granting the lease once if etcd lost it."""
    try:
        return write(lease.id())
    except EtcdLeaseNotFoundError:
        lease.forget()
        return write(lease.id())


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Compare-and-set storage of the rendezvous state in etcd v3.

    :param client: the etcd client (owned by the caller).
    :param settings: backend settings; `run_prefix` scopes the keys to one run id.
    :param lease: the lease this agent attaches its writes to.
    """

    def __init__(self, client: EtcdClient, settings: EtcdV3Settings, lease: RunLease) -> None:
        self._client = client
        self._settings = settings
        self._lease = lease
        self.key = f"{settings.run_prefix}state"
        self._failing_since: float | None = None
        self._outage_ended_wall: datetime | None = None
        self._outage_ended_mono = 0.0

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        kv = self._call(lambda: self._client.get(self.key))
        if kv is None:
            return None
        return self._forgive_outage(kv.value), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class. `token` is the mod revision the caller read, or None for a new key.

        A write made while we are cut off from etcd is torch's pending one: its first try
        failed when the outage began, and torch retries the same state (our own heartbeat
        and everyone else's as old as the outage) until one goes through. That state is
        forgiven before it is written, as the ones we read are (`_forgive_outage`): written
        as it was, it lands (nobody else wrote since, so the token still matches) and torch
        then finds every member dead, itself included, and starts a new round (a test's
        5 s outage restarted the workers that way).
        """
        expected = token if isinstance(token, int) else None
        if self._failing_since is not None:
            state = forgive_heartbeats(state, datetime.now(UTC))
        result = self._call(
            lambda: with_lease(
                self._lease,
                lambda lease_id: self._client.compare_and_swap(
                    self.key, state, expected_revision=expected, lease=lease_id
                ),
            )
        )
        if result.current is None:
            return None
        value = state if result.succeeded else self._forgive_outage(result.current.value)
        return value, result.current.mod_revision, result.succeeded

    def _call(self, fn: Callable[[], T]) -> T:
        """Run one etcd call, tracking outages and mapping failures to torch's error type."""
        try:
            result: T = fn()
        except EtcdError as exc:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                log.warning("rendezvous: lost contact with etcd (%s)", exc)
            raise RendezvousConnectionError(str(exc)) from exc
        if self._failing_since is not None:
            outage = time.monotonic() - self._failing_since
            log.warning("rendezvous: etcd reachable again after %.1f s", outage)
            self._failing_since = None
            self._outage_ended_wall = datetime.now(UTC)
            self._outage_ended_mono = time.monotonic()
        return result

    def _forgive_outage(self, bits: bytes) -> bytes:
        """Do not count an etcd outage as missed heartbeats.

        While etcd is down no node can heartbeat. Right after it returns, every node's
        last heartbeat looks stale and torch would drop all of them from the round,
        restarting a job that was training fine. For one detection window after our
        own outage ends, we read heartbeats older than the outage's end as if they
        were sent at that moment; nodes that are really gone are then detected one
        window later.
        """
        ended = self._outage_ended_wall
        if ended is None:
            return bits
        if time.monotonic() - self._outage_ended_mono > self._settings.dead_after * 2:
            self._outage_ended_wall = None
            return bits
        return forgive_heartbeats(bits, ended)
