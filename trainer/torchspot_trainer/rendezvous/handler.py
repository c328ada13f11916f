"""The `etcd-v3` rendezvous handler and its registration with torchrun. The rules it applies to a
round (when it ended, who is lost, when it may complete early) are pure, in rounds.py.

It reuses torch's `DynamicRendezvousHandler` (its join, wait list, heartbeat and round logic) and
changes four things it gets wrong on spot nodes (the recovery design, docs/recovery.md, says why each):

1. **A lost peer ends the round.** torch restarts workers only when a new node waits; a frozen peer
   keeps its sockets open and the survivors wait in a collective. Here `num_nodes_waiting()` also
   reports a member that stopped putting its liveness key (liveness.py: about a second; torch's
   `dead_after` is the backstop) or a round that moved on. Before it does, the agent leaves markers for
   its workers (markers.py): a peer is lost (do not wait for a boundary), the SIGTERM that follows is a
   restart (keep the state on the node), or, for an agent stopped by a signal, its node leaves (write
   the emergency checkpoint).
2. **The worker store follows rank 0 and listens first.** The rank-0 agent of every round starts a
   fresh store before it publishes its address, so no worker dials a dead host or a store not yet
   listening (torch caches the first round's address, or lets workers dial before rank 0 listens).
3. **etcd trouble is not a membership change.** While etcd is unreachable the agents train on and a
   joining agent tries again; an etcd that lost its data gets the running round written back by its
   members (`_restore`), and a join that finds the state begun again numbers its round after the one
   its node left (`_rejoined_round`): rounds, and the generations workers re-form into, only grow.
4. **Rounds form promptly.** An agent re-reads the state as soon as it is written (liveness.py's
   watch), at the latest every `state_poll_interval`; the join rules (joins.py) complete a round once
   every member of the previous one joined it or is known gone; an agent stopped by a signal leaves
   the rendezvous at once (`leave_rendezvous`) and says so under `<run prefix>departed/`.

torch's classes are extended in torch_glue.py; this subclass reads and replaces attributes of torch's
handler (`_state_holder`, `_heartbeat_lock`, `_op_executor`, `_this_node`, `_bootstrap_store_info`,
`_shared_tcp_store_server`), each listed in torch_private.py and checked against the pinned torch.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    dynamic_rendezvous,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
)

from torchspot_trainer.handover import (
    latest_failure,
)
from torchspot_trainer.markers import (
    LEAVING_MARKER,
    PEER_LOST_ENV,
    RESTART_MARKER,
    agent_marker,
    name_peer_lost_marker,
)
from torchspot_trainer.rendezvous import milestones
from torchspot_trainer.rendezvous.backend import EtcdV3RendezvousBackend, RunLease
from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError, EtcdTls
from torchspot_trainer.rendezvous.joins import DEPARTED, our_folder
from torchspot_trainer.rendezvous.liveness import Liveness
from torchspot_trainer.rendezvous.losses import LossJudging
from torchspot_trainer.rendezvous.rounds import (
    forgotten,
    lost_members,
    membership_changed,
    newcomers_of,
    restored,
)
from torchspot_trainer.rendezvous.settings import BACKEND_NAME, EtcdV3Settings, parse_settings
from torchspot_trainer.rendezvous.store import EtcdStore
from torchspot_trainer.rendezvous.torch_glue import (
    LeaveOp,
    PromptOpExecutor,
    WatchfulStateHolder,
    method_name,
    no_spread,
)

log = logging.getLogger(__name__)

_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ETCD_RETRY_SECONDS = 0.2
"""Between tries of a round's join while etcd does not answer (`_join_next`)."""
_RESTORE_ATTEMPTS = 5
"""Writes of a restored round (`_restore`) in a row that may lose to a newcomer's before the agent
takes the state as changed (a re-form, whose join numbers the round after its own)."""
_LEFT_COUNTER = "torchspot.agents_left"


_ACTIVE: list[EtcdV3RendezvousHandler] = []
"""This process's handlers, for leave_rendezvous (torch gives the launcher no handle on them)."""


def leave_rendezvous() -> None:
    """Take this agent out of its rendezvous: it was stopped by a signal (its pod is deleted).

    torch's launcher deliberately leaves the rendezvous open then (closing it would end
    the job for everyone); this only removes our node, so the others re-form at once
    instead of after our heartbeats expire.
    """
    for handler in _ACTIVE:
        handler.leave()


@dataclass
class SetUp:
    """A round's set-up under `EtcdV3RendezvousHandler.setting_up`."""

    abandoned: str | None = None
    """Why a store read gave up (the round lost a member or moved on), or None."""


class EtcdV3RendezvousHandler(LossJudging, DynamicRendezvousHandler):
    """torch's dynamic rendezvous on etcd v3, with lost-peer detection."""

    _store: EtcdStore  # create_handler's
    _etcd: EtcdClient
    _etcd_settings: EtcdV3Settings
    _lease: RunLease
    _backend: EtcdV3RendezvousBackend
    _joined: tuple[int, frozenset[Any]] | None
    _joined_state: Any
    """torch's state as this agent last joined a round (complete, with the ranks): what it writes back
    if etcd loses its data while it trains in that round (`_restore`)."""
    _previous: tuple[int, frozenset[Any]]
    _newcomers: frozenset[Any]
    """The members of the round last joined that were not in the one before it (`newcomers_of`)."""
    _joined_at: float
    """When this agent joined its round (`time.monotonic()`)."""
    _failure_seen: int
    """The newest local worker failure passed on to liveness (`_corroborate_failures`), in nanoseconds."""
    _failed_at_join: int
    """The newest local worker failure when this agent joined its round (`_holding_joiners`)."""
    _first_round: int | None
    """The first round this agent joined (`_joins_after_loss`), None before it."""
    _deferred: tuple[int, list[Any]]
    """The round this agent last completed with joiners left out (`_defer_joiners`), and them: said once
    the round formed so (`_say_deferred`), not as the completion that may lose its write is made."""
    _watch: WatchfulStateHolder
    _left: bool
    _leaving: threading.RLock
    _last_warning: float
    _liveness: Liveness | None
    _prompt: PromptOpExecutor
    _change_reported: bool
    _changed: threading.Event
    _activity_reported: float
    """When `report_activity` last wrote (`time.monotonic()`)."""

    @property
    def use_agent_store(self) -> bool:
        """Workers bootstrap from the store the round's rank-0 agent started (module docstring, point 2)."""
        return True

    @property
    def grows_only(self) -> bool:
        """Whether the round this agent last joined follows the one before it directly and keeps every
        member of it: a pure growth, which workers that re-form in place may enter as a deferred join
        (handover.py's `Assignment.grows`). A round that lost a frozen member and gained two is larger
        and is none: deferred, the workers waited in the frozen member's collective for its timeout."""
        joined, (round_, members) = self._joined, self._previous
        return joined is not None and bool(members) and joined[0] == round_ + 1 and members <= joined[1]

    @property
    def current_round(self) -> int:
        """The round this agent last joined (0 before the first): the generation of its workers' group
        (handover.py), alike on every agent of the round."""
        return 0 if self._joined is None else int(self._joined[0])

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and remember who is in it."""
        if self._joined is not None and not self._change_reported and self._liveness is not None:
            self._liveness.corroborate()  # our workers failed, and no change was seen: a peer's process is likely gone
        self._change_reported = False
        self._previous = (0, frozenset()) if self._joined is None else self._joined
        self._joined = None
        self._release_joiners()
        _peer_lost_marker().unlink(missing_ok=True)  # the new round's workers start afresh
        agent_marker(RESTART_MARKER).unlink(missing_ok=True)
        try:
            info = self._join_next()
        except Exception:
            self._joined = self._previous  # a next attempt completes early against the same members
            raise
        state = self._state_holder.state
        self._joined_state = copy.deepcopy(state)  # first: `_restore` on liveness's thread reads both
        self._joined = (state.round, frozenset(state.participants))
        self._joined_at = time.monotonic()
        if self._first_round is None:
            self._first_round = int(state.round)
        folder = our_folder()
        self._failed_at_join = 0 if folder is None else latest_failure(folder)
        self._newcomers = newcomers_of(self._joined[1], self._previous[1])
        self._say_deferred(state)
        if self._liveness is not None:
            self._liveness.forget(map(str, state.participants))
        if info.rank == 0:  # one writer per round
            self._report(milestones.ROUND, {"round": state.round, "nodes": info.world_size})
        return info

    def report_activity(self) -> None:
        """This node's workers used the CPU lately (activity.py): say so where the operator reads the run's
        milestones, at most every ACTIVITY_REPORT_SECONDS and off the agent's thread (etcd may be slow or
        away). The operator's stall rule reads it for a program that reports no steps."""
        now = time.monotonic()
        if now - self._activity_reported < milestones.ACTIVITY_REPORT_SECONDS:
            return
        self._activity_reported = now
        record = {"at": int(time.time()), "node": str(self._this_node)}

        def report() -> None:
            if not self._report(milestones.ACTIVITY, record):
                self._activity_reported = float("-inf")  # the next look's activity tries again

        threading.Thread(target=report, name="torchspot-activity", daemon=True).start()

    def _report(self, name: str, record: dict[str, Any]) -> bool:
        """Write the milestone `name` on the run lease; whether it was written (a failure is logged: it
        is only a report)."""
        try:
            lease = self._lease.id()
        except EtcdError as exc:
            log.warning("rendezvous %s: %s not reported (%s)", self._settings.run_id, name, exc)
            return False
        return milestones.write(self._etcd, self._settings.run_id, name, record, lease=lease)

    def _join_next(self) -> RendezvousInfo:
        """torch's `next_rendezvous`, tried again while etcd does not answer (module docstring, point
        3), until the join timeout: torch gives up at the first failed read or write, and the agent
        then failed, and its shutdown closed the rendezvous for every node: one etcd timeout as a
        thawed node re-joined would end the job."""
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        while True:
            # torch starts a store for the round if we are its rank 0 (point 2); the last one goes.
            self._bootstrap_store_info = None
            self._shared_tcp_store_server = None
            try:
                with no_spread() if self._previous[1] else contextlib.nullcontext():
                    return super().next_rendezvous()
            except RendezvousConnectionError as exc:
                if time.monotonic() + ETCD_RETRY_SECONDS >= deadline:
                    raise
                self._warn(f"etcd did not answer while joining the next round ({exc}); trying again")
                time.sleep(ETCD_RETRY_SECONDS)

    @contextlib.contextmanager
    def setting_up(self) -> Iterator[SetUp]:
        """While the agent sets a round up (joins it, then trades addresses and ranks through the store),
        a store read that waits gives up (`RoundAbandoned`) once the round lost a member or moved on: the
        agent then joins the next round (handover.py's InPlaceAgent) instead of waiting out the store's
        timeout for a member that is gone. The members are those of the state when the first read
        waits, which is after the join (torch's set-up reads nothing before); etcd trouble abandons
        nothing (module docstring, point 3). What it yields says whether it gave up, and why."""
        joined: list[tuple[int, frozenset[Any]]] = []
        set_up = SetUp()

        def abandoned() -> str | None:
            try:
                with self._heartbeat_lock:
                    if not joined:
                        state = self._state_holder.state
                        joined.append((state.round, frozenset(state.participants)))
                        return None
                    self._state_holder.sync()
                    state = self._state_holder.state
            except RendezvousConnectionError:
                return None
            changed, reason = membership_changed(*joined[0], state)
            if changed:
                set_up.abandoned = reason
            return set_up.abandoned

        self._store.abandon_when(abandoned)
        try:
            yield set_up
        finally:
            self._store.abandon_when(None)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join, or 1 if our round lost a member (so the agent re-forms)."""
        try:
            state = self._read_state()
        except RendezvousConnectionError as exc:
            self._warn(f"etcd unreachable, training continues at the current size: {exc}")
            return 0
        waiting = len(state.wait_list)
        if self._joined is not None:
            changed, reason = membership_changed(*self._joined, state)
            if changed:
                log.warning("rendezvous %s: %s; re-forming", self._settings.run_id, reason)
                lost = lost_members(self._joined[1], state)
                if lost:
                    _peer_lost_marker().write_text(self._lost_grace(lost))
                agent_marker(RESTART_MARKER).touch()
                self._change_reported = True
                return max(waiting, 1)
        if self._joined is not None and self._failed_alone():
            log.warning("rendezvous %s: a local worker failed in round %s and no member is lost; re-forming",
                        self._settings.run_id, self._joined[0])  # fmt: skip
            agent_marker(RESTART_MARKER).touch()
            self._change_reported = True
            return max(waiting, 1)
        if waiting and self._holding_joiners():
            return 0
        if waiting:  # the agent restarts its workers for the joiners next
            agent_marker(RESTART_MARKER).touch()
            self._change_reported = True
        return waiting

    def _read_state(self) -> Any:
        """The rendezvous state read afresh, with the round written back where etcd lost its data
        (`_restore`). Raises RendezvousConnectionError while etcd does not answer."""
        with self._heartbeat_lock:
            self._state_holder.sync()
            return self._restore(self._watch)

    def _restore(self, holder: WatchfulStateHolder) -> Any:
        """The state `holder` last read, or, where etcd lost its data since this agent joined its round
        (`forgotten`: the etcd's pod moved, and the managed etcd keeps its data in memory), that round
        written back as this agent joined it (`restored`): the rounds, and the generations of the
        workers that re-form in place, then go on from its number, and liveness can take a lost member
        out of it. Every member of the round does the same; the first write wins and the others read
        it back. Returns the state held afterwards."""
        joined, joined_state, state = self._joined, self._joined_state, holder.state
        if joined is None or joined_state.round != joined[0] or not forgotten(*joined, state):
            return state
        log.warning("rendezvous %s: etcd lost the rendezvous state; round %d written back",
                    self._settings.run_id, joined[0])  # fmt: skip
        for _ in range(_RESTORE_ATTEMPTS):
            state = holder.replace(restored(joined_state, state, datetime.now(UTC)))
            if not forgotten(*joined, state):
                break
        return state

    def keep_open(self) -> None:
        """This node's agent failed (handover.py's `InPlaceAgent.run`): its shutdown takes the node out
        of the rendezvous instead of closing it (`shutdown`)."""
        self._keep_open = True

    def shutdown(self) -> bool:
        """Close the rendezvous; the last agent of the last round to leave deletes the run's keys. Where
        the agent failed (`keep_open`), leave it instead, as a node that is going does: torch's launcher
        shuts the handler down after any exception but a signal's, and a closed rendezvous ends the
        run for every node at its next change, where for the others a node whose agent failed is a
        node lost. A joiner that met its join timeout at a full round so closed a running job's.

        Deleting earlier would pull the exit barrier's keys from under agents that
        are still in it; an agent that never gets here leaves keys that expire by lease.
        The agents are counted per round, against that round's members: an agent that shut
        down in another round (a spare that formed a round of its own after the run ended)
        never counts toward the last one. (A node stopped by a signal does not get here:
        torch skips the shutdown then.)
        """
        if self._keep_open:
            log.warning("rendezvous %s: this node's agent failed; it leaves, and the others go on without it",
                        self._settings.run_id)  # fmt: skip
            self.leave()
            return False
        if self._liveness is not None:
            self._liveness.stop()
        closed = super().shutdown()
        settings = self._etcd_settings
        try:
            members = max(len(self._state_holder.state.participants), 1)
            counter = f"{_LEFT_COUNTER}/{self.current_round}"
            left = EtcdStore(self._etcd, settings, self._lease).add(counter, 1)
            if left >= members:
                # The run's status records stay for the operator's last read (their own leases end them).
                self._etcd.delete_prefix(settings.run_prefix, keep=milestones.milestone_prefix(settings.run_id))
                log.info("rendezvous %s: last agent out, keys deleted but its status", settings.run_id)
        except (EtcdError, RendezvousConnectionError) as exc:
            log.warning("rendezvous %s: keys not deleted (%s); they expire by lease", settings.run_id, exc)
        return closed

    def leave(self) -> None:
        """Stop heartbeating and take this node out of the rendezvous (see leave_rendezvous).

        With a state holder and executor of its own: it may run in a signal handler, on top
        of the main thread's own use of the handler's. Once left, a second call (the
        launcher's fallback after the agent stops) does nothing.
        """
        with self._leaving:  # the launcher's thread (leave_once_agreed) and its main thread, one at a time
            self._leave()

    def _leave(self) -> None:
        if self._left:
            return
        agent_marker(LEAVING_MARKER).touch()  # before anyone can see us gone
        self._stop_heartbeats()
        if self._liveness is not None:
            self._liveness.stop()
        deadline = time.monotonic() + self._etcd_settings.request_timeout
        holder = _BackendRendezvousStateHolder(self._backend, self._settings, cache_duration=0)
        try:
            holder.sync()  # said before we go, so nobody sees us missing and not gone
            key = f"{self._etcd_settings.run_prefix}{DEPARTED}{self._this_node}"
            self._say_departed(key, holder.state.round)
            _DistributedRendezvousOpExecutor(self._this_node, holder, self._settings).run(LeaveOp(), deadline)
        except Exception as exc:  # leaving is a courtesy: our heartbeats expire anyway
            log.warning("rendezvous %s: not left (%s); peers wait for our heartbeats", self._settings.run_id, exc)
        else:
            self._left = True
            log.warning("rendezvous %s: left it (this node is going)", self._settings.run_id)

    def bind_etcd(
        self, client: EtcdClient, settings: EtcdV3Settings, lease: RunLease, backend: EtcdV3RendezvousBackend
    ) -> None:
        """Attach the etcd connection (torch's `from_backend` fixes the constructor's arguments),
        and the prompt state reads of point 4 of the module docstring."""
        self._etcd = client
        self._etcd_settings = settings
        self._lease = lease
        self._backend = backend
        self._joined = None
        self._joined_state = None
        self._previous = (0, frozenset())
        self._newcomers = frozenset()
        self._joined_at = 0.0
        self._failure_seen = 0
        self._failed_at_join = 0
        self._first_round = None
        self._deferred = (0, [])
        self._activity_reported = float("-inf")
        self._left = False
        self._keep_open = False
        self._leaving = threading.RLock()  # re-entered by a second SIGTERM's handler: no deadlock
        self._last_warning = 0.0
        poll = settings.state_poll_interval
        self._watch = WatchfulStateHolder(backend, self._settings, cache_duration=poll)
        self._state_holder = self._watch
        self._prompt = PromptOpExecutor(
            self._this_node, self._watch, self._settings, poll,
            ready=self._round_ready, admit=self._defer_joiners, leaves_filled=self._leaves_filled,
            rejoin=self._rejoined_round,
        )  # fmt: skip
        self._op_executor = self._prompt
        self._change_reported = False
        self._changed = threading.Event()
        self._liveness = None
        if settings.liveness_timeout > 0:
            self._liveness = Liveness(
                client,
                settings.run_prefix,
                str(self._this_node),
                lease,
                interval=settings.liveness_interval,
                timeout=settings.liveness_timeout,
                members=self._judged,
                evict=self._evict,
                state_key=backend.key,
                on_state=self._state_written,
                proof=self._proven,
                failures=self._corroborate_failures,
            )
            self._liveness.start()
        _ACTIVE.append(self)

    def _state_written(self) -> None:
        """The state key was written (liveness.py's watch): the next look reads it, a round being
        formed is looked at now, a round being set up is judged now (`setting_up`'s store reads), and
        an agent waiting for its monitor tick (`wait_for_change`) looks."""
        self._watch.expire()
        self._prompt.wake()
        self._store.look_again()
        self._changed.set()

    def wait_for_change(self, timeout: float) -> None:
        """Return when the rendezvous state is written, or after `timeout` (handover.InPlaceAgent's
        monitor tick): the agent sees a membership change when it is written instead of up to a tick
        later. Without liveness (no watch) it only waits out the timeout, as torch's agent sleeps."""
        if self._changed.wait(timeout):
            self._changed.clear()


def _peer_lost_marker() -> Path:
    return Path(os.environ[PEER_LOST_ENV])


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the `etcd-v3` handler from torchrun's rendezvous parameters (torch's dynamic rendezvous
    names its records with `method_name` from then on).

    Fails within `connect_timeout` seconds, naming the endpoint, if etcd does not answer.
    """
    dynamic_rendezvous.get_method_name = method_name
    settings = parse_settings(params.endpoint, params.run_id, params.config)
    tls = EtcdTls.from_conf({"cacert": settings.cacert, "cert": settings.cert, "key": settings.key})
    client = EtcdClient(settings.host, settings.port, request_timeout=settings.request_timeout, tls=tls)
    try:
        client.wait_reachable(settings.connect_timeout)
    except EtcdError as exc:
        client.close()
        raise RendezvousConnectionError(str(exc)) from exc
    # See the module docstring, point 2: torch's sharing on, whatever the environment said (set, the
    # workers would dial a store nobody started). Workers do not read this variable.
    os.environ[_DISABLE_SHARED_STORE] = "0"
    name_peer_lost_marker()
    lease = RunLease(client, settings.lease_ttl)
    backend = EtcdV3RendezvousBackend(client, settings, lease)
    store = EtcdStore(client, settings, lease)
    timeout = RendezvousTimeout(
        join=timedelta(seconds=settings.join_timeout),
        last_call=timedelta(seconds=settings.last_call_timeout),
        close=timedelta(seconds=settings.close_timeout),
        heartbeat=timedelta(seconds=settings.heartbeat_timeout),
    )
    handler: EtcdV3RendezvousHandler = EtcdV3RendezvousHandler.from_backend(
        run_id=settings.run_id,
        store=store,
        backend=backend,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        timeout=timeout,
        keep_alive_interval=settings.keep_alive_interval,  # type: ignore[arg-type]
        keep_alive_max_attempt=settings.keep_alive_max_attempt,
    )
    handler.bind_etcd(client, settings, lease, backend)
    return handler


def register() -> None:
    """Make `--rdzv-backend etcd-v3` available to torchrun in this process."""
    rendezvous_handler_registry.register(BACKEND_NAME, create_handler)
