"""The rules of a rendezvous round, pure: when the round a node trains in has ended, which members
are lost, when a forming round may complete before its last call (and whom it waits for), which
nodes left, and what a node writes back where etcd lost the state (`forgotten`, `restored`,
`rejoined_round`).

Each takes torch's (sanitized) rendezvous state, or the records under the run's prefix, and
decides; handler.py reads the state and acts. Why these rules and not torch's is in handler.py's
docstring (points 1 and 4).
"""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any


def membership_changed(joined_round: int, joined_members: frozenset[Any], state: Any) -> tuple[bool, str]:
    """Decide whether the round this node trains in has ended.

    Pure: takes the round we joined, its members, and torch's current
    (sanitized) rendezvous state. Returns (changed, reason).

    A state that etcd began again after it lost its data (`forgotten`) reads as a round that ended:
    the agent restores its round first (handler.py, `restored`), so this is said only of one it could
    not restore, and a loss is still seen.
    """
    if state.round != joined_round:
        return True, f"round {joined_round} ended (now {state.round})"
    if forgotten(joined_round, joined_members, state):
        return True, f"round {joined_round} is gone from the rendezvous (etcd lost its data)"
    lost = [str(node) for node in joined_members if node not in state.participants]
    if lost:
        return True, f"member(s) {', '.join(sorted(lost))} stopped heartbeating"
    return False, ""


def forgotten(joined_round: int, joined_members: frozenset[Any], state: Any) -> bool:
    """Whether `state` was begun again since this node joined round `joined_round` (whose members were
    `joined_members`): etcd lost its data (the managed etcd keeps it in memory, and its pod moves at a
    drain or an upgrade), and the state read is torch's empty one or one a newcomer wrote since. Pure.

    Why it shows: a round this node is in stays complete, and admits nobody, until its last member
    leaves it, and the round after it is numbered above it. So an older round, or this round's
    number forming or with a stranger in it, cannot follow it. Rounds that began again at 0 would
    give in-place workers generations older than the one they train in, which they refuse
    (live.py): every loss then waited 30 s and restarted every worker.
    """
    if state.round != joined_round:
        return bool(state.round < joined_round)
    return not state.complete or any(node not in joined_members for node in state.participants)


def restored(joined: Any, state: Any, now: datetime) -> Any:
    """The round this node trains in, as torch's state held it when the node joined it (`joined`), to
    write over `state`, which etcd began again (`forgotten`). Pure. Its members get a heartbeat at
    `now` (liveness and torch's expiry judge them from there); whoever `state` holds that came since
    waits for the next round, as a node that asks to join a complete round does, and so does a member
    found there (it left the round: its agent joins again). So the round, its members and its number
    go on as if etcd had kept them: training goes on, a loss is seen, and a joiner's round follows it.
    """
    round_ = copy.deepcopy(joined)
    came = {*state.participants, *state.wait_list, *state.redundancy_list}
    for node in came & set(round_.participants):
        del round_.participants[node]
    round_.wait_list = came - set(round_.participants)
    round_.redundancy_list = set()
    round_.last_heartbeats = {node: now for node in round_.participants} | {
        node: state.last_heartbeats.get(node, now) for node in round_.wait_list
    }
    return round_


def rejoined_round(previous_round: int, previous_members: frozenset[Any], node: Any, state: Any) -> int | None:
    """The round number a node that left round `previous_round` (whose members were `previous_members`)
    writes into the state it joins through, where etcd began that state again since (`forgotten`, or
    the node itself still in its old round, which it left): the round after its old one, so that the
    generations its workers are handed only grow. Pure. None where the state follows on (or the node
    was in no round: a new node knows nothing to compare with)."""
    if not previous_members:
        return None
    if state.round == previous_round and node in state.participants and state.complete:
        return previous_round + 1  # it left that round: only a state begun again still holds it there
    return previous_round + 1 if forgotten(previous_round, previous_members, state) else None


def lost_members(joined_members: frozenset[Any], state: Any) -> list[str]:
    """Members of our round that stopped heartbeating (torch's sync drops dead nodes'
    heartbeats), whatever round the state has moved on to. Pure."""
    return sorted(str(node) for node in joined_members if node not in state.last_heartbeats)


def complete_early(
    previous: frozenset[Any],
    node: Any,
    state: Any,
    min_nodes: int,
    *,
    gone: frozenset[str] = frozenset(),
    deferred: frozenset[Any] = frozenset(),
) -> bool:
    """Whether `node` may complete the forming round now instead of at its last call.

    Pure. Yes when the round is still open, has `min_nodes`, holds `node`, no node waits
    for a later round (but those in `deferred`, which the completion leaves waiting anyway:
    `waiting_joiners`), and every member of the previous round (`previous`) has joined it
    or is known to be gone (its name is in `gone`): whoever else might come is a stranger,
    and strangers join the next round anyway. No for a first round (nobody to expect).
    A missing member that is not known gone is waited for until the last call, even if it
    has no heartbeat: a member between leaving the old round and joining the new one has
    none either, and a round that did not wait for it would form without it.
    """
    if state.complete or state.closed or not previous or state.wait_list - deferred:
        return False
    if node not in state.participants or len(state.participants) < min_nodes:
        return False
    return all(member in state.participants or str(member) in gone for member in previous)


def expected_members(previous: frozenset[Any], newcomers: frozenset[Any], *, trained: bool) -> frozenset[Any]:
    """The members of the previous round that a forming round waits for (`complete_early`): all of
    them, less the nodes that joined it (`newcomers`) where it never trained (`trained`: a local
    worker completed a step in its generation). Pure.

    Why: workers that re-form in place train on in their generation while a round that adds a node
    waits for that node's worker to set up (live.py's deferred join). A loss meanwhile ends that
    round before it trained, and the next one, waited for its joiner, waited for the joiner's
    start-up too (on a CPU, seconds of the survivors' time; on a GPU node the start-up is CUDA's and
    NCCL's). Such a joiner holds no state the others need; it joins the round
    after, as any stranger does, while the survivors train."""
    return previous if trained else previous - newcomers


def joiners_to_release(round_: int, members: frozenset[Any], newcomers: frozenset[Any], state: Any) -> list[Any]:
    """The joiners (`newcomers`) of round `round_` (whose members were `members`) that a survivor takes
    out of it as it leaves it, where that round never trained (the caller knows; `expected_members`
    says why). Pure. Only while the state still holds that round, complete, and it has lost another
    member: torch moves a complete round on only once every participant has left it, so a joiner
    whose agent cannot leave yet (it waits for its fork server's imports before it looks again)
    held the survivors' next round as long. Another change (a second joiner) releases nobody: the
    survivors' deferred join goes on into the next round."""
    if state.round != round_ or not state.complete:
        return []
    if all(member in state.participants for member in members - newcomers):
        return []
    return sorted((node for node in newcomers if node in state.participants), key=str)


def joiners_to_defer(expected: frozenset[Any], state: Any, min_nodes: int) -> list[Any]:
    """The participants of a forming round that wait for the next round instead: those not among the
    previous round's `expected` members (`expected_members`), where the round follows a loss (one of
    them is not in it) and has `min_nodes` without them. Pure. None where `expected` is empty (a
    first round, or the caller's workers do not train on while a joiner sets up).

    Why: a round that both loses a member and adds one is no pure growth, so workers that re-form in
    place cannot train on in their generation while the joiner sets up (live.py's deferred join):
    they would wait in its group build for the joiner's start-up.
    Formed of the survivors, the round re-forms them at once, and the joiner's round follows as a
    deferred join."""
    if not expected or all(member in state.participants for member in expected):
        return []
    joiners = sorted((node for node in state.participants if node not in expected), key=str)
    return joiners if len(state.participants) - len(joiners) >= min_nodes else []


def waiting_joiners(expected: frozenset[Any], state: Any) -> frozenset[Any]:
    """The nodes of a forming round's wait list that it leaves waiting, as `joiners_to_defer` leaves its
    joining participants: those not among the previous round's `expected` members, where one of them
    is not in it (a loss, once the caller knows it gone). Pure. None where `expected` is empty.

    Why: a node waits where it asked to join while the round before was still complete, and it moves
    into the next round only at its own next look, which a joiner's agent still starting may take a
    while to make. The survivors waited for it, and then deferred it all the same; without its look
    the round waited for its last call."""
    if not expected or all(member in state.participants for member in expected):
        return frozenset()
    return frozenset(node for node in state.wait_list if node not in expected)


def newcomers_of(joined: frozenset[Any], previous: frozenset[Any]) -> frozenset[Any]:
    """The members of a round just joined (`joined`) that were not in the round this node was in before
    (`previous`). Pure. None for a node's first round: every member of it is new to it, and none is
    known to be a joiner."""
    return joined - previous if previous else frozenset()


def departed_since(records: dict[str, bytes], prefix: str, round_: int) -> frozenset[str]:
    """The nodes of `records` (the keys under `prefix`, valued with a round) that left in
    round `round_` or later. Pure; a value that is not a round is ignored.

    The round matters because a name can come back: torch names a node by host name and
    agent pid, and a replacement pod may get both. Once it is in a later round, leaving
    that round for a restart is no departure. (The nodes found dead are filtered the same
    way, for a frozen node that thaws.)
    """
    names = set()
    for key, value in records.items():
        try:
            left = int(value)
        except ValueError:
            continue
        if key.startswith(prefix) and left >= round_:
            names.add(key[len(prefix) :])
    return frozenset(names)
