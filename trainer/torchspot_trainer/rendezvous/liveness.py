"""Detection of a lost node in about a second, without waiting for torch's heartbeat expiry.

torch drops a node only when its heartbeat in the state blob is `dead_after` (3 s) old; a shorter
heartbeat would make every agent rewrite the whole blob several times a second by compare-and-set.
Instead each agent puts a key of its own, `<run prefix>alive/<node>`, every `liveness_interval` (0.2 s),
and watches the prefix. A node is judged by when *this* agent received its last put (local monotonic
time: clocks never matter); a member silent for `liveness_timeout` (1 s) is taken out of the state with
one compare-and-set (handler.py). torch's heartbeat stays the backstop.

No false alarms, by construction:
- **This agent must be able to see**: it judges only while its own puts come back through the watch
  within half the timeout (a starved or cut-off agent judges nobody); a (re)opened watch starts every
  node afresh, so an etcd restart is no loss.
- **A pause shorter than the timeout is no loss**: the next put resets a node's age.
- **What etcd holds up counts against nobody**: however long our own puts were held up lately
  (`held_up`) is added to every member's timeout, since theirs waited in the same etcd.
- **Corroboration shortens the wait, never decides alone**: after a local worker's collective failed,
  the timeout is `CORROBORATED_PUTS` missed puts for `CORROBORATED_SECONDS`.
- **A completed step is a receipt from every member of its group** (`proof`): a gradient all-reduce
  completes only with every rank in it. It counts until the next step is due by the last one's
  duration (`Handover.stepped`, at most 5 s), so an agent starved during a long step is not taken out.

The same watch carries the rendezvous state key: each write calls `on_state`, so a waiting agent reads
the new state when it is written (polls remain the fallback while a watch is down). The keys live on the
agent's run lease; a finished run deletes them with the rest of its prefix.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from torchspot_trainer.rendezvous.backend import RunLease, with_lease
from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError

log = logging.getLogger(__name__)

ALIVE = "alive/"
"""Under the run prefix: one key per agent, put every liveness_interval."""
CORROBORATED_PUTS = 2.5
"""After a local failure, a member is lost once this many of its puts are missing."""
CORROBORATED_SECONDS = 5.0
"""How long a local failure shortens the timeout: the re-form it starts is over by then."""
_WARN_EVERY = 10.0


def stale_members(
    receipts: Mapping[str, float],
    members: Iterable[str],
    me: str,
    now: float,
    timeout: float,
    *,
    held: float = 0.0,
    proven: float | None = None,
) -> list[str]:
    """The members whose last liveness put arrived more than `timeout` seconds, and `held` more,
    before `now`. Pure.

    Nobody while our own last put is older than `timeout / 2` (we cannot see: starved, cut off,
    or a lagging watch), and never a member we have not heard from since the watch opened
    (`receipts` lacks it: torch's heartbeat judges it). `held`: how long etcd held our own puts up
    lately (`held_up`). `proven`: when a local worker last completed a step with all of `members`
    (module docstring), a receipt from each.
    """
    own = receipts.get(me)
    if own is None or now - own > timeout / 2:
        return []
    last = receipts if proven is None else {m: max(at, proven) for m, at in receipts.items()}
    return sorted(m for m in members if m != me and m in last and now - last[m] > timeout + held)


def held_up(arrivals: Sequence[float], now: float, interval: float, window: float) -> float:
    """How long our own puts were held up lately: the most one of them arrived later than `interval`
    after the one before, among those that arrived within `window` seconds of `now`, or the one due
    now is overdue (`arrivals`: our puts' receipt times, oldest first). Pure. A put loop waits its
    interval after each put returns, so while etcd answers this is its latency: milliseconds."""
    late = now - arrivals[-1] - interval if arrivals else 0.0
    for before, after in itertools.pairwise(arrivals):
        if now - after <= window:
            late = max(late, after - before - interval)
    return max(late, 0.0)


class Liveness:
    """This agent's liveness key, and its judgement of the others' (module docstring).

    :param members: the names of the nodes to judge now (our round's, or the previous one's
        while a new round forms); called from the judging thread.
    :param evict: takes a lost node out of the rendezvous (or finds it gone already); an exception
        means the next look tries again.
    :param state_key: the rendezvous state's key, and `on_state`, called on the watch thread
        whenever it is written (quickly: it delays the next liveness receipt).
    :param proof: when (on the monotonic clock) a local worker last completed a step with all of
        `members()`, or None (module docstring); called from the judging thread.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        me: str,
        lease: RunLease,
        *,
        interval: float,
        timeout: float,
        members: Callable[[], frozenset[str]],
        evict: Callable[[str], None],
        state_key: str,
        on_state: Callable[[], None],
        proof: Callable[[], float | None] = lambda: None,
        failures: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self._prefix = f"{prefix}{ALIVE}"
        self._me = me
        self._lease = lease
        self._interval = interval
        self._timeout = timeout
        self._members = members
        self._evict = evict
        self._state_key = state_key
        self._on_state = on_state
        self._proof = proof
        self._failures = failures
        self._receipts: dict[str, float] = {}
        self._own: deque[float] = deque(maxlen=int(timeout / interval) + 2)
        """Our own puts' recent receipt times (`held_up`)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch_ids: list[int] = []
        self._watch_broken = True
        self._short_until = 0.0
        self._evicted: set[str] = set()
        self._last_warning = 0.0
        self._threads = [
            threading.Thread(target=self._put_loop, name="torchspot-liveness-put", daemon=True),
            threading.Thread(target=self._judge_loop, name="torchspot-liveness-judge", daemon=True),
        ]

    def start(self) -> None:
        """Start putting our key and judging the others'."""
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop both (our key then ages: the others judge us gone unless we left first)."""
        self._stop.set()
        self._cancel_watches()

    def _cancel_watches(self) -> None:
        watches, self._watch_ids = self._watch_ids, []
        for watch in watches:
            with contextlib.suppress(EtcdError):  # a watch whose stream ended is gone already
                self._client.cancel_watch(watch)

    def corroborate(self) -> None:
        """A local worker failed: judge with the short timeout for a while (module docstring)."""
        self._short_until = time.monotonic() + CORROBORATED_SECONDS

    def forget(self, names: Iterable[str]) -> None:
        """Judge these nodes afresh (a new round: an evicted name may come back as a joiner)."""
        with self._lock:
            self._evicted.difference_update(names)

    def silent(self, name: str) -> bool:
        """Whether `name` has been silent for at least CORROBORATED_PUTS puts: a node taken out for
        silence, as opposed to one that left while still putting its key. Not a node never heard from
        since the watch opened (as `stale_members`, which leaves it to torch): a node that leaves on
        notice right after joining is one, and the short grace would cost its emergency checkpoint."""
        with self._lock:
            last = self._receipts.get(name)
        return last is not None and time.monotonic() - last >= CORROBORATED_PUTS * self._interval

    def _put_loop(self) -> None:
        key = f"{self._prefix}{self._me}"
        while not self._stop.is_set():
            try:
                with_lease(self._lease, lambda lease: self._client.put(key, b"1", lease=lease))
            except EtcdError as exc:
                self._warn(f"liveness key not written ({exc})")
            self._stop.wait(self._interval)

    def _on_change(self, change: list[str] | EtcdError) -> None:
        if isinstance(change, EtcdError):
            self._watch_broken = True
            return
        now = time.monotonic()
        with self._lock:
            for key in change:
                if key.startswith(self._prefix):
                    name = key[len(self._prefix) :]
                    self._receipts[name] = now
                    if name == self._me:
                        self._own.append(now)

    def _on_state_change(self, change: list[str] | EtcdError) -> None:
        if isinstance(change, EtcdError):
            self._watch_broken = True
        elif change:
            self._on_state()

    def _open_watches(self) -> None:
        self._cancel_watches()  # the one that did not break, if any
        try:
            self._watch_ids.append(self._client.watch(self._prefix, self._on_change, prefix=True))
            self._watch_ids.append(self._client.watch(self._state_key, self._on_state_change))
        except EtcdError as exc:
            self._warn(f"liveness not watched ({exc}); torch's heartbeat judges meanwhile")
            return
        now = time.monotonic()
        with self._lock:  # heard of before the watch broke: each starts afresh
            self._receipts = dict.fromkeys(self._receipts, now)
            self._own.clear()
        self._watch_broken = False
        self._on_state()  # written while no watch was open, perhaps

    def _judge_loop(self) -> None:
        while not self._stop.wait(self._interval / 2):
            if self._watch_broken:
                self._open_watches()
                continue
            now = time.monotonic()
            with self._lock:
                receipts = dict(self._receipts)
                evicted = set(self._evicted)
                held = held_up(self._own, now, self._interval, self._timeout)
            members = self._members()
            short = CORROBORATED_PUTS * self._interval
            if now >= self._short_until and stale_members(receipts, members, self._me, now, short, held=held):
                self._failures()  # a local failure now (the agent's folder: only when a put is this late)
            timeout = min(self._timeout, short) if now < self._short_until else self._timeout
            stale = stale_members(receipts, members, self._me, now, timeout, held=held)
            if stale:  # the proof reads the agent's folder: only when a put is overdue, not every look
                stale = stale_members(receipts, members, self._me, now, timeout, held=held, proven=self._proof())
            for name in stale:
                if name in evicted:
                    continue
                age = now - receipts[name]
                log.warning("rendezvous: node %s sent no liveness for %.2f s; taking it out of the round", name, age)
                try:
                    self._evict(name)
                except Exception as exc:  # the next look tries again; torch's heartbeat is the backstop
                    self._warn(f"node {name} not evicted ({exc})")
                    continue
                with self._lock:
                    self._evicted.add(name)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY:
            self._last_warning = now
            log.warning("rendezvous: %s", message)
