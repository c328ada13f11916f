"""An agent's join rules: when a round may complete before its last call, and which nodes join it or
wait for the next (the rendezvous handler's point 4, handler.py; the pure rules are rounds.py's).

- **A round completes as soon as** every member of the previous round has joined it or is known gone
  (rounds.py's `complete_early`): departed under `<run prefix>departed/` (an agent stopped by a signal
  says so as it leaves), or taken out by liveness here. The last call still bounds the wait for anyone
  slower.
- **A joiner whose round lost a member before it trained** is taken out of it by the survivors, who do
  not wait for its set-up (`joiners_to_release`, `expected_members`): its workers re-form in place and
  were still waiting for the joiner.
- **A round after a loss leaves a node that came meanwhile waiting** (`joiners_to_defer`), also where
  that node's add fills it (`max_nodes`: torch completes it then, torch_glue.py's `PromptOpExecutor`);
  a joiner never completes a round after a departure itself (`_joins_after_loss`). Either joins the
  round after, once the survivors' workers trained in theirs (`_holding_joiners`), which they take as a
  deferred join: otherwise they would wait in the new group for the joiner's start-up.

These rules apply where the agent's workers train on while a joiner sets up (`_defers_joins`: they
re-form in place and stamp their steps); the restart path's workers train in no round before it forms
whole.
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _BackendRendezvousStateHolder,
)

from torchspot_trainer.handover import agent_folder, latest_failure, live_workers, stepped_generation
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.rendezvous.backend import EtcdV3RendezvousBackend
from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError
from torchspot_trainer.rendezvous.rounds import (
    complete_early,
    departed_since,
    expected_members,
    joiners_to_defer,
    joiners_to_release,
    rejoined_round,
    waiting_joiners,
)
from torchspot_trainer.rendezvous.settings import EtcdV3Settings
from torchspot_trainer.rendezvous.torch_glue import WatchfulStateHolder, take_out

__all__ = ["DEPARTED", "JOIN_HOLD_SECONDS", "JoinRules", "our_folder"]

log = logging.getLogger("torchspot_trainer.rendezvous.handler")

JOIN_HOLD_SECONDS = 30.0
"""The most a node waiting to join is held back while this agent's workers have not trained in the
round they are in (`_holding_joiners`): as long as a deferred join waits for its joiners
(live.py's READY_SECONDS)."""
DEPARTED = "departed/"
"""Under the run prefix: one key per node that left, valued with the round it left."""
_WARN_EVERY = 10.0


def our_folder() -> Path | None:
    """This agent's folder (handover.py's `agent_folder`), where its workers leave their files; None
    where no agent of ours set one up (a handler made outside torchspot-run)."""
    return agent_folder() if PEER_LOST_ENV in os.environ else None


class JoinRules:
    """The join rules of `EtcdV3RendezvousHandler` (module docstring), on the handler's own record of
    the rounds it joined (the attributes below: handler.py sets them)."""

    _settings: RendezvousSettings  # torch's handler's
    _this_node: Any  # torch's handler's
    _etcd: EtcdClient
    _etcd_settings: EtcdV3Settings
    _backend: EtcdV3RendezvousBackend
    _watch: WatchfulStateHolder
    _joined: tuple[int, frozenset[Any]] | None
    _previous: tuple[int, frozenset[Any]]
    _newcomers: frozenset[Any]
    _joined_at: float
    _failed_at_join: int
    _first_round: int | None
    _deferred: tuple[int, list[Any]]
    _last_warning: float

    def _round_ready(self, state: Any) -> bool:
        """complete_early for the forming round, against the members of the previous round it waits for
        (`expected_members`: not one that joined it, if it never trained here), whatever joiner waits
        to join it after a loss where this agent defers joins (`waiting_joiners`); etcd is asked who
        departed only while one of them is missing and not already known dead here."""
        round_, previous = self._previous
        members = expected_members(previous, self._newcomers, trained=self._trained(round_))
        waiting = waiting_joiners(members, state) if state.wait_list and self._defers_joins() else frozenset()
        gone = frozenset(map(str, members))
        if not complete_early(members, self._this_node, state, self._settings.min_nodes, gone=gone, deferred=waiting):
            return False  # not ready, whoever is gone
        if self._joins_after_loss(state, self._previous):
            return False  # a joiner: the members complete it
        dead = {name for name, at in self._watch.found_dead.items() if at >= round_}
        missing = {str(member) for member in members if member not in state.participants} - dead
        if not missing:
            return True
        departed = self._departed_since(round_)
        return departed is not None and missing <= departed  # etcd silent: the last call completes it

    def _release_joiners(self) -> None:
        """As this agent leaves the round it was in (`_previous` now), after a loss: take that round's
        joiners out of it where it never trained here (`joiners_to_release`), so the next round forms
        without waiting for their agents to leave it; each joins the round after, as any joiner does.
        The others' agents do the same: whoever writes first, the rest find nothing to take. Nothing is
        lost if the write fails: the round then waits for them as before."""
        round_, members = self._previous
        if not self._newcomers or self._trained(round_):
            return
        holder = _BackendRendezvousStateHolder(self._backend, self._settings, cache_duration=0)
        choose = partial(joiners_to_release, round_, members, self._newcomers)
        try:
            taken = take_out(holder, self._settings, choose, f"round {round_}'s joiners")
        except Exception as exc:  # etcd trouble, or a race lost 5 times: the round waits for them
            self._warn(f"round {round_}'s joiners not taken out ({exc})")
            return
        if taken is not None:
            log.warning("rendezvous %s: round %d lost a member before it trained; its joiner(s) %s join the next one",
                        self._settings.run_id, round_, ", ".join(map(str, taken[1])))  # fmt: skip
            self._watch.expire()

    def _defer_joiners(self, state: Any) -> None:
        """As this agent completes a round after a loss: the participants that were not expected
        (`joiners_to_defer`: a joiner that came as a member was lost) wait for the next round
        instead, which follows as a deferred join once this agent's workers trained in this one
        (`_holding_joiners`); only where this agent's workers train
        on while a joiner sets up (`_defers_joins`). Changes `state`, which the completion writes."""
        if not self._defers_joins():
            return
        round_, previous = self._previous
        expected = expected_members(previous, self._newcomers, trained=self._trained(round_))
        joiners = joiners_to_defer(expected, state, self._settings.min_nodes)
        for node in joiners:
            del state.participants[node]
            state.wait_list.add(node)
        self._deferred = (state.round, joiners)

    def _say_deferred(self, state: Any) -> None:
        """Log the joiners this agent left out of the round it completed (`_defer_joiners`) where the round
        it joined (`state`) formed without them. Not as the completion is made: its write may lose to
        another member's, and the line then told of a deferral the round may not have had."""
        round_, joiners = self._deferred
        self._deferred = (0, [])
        if joiners and state.round == round_ and not any(node in state.participants for node in joiners):
            log.warning("rendezvous %s: the round after a loss formed without its joiner(s) %s: they join the next one",
                        self._settings.run_id, ", ".join(map(str, joiners)))  # fmt: skip

    def _joins_after_loss(self, state: Any, previous: tuple[int, frozenset[Any]]) -> bool:
        """Whether this node, whose round before was `previous` (`_previous` as it joins), comes to the forming
        round as a joiner, and a member of the round before it
        departed (`departed/`): it then leaves the round to its members to complete, whether its add
        fills it (`PromptOpExecutor`) or every member it knows of is in (`_round_ready`). The members'
        completion leaves it waiting where their workers train on meanwhile (`_defer_joiners`); a
        joiner cannot tell who else is one. A joiner: not in the round before, or there as a newcomer
        whose worker never stepped (its first round, in a job that formed one before it). A round after
        a loss completed by a joiner takes any joiner still starting, and the survivors wait in the
        new group for its start-up. Never for a round 0, and not where etcd does not answer (the node
        completes as before)."""
        round_, members = previous
        if state.round == 0:
            return False
        if members and round_ >= state.round - 1 and not self._never_stepped_in_first(round_):
            return False
        return bool(self._departed_since(state.round - 1))

    def _never_stepped_in_first(self, round_: int) -> bool:
        """Whether `round_` is this agent's first round, joined in a running job (not round 0), and no local
        worker stepped in it. The folder is read only then: `_round_ready` asks at every look."""
        if round_ != self._first_round or round_ == 0:
            return False
        folder = our_folder()
        newest = None if folder is None else stepped_generation(folder)
        return newest is None or newest < round_

    def _departed_since(self, round_: int) -> frozenset[str] | None:
        """The nodes that said under `departed/` they left round `round_` or a later one (`departed_since`);
        None where etcd does not answer."""
        prefix = f"{self._etcd_settings.run_prefix}{DEPARTED}"
        try:
            return departed_since(self._etcd.get_prefix(prefix), prefix, round_)
        except EtcdError:
            return None

    def _leaves_filled(self, state: Any) -> bool:
        """Whether this node's add, which fills the forming round (`max_nodes`), leaves it to the members to
        complete (`_joins_after_loss`)."""
        if not self._joins_after_loss(state, self._previous):
            return False
        log.warning("rendezvous %s: round %d, which this join fills, follows a loss: its members complete it",
                    self._settings.run_id, state.round)  # fmt: skip
        return True

    def _rejoined_round(self, state: Any) -> int | None:
        """The round this agent's join writes over a state etcd began again (rounds.py's
        `rejoined_round`, against the round it left), or None."""
        return rejoined_round(*self._previous, self._this_node, state)

    def _holding_joiners(self) -> bool:
        """Whether nodes waiting to join wait a little longer: while this agent's workers, which train
        on while a joiner sets up (`_defers_joins`), have not trained in the round they are in, for
        at most JOIN_HOLD_SECONDS after it formed. Their next round then follows a generation they
        train in, and they take it as a deferred join; handed over sooner, it came while they were
        still building their group (a survivor's after a loss, or a deferred join's waiting for its
        joiner), so they entered it at once and waited in it for the joiner's start-up, and for every
        joiner's when two came one after another. Never for more than half the joiner's own join
        timeout (`--rdzv-conf join_timeout`), and not once a local worker failed in the round (a
        `failed-` file newer than the join): it waits for the next round then, which a held node would
        hold back too."""
        joined = self._joined
        hold = min(JOIN_HOLD_SECONDS, self._settings.timeout.join.total_seconds() / 2)  # the joiner's own wait
        if joined is None or time.monotonic() - self._joined_at > hold or self._trained(joined[0]):
            return False
        return latest_failure(agent_folder()) <= self._failed_at_join

    def _defers_joins(self) -> bool:
        """Whether this agent's workers train on while a round that adds a node waits for its worker
        (live.py's deferred join): they re-form in place and stamp their steps (handover.py's
        `stepped_generation`). Not so on the restart path, whose workers train in no round before
        it forms whole (a node left out of one would cost everyone another restart), nor for a
        program that stamps no step (nothing is known of it)."""
        folder = our_folder()
        return folder is not None and live_workers(folder) and stepped_generation(folder) is not None

    def _trained(self, round_: int) -> bool:
        """Whether round `round_` trained, as far as this agent knows (`expected_members`): no only where
        its workers train on while a joiner sets up (`_defers_joins`) and the newest step they
        stamped is of an older generation."""
        if not self._defers_joins():
            return True
        newest = stepped_generation(agent_folder())
        return newest is not None and newest >= round_

    def _warn(self, message: str) -> None:
        """A warning, at most one every few seconds (etcd trouble repeats at every look)."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY:
            self._last_warning = now
            log.warning("rendezvous %s: %s", self._settings.run_id, message)
