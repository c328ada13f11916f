"""The rules of a rendezvous round, pure: when the round a node trains in has ended, which members
are lost, when a forming round may complete before its last call, and which nodes left.

Each takes torch's (sanitized) rendezvous state, or the records under the run's prefix, and
decides; handler.py reads the state and acts. Why these rules and not torch's is in handler.py's
docstring (points 1 and 4).
"""

from __future__ import annotations

from typing import Any


def membership_changed(joined_round: int, joined_members: frozenset[Any], state: Any) -> tuple[bool, str]:
    """Decide whether the round this node trains in has ended.

    Pure: takes the round we joined, its members, and torch's current
    (sanitized) rendezvous state. Returns (changed, reason).

    A state that is entirely empty (round 0, nobody in it) means etcd lost its
    data; that alone is no reason to stop a job that trains fine, so the next
    real membership change starts a fresh round instead.
    """
    pristine = (
        state.round == 0 and not state.participants and not state.wait_list and not state.complete and not state.closed
    )
    if pristine:
        return False, ""
    if state.round != joined_round:
        return True, f"round {joined_round} ended (now {state.round})"
    lost = [str(node) for node in joined_members if node not in state.participants]
    if lost:
        return True, f"member(s) {', '.join(sorted(lost))} stopped heartbeating"
    return False, ""


def lost_members(joined_members: frozenset[Any], state: Any) -> list[str]:
    """Members of our round that stopped heartbeating (torch's sync drops dead nodes'
    heartbeats), whatever round the state has moved on to. Pure."""
    return sorted(str(node) for node in joined_members if node not in state.last_heartbeats)


def complete_early(
    previous: frozenset[Any], node: Any, state: Any, min_nodes: int, gone: frozenset[str] = frozenset()
) -> bool:
    """Whether `node` may complete the forming round now instead of at its last call.

    Pure. Yes when the round is still open, has `min_nodes`, holds `node`, no node waits
    for a later round, and every member of the previous round (`previous`) has joined it
    or is known to be gone (its name is in `gone`): whoever else might come is a stranger,
    and strangers join the next round anyway. No for a first round (nobody to expect).
    A missing member that is not known gone is waited for until the last call, even if it
    has no heartbeat: a member between leaving the old round and joining the new one has
    none either (bench run 10 formed a round of one that way).
    """
    if state.complete or state.closed or not previous or state.wait_list:
        return False
    if node not in state.participants or len(state.participants) < min_nodes:
        return False
    return all(member in state.participants or str(member) in gone for member in previous)


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
