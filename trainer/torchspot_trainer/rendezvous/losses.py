"""How an agent judges a lost member (the rendezvous handler's point 1, handler.py): what liveness
watches, how a lost node is taken out, and what a local worker's failure says.

- **What liveness judges** (liveness.py): the members of this agent's round (the previous round's while
  one forms), and the proof that they were alive: a local live worker's last completed step in that
  round's generation (its all-reduce completed with every member: handover.py's `last_step`).
- **A lost node is taken out** with one compare-and-set on the state, after a `departed/` record that
  agents completing the next round early read (joins.py).
- **A local worker's failure** while it stays up (it re-forms in place) makes liveness judge with its
  short timeout for a while: a peer's process is likely gone. Where a peer's loss explains a worker's
  failure, the agent does not count it against `--max-restarts`; a failure nothing explains, with no
  member lost, re-forms after twice the liveness timeout rather than waiting for a change that will
  not come.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings

from torchspot_trainer.handover import failed_in, last_step, latest_failure
from torchspot_trainer.rendezvous.backend import EtcdV3RendezvousBackend, RunLease, with_lease
from torchspot_trainer.rendezvous.etcd_client import EtcdClient
from torchspot_trainer.rendezvous.joins import DEPARTED, JoinRules, our_folder
from torchspot_trainer.rendezvous.liveness import Liveness
from torchspot_trainer.rendezvous.rounds import membership_changed
from torchspot_trainer.rendezvous.settings import EtcdV3Settings
from torchspot_trainer.rendezvous.torch_glue import WatchfulStateHolder, evict_node

__all__ = ["LossJudging"]

log = logging.getLogger("torchspot_trainer.rendezvous.handler")


class LossJudging(JoinRules):
    """The lost-member side of `EtcdV3RendezvousHandler` (module docstring), on the handler's record of
    its rounds (the attributes below: handler.py sets them)."""

    _settings: RendezvousSettings  # torch's handler's
    _etcd: EtcdClient
    _etcd_settings: EtcdV3Settings
    _lease: RunLease
    _backend: EtcdV3RendezvousBackend
    _watch: WatchfulStateHolder
    _liveness: Liveness | None
    _joined: tuple[int, frozenset[Any]] | None
    _previous: tuple[int, frozenset[Any]]
    _failure_seen: int

    # The handler's own, which these rules call (declared for the type checker).
    def _read_state(self) -> Any:
        raise NotImplementedError

    def _restore(self, holder: WatchfulStateHolder) -> Any:
        raise NotImplementedError

    def wait_for_change(self, timeout: float) -> None:
        raise NotImplementedError

    def _corroborate_failures(self) -> None:
        """If a local worker's collective failed since the last look (its `failed-` file is newer:
        handover.py's `latest_failure`) while it stays up (it re-forms in place, so the agent never
        sees it exit): liveness judges with its short timeout for a while, as after a failed worker.
        Asked by liveness's judge whenever a member's put is that late, whatever the agent is doing:
        asked only from the agent's monitor loop, a kill that landed while the agent set a joiner's
        round up would be judged by the long timeout."""
        folder = our_folder()
        if self._liveness is None or folder is None:
            return
        newest = latest_failure(folder)
        if newest > self._failure_seen:
            self._failure_seen = newest
            self._liveness.corroborate()

    def _failed_alone(self) -> bool:
        """Whether a local worker failed in this agent's round, in place, longer ago than twice the
        liveness timeout, and no member is lost: it waits for a next round that no change would
        bring (every rank of a group whose heal failed alike would wait so until a joiner came or its agent
        restarted it). A failure that a lost member caused is judged by liveness first, within the liveness
        timeout."""
        folder = our_folder()
        if folder is None or self._joined is None:
            return False
        failed = failed_in(folder, int(self._joined[0]))  # before `_defers_joins`' scans, rarely due
        return failed is not None and time.time() - failed > self._judged_within() and self._defers_joins()

    def _judged_within(self) -> float:
        """How long after a local failure a lost member is surely judged: twice liveness's timeout, or
        twice torch's heartbeat expiry without liveness."""
        settings = self._settings
        dead_after = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt  # torch's
        return 2 * (self._etcd_settings.liveness_timeout or dead_after)

    def explains_failure(self) -> bool:
        """Whether a peer's loss explains this agent's workers' failure, which just happened: the round
        they trained in lost a member, or moved on, within `_judged_within` (liveness judges with its
        short timeout from now: `corroborate`). Their collectives then failed on the lost peer's closed
        socket, which is no fault of the program: the agent does not count it against --max-restarts
        (handover.py's InPlaceAgent). Before, every hard loss on the restart path used one restart of
        every surviving agent, and a long run's survivors gave up together. A failure nothing explains
        waits that long before its restart; False at once outside a round."""
        joined = self._joined
        if joined is None:
            return False
        if self._liveness is not None:
            self._liveness.corroborate()
        deadline = time.monotonic() + self._judged_within()
        while True:
            try:
                state = self._read_state()
            except RendezvousConnectionError:  # etcd away: nothing known yet
                state = None
            if state is not None and membership_changed(*joined, state)[0]:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.wait_for_change(min(left, self._etcd_settings.state_poll_interval))

    def _lost_grace(self, lost: list[str]) -> str:
        """What the peer-lost marker says of the workers' grace after their last step boundary
        (signals.stuck_wait): half the liveness timeout when every lost member fell silent (nothing
        more will come from it); nothing, so the workers' own 2 s, when one was still putting its
        liveness key as it went (a node leaving on notice: its workers finish the step, and their
        emergency checkpoint needs the others at that boundary, which a shorter grace can cut off), or
        without liveness."""
        liveness = self._liveness
        if liveness is None or not all(liveness.silent(name) for name in lost):
            return ""
        return f"{self._etcd_settings.liveness_timeout / 2:g}"

    def _judged(self) -> frozenset[str]:
        """The nodes liveness judges: our round's members, or the previous round's while one forms."""
        joined = self._joined
        members = self._previous[1] if joined is None else joined[1]
        return frozenset(map(str, members))

    def _proven(self) -> float | None:
        """When a local live worker last completed a step in the generation of the round liveness judges
        (`_judged`; handover.py's `last_step`: its all-reduce completed with every member), on the
        monotonic clock liveness judges by; None without one (a worker that does not re-form in place
        writes none). A stamp moved ahead of now (the next step's expected time) counts as now."""
        joined = self._joined
        round_ = self._previous[0] if joined is None else joined[0]
        folder = our_folder()
        if folder is None:
            return None
        stamp = last_step(folder, int(round_))
        return None if stamp is None else time.monotonic() - max(0.0, time.time() - stamp)

    def _evict(self, name: str) -> None:
        """Take `name` out of the rendezvous (liveness.py found it lost): say it departed, for the
        agents completing the next round early, then one compare-and-set on the state. With a
        state holder of its own: the judging thread runs beside the agent's."""
        holder = WatchfulStateHolder(self._backend, self._settings, cache_duration=0)
        holder.sync()
        self._restore(holder)  # a state etcd began again holds nobody to take out
        key = f"{self._etcd_settings.run_prefix}{DEPARTED}{name}"
        self._say_departed(key, holder.state.round)
        round_ = evict_node(holder, self._settings, name)
        if round_ is not None:
            self._watch.found_dead.setdefault(name, round_)
            log.warning("rendezvous %s: node %s taken out of round %d", self._settings.run_id, name, round_)
        self._watch.expire()  # the agent's next look reads the change

    def _say_departed(self, key: str, round_: int) -> None:
        """Put a `departed/` record, on the run lease (granted again if etcd lost it with its data)."""
        with_lease(self._lease, lambda lease: self._etcd.put(key, str(round_).encode(), lease=lease))
