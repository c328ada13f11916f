"""Where the `etcd-v3` handler (handler.py) meets torch's dynamic rendezvous: torch's state holder and
op executor, extended, and the two functions of torch's module it replaces.

- `WatchfulStateHolder` remembers the nodes torch's reads found dead (torch drops them silently);
- `evict_node` and `take_out` take nodes out of the state with one compare-and-set, as torch's
  `_sanitize` drops a node whose heartbeat expired;
- `LeaveOp` takes this node out whatever list it is in; `PromptOpExecutor` re-reads the state as soon as
  it is written instead of once a second, and completes a round as the handler's rules say;
- `method_name` stands in for torch's `get_method_name` (it does not read the stack), `no_spread` for
  its `_delay` while an agent re-joins.

These read and replace private attributes of torch's classes (`_state`, `_dead_nodes`,
`_last_sync_time`, `_settings`, `_node`): torch is pinned, its private names are listed in one place
(torch_private.py, which a test checks against the installed torch), and the tests exercise all of it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _remove_participant_epilogue,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousState,
)

__all__ = [
    "LeaveOp",
    "PromptOpExecutor",
    "WatchfulStateHolder",
    "evict_node",
    "method_name",
    "no_spread",
    "take_out",
]

log = logging.getLogger(__name__)


class WatchfulStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, remembering the nodes its reads found dead, with the round.

    torch drops a dead node from the state it read and does not say so; the first agent
    that writes the state afterwards erases the evidence for the others.
    """

    def __init__(self, backend: Any, settings: Any, cache_duration: float) -> None:
        super().__init__(backend, settings, cache_duration)  # type: ignore[arg-type]  # torch annotates int, compares as float
        self.found_dead: dict[str, int] = {}

    def _sanitize(self) -> None:
        super()._sanitize()
        for node in self._dead_nodes:
            self.found_dead.setdefault(str(node), self._state.round)

    def expire(self) -> None:
        """Read the state afresh at the next sync (it changed: our own eviction, say)."""
        self._last_sync_time = -1.0

    def replace(self, state: Any) -> Any:
        """Write `state` over the state last read, by compare-and-set on that read's token (a state
        absent from etcd: only if it is still absent). Returns the state held afterwards: `state`, or
        the one another agent wrote first."""
        self._state = state
        self.mark_dirty()
        self.sync()
        return self._state


def evict_node(holder: _BackendRendezvousStateHolder, settings: Any, name: str, attempts: int = 5) -> int | None:
    """Take the node called `name` out of the rendezvous state (`take_out`), as torch's `_sanitize`
    drops a node whose heartbeat expired. Returns the round it was taken out of, or None if the state
    no longer holds it (another agent was first)."""

    def named(state: Any) -> list[Any]:
        known = {*state.participants, *state.wait_list, *state.redundancy_list, *state.last_heartbeats}
        return [node for node in known if str(node) == name]

    taken = take_out(holder, settings, named, f"node {name}", attempts)
    return None if taken is None else taken[0]


def take_out(
    holder: _BackendRendezvousStateHolder,
    settings: Any,
    choose: Callable[[Any], list[Any]],
    what: str,
    attempts: int = 5,
) -> tuple[int, list[Any]] | None:
    """Take the nodes `choose` picks (`what` names them in the error) out of the rendezvous state with
    one compare-and-set: the participants, the lists, their heartbeats, then torch's epilogue (a
    complete round left empty moves on). Returns the round they were taken out of and the nodes, or
    None if it picked none. A write that loses the race reads the state again, picks again and
    retries, up to `attempts` times."""
    for _ in range(attempts):
        holder.sync()
        state = holder.state
        nodes = choose(state)
        if not nodes:
            return None
        removed = False
        for node in nodes:
            removed = state.participants.pop(node, None) is not None or removed
            state.last_heartbeats.pop(node, None)
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        round_ = int(state.round)
        if removed:
            _remove_participant_epilogue(state, settings)
        holder.mark_dirty()
        if holder.sync():
            return round_, nodes
    raise RendezvousConnectionError(f"{what} not taken out: the state changed under {attempts} writes in a row")


class LeaveOp:
    """Take this node out of the rendezvous, whatever list it is in (torch's exit op only
    knows the participants)."""

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        if time.monotonic() > deadline:
            return _Action.ERROR_TIMEOUT
        if ctx.node in ctx.state.participants:
            return _Action.REMOVE_FROM_PARTICIPANTS
        if ctx.node in ctx.state.wait_list:
            return _Action.REMOVE_FROM_WAIT_LIST
        if ctx.node in ctx.state.redundancy_list:
            return _Action.REMOVE_FROM_REDUNDANCY_LIST
        return _Action.FINISH


class PromptOpExecutor(_DistributedRendezvousOpExecutor):
    """torch's op executor, except while it waits for other nodes (handler.py's module docstring, point 4).

    torch sleeps 1 s whenever an op answers "wait"; here the op is asked again after
    `poll` seconds against a fresh state, and a join that `ready` approves completes
    the round at once. Whoever completes a round first lets `admit` change the state it
    then writes (who waits for the next round instead); a node whose add fills a round
    (`max_nodes`) leaves its completion to the round's members where `leaves_filled` says so. A join
    that reads a state etcd began again since this node's last round (`rejoin` gives the round to
    write: rounds.py's `rejoined_round`) first writes an empty state of that round, and joins that.
    """

    def __init__(
        self,
        node: Any,
        state_holder: WatchfulStateHolder,
        settings: Any,
        poll: float,
        *,
        ready: Callable[[Any], bool],
        admit: Callable[[Any], None],
        leaves_filled: Callable[[Any], bool],
        rejoin: Callable[[Any], int | None],
    ) -> None:
        super().__init__(node, state_holder, settings)
        self._holder = state_holder
        self._poll = poll
        self._ready = ready
        self._admit = admit
        self._leaves_filled = leaves_filled
        self._rejoin = rejoin
        self._adding = False
        self._written = threading.Event()

    def _add_to_participants(self) -> None:
        """torch's. It completes the round itself where the add fills it (`_mark_rendezvous_complete`)."""
        self._adding = True
        try:
            super()._add_to_participants()
        finally:
            self._adding = False

    def _mark_rendezvous_complete(self) -> None:
        """torch's, once `admit` changed the state (the ranks are dealt over who is left). torch completes a
        round in two places: a join's MARK_RENDEZVOUS_COMPLETE, and an add that fills the round, which no
        action says. Seen at the first only, a round after a loss filled by its last add would take a
        joiner still starting, and the survivors would wait in the new group for its start-up. An add
        that fills a round the node should not complete (`leaves_filled`: a joiner's, after a loss,
        which cannot tell who is a joiner) leaves it incomplete: the members complete it at their next
        look, the state being written (`ready`)."""
        if self._adding and self._leaves_filled(self._state):
            return
        self._admit(self._state)
        super()._mark_rendezvous_complete()

    def wake(self) -> None:
        """The state was written: stop waiting for the poll (liveness.py's watch calls this)."""
        self._written.set()

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        """Run `state_handler` to its end, as torch does, re-reading the state every `poll` seconds."""
        joining = isinstance(state_handler, _RendezvousJoinOp)

        def prompt(ctx: _RendezvousContext, deadline: float) -> _Action:
            while True:
                round_ = self._rejoin(ctx.state) if joining and time.monotonic() <= deadline else None
                if round_ is not None:
                    log.warning("rendezvous %s: etcd lost the rendezvous state; the next round is numbered %d, "
                                "after this node's last", self._settings.run_id, round_)  # fmt: skip
                    seeded = _RendezvousState()
                    seeded.round = round_
                    self._state = self._holder.replace(seeded)  # or whichever state beat it
                    ctx = _RendezvousContext(self._node, self._state, self._settings)
                    continue
                action = state_handler(ctx, deadline)
                if action == _Action.SYNC and joining and self._ready(ctx.state):
                    action = _Action.MARK_RENDEZVOUS_COMPLETE
                if action != _Action.SYNC:
                    return action
                self._written.wait(self._poll)
                self._written.clear()
                self._state_holder.sync()
                self._state = self._state_holder.state  # the state torch's actions then change
                ctx = _RendezvousContext(self._node, self._state, self._settings)

        super().run(prompt, deadline, update_deadline)


@contextlib.contextmanager
def no_spread() -> Iterator[None]:
    """torch's `next_rendezvous` without its random 0-0.3 s wait in round 0, for an agent that has been
    in a round: the wait spreads the first joins of a starting job over time (fewer compare-and-set
    conflicts), but torch also pays it at the first re-form, whose round is still 0, where it only
    delays the survivors' re-form. The op executor's own waits are ours
    (`PromptOpExecutor`), so torch's `_delay` has no other call to make meanwhile."""
    delay = dynamic_rendezvous._delay  # type: ignore[attr-defined]  # imported there from its utils
    dynamic_rendezvous._delay = lambda seconds: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dynamic_rendezvous._delay = delay  # type: ignore[attr-defined]


def method_name(depth: int = 2) -> str:
    """What torch's `get_method_name` returns (the name of the function `depth` frames up from this
    one, for its rendezvous events), without `inspect.stack()`: that reads every frame's source and
    looks up its module, milliseconds a call, and torch calls it twice for each of the records a round
    writes at every step of its ops, whether or not anything is logged: a re-form's join spent most of
    its time there."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shallower stack, as torch's own answers it
        return "no_method_name"
