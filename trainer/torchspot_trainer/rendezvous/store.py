"""The key-value store the agents share, kept in etcd instead of in a worker.

torch's agents exchange the workers' master address and port, rank assignments and
the exit barrier through a c10d `Store`. With the `c10d` backend that store is a
TCPStore inside one agent, so losing that node loses it. Here every key lives in
etcd under `<run prefix>store/`, attached to the writer's lease.

A blocking read watches the store's prefix while it waits, so it returns when the key is
written, not at its next poll (a round's set-up waits on several keys in a row; polls of
20-100 ms added up to a tenth of a second or more). The poll stays as the fallback while no
watch can be opened.

While the agent sets a round up (the handler's `setting_up`), a blocking read also gives up
(`RoundAbandoned`) once the round it belongs to lost a member or moved on: the keys a frozen or
killed member owed will never come, and torch's agent would wait out the store timeout (300 s)
before failing: a node frozen as its round completes would hold the survivor's agent in torch's
rank assignment while its worker trains on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch._C._distributed_c10d import Store
from torch.distributed import DistStoreError

from torchspot_trainer.rendezvous.backend import RunLease, with_lease
from torchspot_trainer.rendezvous.etcd_client import CasResult, EtcdClient, EtcdError
from torchspot_trainer.rendezvous.settings import EtcdV3Settings

_MAX_POLL = 0.1
_WATCHED_WAIT = 1.0
"""With a watch open, the longest a blocking read sleeps before it reads again anyway."""


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RoundAbandoned(DistStoreError):
    """A blocking read given up because the round being set up lost a member or moved on (`abandon_when`)."""


class EtcdStore(Store):
    """A c10d Store on etcd v3. Blocking reads poll with a short, growing interval.

    :param client: the etcd client (owned by the caller).
    :param settings: backend settings; keys go under `<run prefix>store/`.
    :param lease: the lease writes are attached to, so abandoned keys expire.
    """

    def __init__(self, client: EtcdClient, settings: EtcdV3Settings, lease: RunLease) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._lease = lease
        self._prefix = f"{settings.run_prefix}store/"
        self._poll = settings.store_poll_interval
        self._abandoned: Callable[[], str | None] | None = None
        self._reads: set[threading.Event] = set()
        """The wake-ups of the blocking reads waiting now (`look_again`)."""
        self._reads_lock = threading.Lock()

    def abandon_when(self, check: Callable[[], str | None] | None) -> None:
        """While `check` is set, a blocking read asks it each time it looks again (at a write under the
        store's prefix, at `look_again`, or within `_WATCHED_WAIT`) and raises RoundAbandoned with the
        reason it names."""
        self._abandoned = check

    def look_again(self) -> None:
        """Wake every blocking read to look again now, `abandon_when`'s check included. The handler calls
        it when the rendezvous state is written: a read waiting for a member that the write took out
        of the round otherwise asked only at its next wake-up, up to `_WATCHED_WAIT` later, and the
        survivors' set-up of the next round waited that long."""
        with self._reads_lock:
            for wake in self._reads:
                wake.set()

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        """Write a key."""
        data = _as_bytes(value)
        with_lease(self._lease, lambda lease: self._client.put(self._key(key), data, lease=lease))

    def get(self, key: str) -> bytes:
        """Return a key's value, waiting up to the store timeout for it to appear."""
        return self._wait_for([key], self._timeout())[key]

    def add(self, key: str, value: int) -> int:
        """Atomically add `value` to an integer key (created at 0) and return the result."""
        full = self._key(key)
        while True:
            kv = self._client.get(full)
            current = int(kv.value) if kv else 0
            new = str(current + value).encode()
            expected = kv.mod_revision if kv else None

            def write(lease: int, new: bytes = new, expected: int | None = expected) -> CasResult:
                return self._client.compare_and_swap(full, new, expected_revision=expected, lease=lease)

            if with_lease(self._lease, write).succeeded:
                return current + value

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set `key` to `desired_value` if it holds `expected_value` (or is absent and
        `expected_value` is empty); return the value the key holds afterwards."""
        full = self._key(key)
        expected = _as_bytes(expected_value)
        desired = _as_bytes(desired_value)
        while True:
            kv = self._client.get(full)
            if kv is None and expected:
                return expected
            if kv is not None and kv.value != expected:
                return kv.value
            revision = None if kv is None else kv.mod_revision

            def write(lease: int, revision: int | None = revision) -> CasResult:
                return self._client.compare_and_swap(full, desired, expected_revision=revision, lease=lease)

            if with_lease(self._lease, write).succeeded:
                return desired

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists, or raise DistStoreError after the timeout."""
        self._wait_for(keys, timeout or self._timeout())

    def check(self, keys: list[str]) -> bool:
        """True if every key exists now."""
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        """Delete a key; True if it existed."""
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        """The number of keys in this run's store."""
        return len(self._client.get_prefix(self._prefix))

    # torch's pybind trampoline looks these up by their C++ names when the store is
    # wrapped (PrefixStore), so expose them under both names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def _timeout(self) -> timedelta:
        """The store timeout torch set (`Store.timeout` exists at run time; the stub omits it)."""
        value: timedelta = self.timeout  # type: ignore[attr-defined]
        return value

    def _read_missing(self, keys: list[str], found: dict[str, bytes]) -> None:
        """Add to `found` the keys of `keys` that exist now (none while etcd is briefly unreachable)."""
        try:
            for key in keys:
                if key not in found:
                    kv = self._client.get(self._key(key))
                    if kv is not None:
                        found[key] = kv.value
        except EtcdError:
            pass  # keep waiting until the deadline

    def _wait_for(self, keys: list[str], timeout: timedelta) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        found: dict[str, bytes] = {}
        delay = self._poll
        written = threading.Event()
        watch: list[int] = []  # the open watch's id, if any

        def on_change(change: list[str] | EtcdError) -> None:
            if isinstance(change, EtcdError):
                watch.clear()  # the stream ended: the poll takes over
            written.set()

        with self._reads_lock:
            self._reads.add(written)
        try:
            while True:
                self._read_missing(keys, found)
                if len(found) == len(keys):
                    return found
                reason = self._abandoned() if self._abandoned is not None else None
                if reason is not None:
                    missing = sorted(set(keys) - set(found))
                    raise RoundAbandoned(f"gave up waiting for keys {missing} in the etcd store: {reason}")
                now = time.monotonic()
                if now >= deadline:
                    missing = sorted(set(keys) - set(found))
                    raise DistStoreError(
                        f"timed out after {timeout.total_seconds():g} s waiting for keys {missing} "
                        f"in the etcd store at {self._client.endpoint}"
                    )
                if not watch:
                    with contextlib.suppress(EtcdError):  # no watch: the poll below
                        watch.append(self._client.watch(self._prefix, on_change, prefix=True))
                        continue  # read once more: a key written before the watch opened is not missed
                written.wait(min(_WATCHED_WAIT if watch else delay, max(deadline - now, 0.0)))
                written.clear()
                delay = min(delay * 1.5, _MAX_POLL)
        finally:
            with self._reads_lock:
                self._reads.discard(written)
            for watch_id in watch:
                with contextlib.suppress(EtcdError):
                    self._client.cancel_watch(watch_id)
