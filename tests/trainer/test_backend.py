"""The etcd-v3 backend, store and handler against a real etcd server."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousTimeoutError,
    dynamic_rendezvous,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousJoinOp,
    _RendezvousState,
)
from torch.distributed.launcher import api as launcher_api
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import wait_for
from torchspot_trainer.handover import Handover, InPlaceAgent
from torchspot_trainer.markers import PEER_LOST_ENV, name_peer_lost_marker, node_leaving
from torchspot_trainer.rendezvous import milestones
from torchspot_trainer.rendezvous.backend import EtcdV3RendezvousBackend, RunLease
from torchspot_trainer.rendezvous.etcd_client import EtcdClient
from torchspot_trainer.rendezvous.handler import EtcdV3RendezvousHandler, create_handler, register
from torchspot_trainer.rendezvous.milestones import CheckpointReporter
from torchspot_trainer.rendezvous.rounds import (
    complete_early,
    departed_since,
    expected_members,
    forgotten,
    joiners_to_defer,
    joiners_to_release,
    lost_members,
    membership_changed,
    newcomers_of,
    rejoined_round,
    restored,
    waiting_joiners,
)
from torchspot_trainer.rendezvous.settings import EtcdV3Settings
from torchspot_trainer.rendezvous.store import EtcdStore, RoundAbandoned
from torchspot_trainer.rendezvous.torch_glue import method_name


def _backend(etcd: EtcdServer, run_id: str, **overrides: Any) -> tuple[EtcdV3RendezvousBackend, EtcdClient]:
    settings = EtcdV3Settings(host="127.0.0.1", port=etcd.port, run_id=run_id, **overrides)
    client = EtcdClient("127.0.0.1", etcd.port, request_timeout=2.0)
    return EtcdV3RendezvousBackend(client, settings, RunLease(client, settings.lease_ttl)), client


def test_set_state_creates_then_compares_and_sets(etcd: EtcdServer, run_id: str) -> None:
    backend, _ = _backend(etcd, run_id)
    assert backend.get_state() is None

    created = backend.set_state(b"v1", None)
    assert created is not None
    value, token, ok = created
    assert (value, ok) == (b"v1", True)

    # A second "create" loses: the key exists, and the winner's value comes back.
    lost = backend.set_state(b"other", None)
    assert lost == (b"v1", token, False)

    updated = backend.set_state(b"v2", token)
    assert updated is not None
    assert updated[0] == b"v2"
    assert updated[2] is True
    assert updated[1] > token
    assert backend.get_state() == (b"v2", updated[1])


def test_stale_token_is_fenced_out(etcd: EtcdServer, run_id: str) -> None:
    """A writer holding an old revision (a node that was frozen) cannot overwrite."""
    backend, _ = _backend(etcd, run_id)
    first = backend.set_state(b"round-1", None)
    assert first is not None
    stale_token = first[1]
    fresh = backend.set_state(b"round-2", stale_token)
    assert fresh is not None
    assert fresh[2] is True

    late = backend.set_state(b"round-1-late-write", stale_token)
    assert late == (b"round-2", fresh[1], False)
    assert backend.get_state() == (b"round-2", fresh[1])


def test_concurrent_writers_lose_no_update(etcd: EtcdServer, run_id: str) -> None:
    """Eight threads increment a counter through compare-and-set; none is lost."""
    writers, increments = 8, 25

    def work() -> None:
        backend, client = _backend(etcd, run_id)
        for _ in range(increments):
            while True:
                current = backend.get_state()
                value, token = (current[0], current[1]) if current else (b"0", None)
                result = backend.set_state(str(int(value) + 1).encode(), token)
                if result is not None and result[2]:
                    break
        client.close()

    threads = [threading.Thread(target=work) for _ in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    backend, _ = _backend(etcd, run_id)
    final = backend.get_state()
    assert final is not None
    assert int(final[0]) == writers * increments


def test_run_ids_are_isolated(etcd: EtcdServer, run_id: str) -> None:
    first, _ = _backend(etcd, run_id)
    second, _ = _backend(etcd, run_id + "-other")
    assert first.set_state(b"mine", None) is not None
    assert second.get_state() is None


def test_a_runs_keys_are_deleted_but_its_status_records_which_the_operator_reads_once_more(
    etcd: EtcdServer, run_id: str
) -> None:
    """The last agent out deletes its run's keys but those under `keep` (its status: the final checkpoint's
    record, read by the operator after the last worker exited), in one transaction, and no other run's."""
    client = etcd.client()
    root = milestones.milestone_prefix(run_id).removesuffix("/status/")
    names = ["/", "/state", "/status", "/status/checkpoint", "/status/step", "/statusx", "/zz", "-other/state"]
    for name in names:
        client.put(root + name, b"1", lease=None)
    client.delete_prefix(f"{root}/", keep=milestones.milestone_prefix(run_id))
    assert sorted(client.get_prefix(root)) == [
        f"{root}-other/state",
        f"{root}/status/checkpoint",
        f"{root}/status/step",
    ]
    with pytest.raises(ValueError, match="is not under"):
        client.delete_prefix(f"{root}/", keep=f"{root}-other/")
    client.delete_prefix(f"{root}/")
    assert sorted(client.get_prefix(root)) == [f"{root}-other/state"]
    client.close()


def test_abandoned_keys_expire_by_lease(etcd: EtcdServer, run_id: str) -> None:
    """When no agent refreshes the lease any more, the run's keys disappear."""
    backend, client = _backend(etcd, run_id, lease_ttl=2, keep_alive_interval=0.2)
    settings = EtcdV3Settings(host="127.0.0.1", port=etcd.port, run_id=run_id, lease_ttl=2)
    store = EtcdStore(client, settings, RunLease(client, 2))
    assert backend.set_state(b"state", None) is not None
    store.set("MASTER_ADDR", "10.0.0.1")
    assert client.get_prefix(settings.run_prefix)
    # Nobody writes any more (every agent was killed): the keys expire.
    wait_for(lambda: not client.get_prefix(settings.run_prefix), timeout=10, what="keys to expire")


def test_lease_is_regranted_after_etcd_forgets_it(etcd: EtcdServer, run_id: str) -> None:
    """After etcd lost its data (and so our lease), the next write still succeeds."""
    backend, _ = _backend(etcd, run_id)
    assert backend.set_state(b"before", None) is not None
    etcd.restart(wipe=True)
    assert backend.get_state() is None
    again = backend.set_state(b"after", None)
    assert again is not None
    assert again[2] is True


def test_store_operations(etcd: EtcdServer, run_id: str) -> None:
    settings = EtcdV3Settings(host="127.0.0.1", port=etcd.port, run_id=run_id)
    client = EtcdClient("127.0.0.1", etcd.port, request_timeout=2.0)
    raw = EtcdStore(client, settings, RunLease(client, 60))
    raw.set_timeout(timedelta(seconds=2))
    # torch wraps the store in a PrefixStore per round; exercise it through that.
    store = PrefixStore("torch.rendezvous.job.3", raw)

    store.set("addr", "10.1.2.3")
    assert store.get("addr") == b"10.1.2.3"
    assert store.add("count", 2) == 2
    assert store.add("count", 3) == 5
    assert store.get("count") == b"5"
    assert store.check(["addr", "count"])
    assert not store.check(["addr", "missing"])
    assert store.compare_set("cas", "", "first") == b"first"
    assert store.compare_set("cas", "wrong", "second") == b"first"
    assert store.compare_set("cas", "first", "second") == b"second"
    assert store.multi_get(["addr", "cas"]) == [b"10.1.2.3", b"second"]
    assert raw.num_keys() == 3
    assert store.delete_key("cas")
    assert not store.check(["cas"])

    threading.Timer(0.3, lambda: store.set("late", "x")).start()
    store.wait(["late"])  # returns once another writer publishes it
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.wait(["missing"], timedelta(seconds=0.5))
    assert time.monotonic() - started < 2


def test_a_blocking_read_returns_when_the_key_is_written_not_at_its_next_poll(etcd: EtcdServer, run_id: str) -> None:
    """A poll of 5 s: a read that only polled would return at least 5 s after its first look; the
    watch it opens while it waits returns it when the key is written."""
    settings = EtcdV3Settings(host="127.0.0.1", port=etcd.port, run_id=run_id, store_poll_interval=5.0)
    client = EtcdClient("127.0.0.1", etcd.port, request_timeout=2.0)
    store = EtcdStore(client, settings, RunLease(client, 60))
    store.set_timeout(timedelta(seconds=30))
    threading.Timer(0.5, lambda: store.set("addr", "10.1.2.3")).start()
    started = time.monotonic()
    assert store.get("addr") == b"10.1.2.3"
    assert time.monotonic() - started < 3.0


def test_concurrent_adds_are_atomic(etcd: EtcdServer, run_id: str) -> None:
    settings = EtcdV3Settings(host="127.0.0.1", port=etcd.port, run_id=run_id)

    def work() -> None:
        client = EtcdClient("127.0.0.1", etcd.port, request_timeout=2.0)
        store = EtcdStore(client, settings, RunLease(client, 60))
        for _ in range(20):
            store.add("n", 1)

    threads = [threading.Thread(target=work) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client = EtcdClient("127.0.0.1", etcd.port, request_timeout=2.0)
    assert EtcdStore(client, settings, RunLease(client, 60)).get("n") == b"100"


def test_outage_is_not_counted_as_missed_heartbeats(etcd: EtcdServer, run_id: str) -> None:
    """After etcd comes back, heartbeats that went stale during the outage are forgiven."""
    backend, _ = _backend(etcd, run_id, keep_alive_interval=0.5)
    state = _RendezvousState()
    old = datetime.now(UTC) - timedelta(seconds=30)
    node = _NodeDesc(addr="node-a", pid=1, local_id=0)
    state.last_heartbeats = {node: old}
    assert backend.set_state(pickle.dumps(state), None) is not None

    etcd.stop()
    with pytest.raises(RendezvousConnectionError, match=etcd.endpoint):
        backend.get_state()
    etcd.start()
    got = wait_for(lambda: _try_get(backend), timeout=10, what="etcd to answer again")
    beats = pickle.loads(got[0]).last_heartbeats
    assert beats[node] > datetime.now(UTC) - timedelta(seconds=5)


def test_write_pending_through_an_outage_lands_with_its_heartbeats_forgiven(etcd: EtcdServer, run_id: str) -> None:
    """torch retries a keep-alive whose write failed when etcd went away with the same state:
    every heartbeat in it, the writer's own too, is as old as the outage. It must not land as
    it is (nobody wrote since, so its token still matches): torch would find every member dead
    and start a new round, restarting a job that trained fine (a CI run did so)."""
    backend, _ = _backend(etcd, run_id, keep_alive_interval=0.5)  # dead after 1.5 s
    node = _NodeDesc(addr="node-a", pid=1, local_id=0)
    state = _RendezvousState()
    state.participants = {node: 0}
    state.complete = True
    state.last_heartbeats = {node: datetime.now(UTC)}
    written = backend.set_state(pickle.dumps(state), None)
    assert written is not None
    token = written[1]

    etcd.stop()
    with pytest.raises(RendezvousConnectionError, match=etcd.endpoint):
        backend.set_state(pickle.dumps(state), token)
    etcd.start()
    state.last_heartbeats = {node: datetime.now(UTC) - timedelta(seconds=30)}  # a 30 s outage
    pending = pickle.dumps(state)  # as torch holds it: its heartbeat from before the outage
    result = wait_for(lambda: _try_set(backend, pending, token), timeout=10, what="etcd to answer again")
    assert result[2], "the pending write went through (its token still matched)"
    fresh = datetime.now(UTC) - timedelta(seconds=1.5)
    assert pickle.loads(result[0]).last_heartbeats[node] > fresh  # what torch sanitizes next
    reader, _ = _backend(etcd, run_id)  # an agent that saw no outage (one that joins now)
    got = reader.get_state()
    assert got is not None
    assert pickle.loads(got[0]).last_heartbeats[node] > fresh


def _try_set(backend: EtcdV3RendezvousBackend, bits: bytes, token: Any) -> tuple[bytes, Any, bool] | None:
    try:
        return backend.set_state(bits, token)
    except RendezvousConnectionError:
        return None


def _try_get(backend: EtcdV3RendezvousBackend) -> tuple[bytes, Any] | None:
    try:
        return backend.get_state()
    except RendezvousConnectionError:
        return None


def test_unreachable_endpoint_fails_fast_naming_it(run_id: str) -> None:
    from torchspot_lab.etcd import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, connect_timeout="1.5")
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"etcd at {endpoint} is unreachable"):
        create_handler(params)
    assert time.monotonic() - started < 5


def _state(round_: int, participants: list[str], **extra: Any) -> Any:
    base = {
        "round": round_,
        "participants": dict.fromkeys(participants, 0),
        "wait_list": set(),
        "complete": True,
        "closed": False,
    }
    base.update(extra)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("state", "changed"),
    [
        (_state(4, ["a", "b", "c"]), False),
        (_state(4, ["a", "b", "c"], wait_list={"d"}), False),
        (_state(4, ["a", "b"]), True),
        (_state(5, ["a", "b", "c"]), True),
        (_state(0, [], complete=False), True),
        (_state(0, ["z"], complete=False), True),
        (_state(4, ["z"], complete=False), True),
        (_state(4, ["a", "b", "z"]), True),
    ],
    ids=[
        "same-round",
        "someone-waiting",
        "member-lost",
        "round-moved-on",
        "etcd-lost-data-and-nobody-restored-the-round",
        "fresh-round-after-data-loss",
        "a-round-of-the-same-number-forming",
        "a-round-of-the-same-number-with-a-stranger",
    ],
)
def test_membership_changed(state: Any, changed: bool) -> None:
    got, reason = membership_changed(4, frozenset({"a", "b", "c"}), state)
    assert got is changed
    assert bool(reason) is changed


@pytest.mark.parametrize(
    ("state", "lost"),
    [
        (_state(4, ["a", "b", "c"]), False),
        (_state(4, ["a", "b"], wait_list={"d"}), False),
        (_state(6, [], complete=False), False),
        (_state(0, [], complete=False), True),
        (_state(2, ["d"]), True),
        (_state(4, ["d"], complete=False), True),
        (_state(4, ["a", "d"]), True),
    ],
    ids=["our-round", "our-round-less-one-and-a-joiner", "a-later-round", "empty", "an-older-round",
         "our-number-forming", "our-number-with-a-stranger"],
)  # fmt: skip
def test_a_state_that_cannot_follow_our_round_is_one_etcd_began_again(state: Any, lost: bool) -> None:
    """A round stays complete and admits nobody until its last member leaves it, and the next one is
    numbered above it: anything else was written after etcd lost its data."""
    assert forgotten(4, frozenset({"a", "b", "c"}), state) is lost


def test_a_round_written_back_keeps_its_members_and_ranks_and_lets_newcomers_wait() -> None:
    """`restored`: the round as joined (complete, its ranks), fresh heartbeats for its members; a
    newcomer that wrote a round of its own waits for the next one with its own heartbeat, and so does
    a member found joining again (it left the round)."""
    now, then = datetime(2026, 12, 6, 12, tzinfo=UTC), datetime(2026, 12, 6, 11, tzinfo=UTC)
    a, b, c, d = (_NodeDesc(addr=name, pid=1, local_id=0) for name in "abcd")
    joined = _RendezvousState()
    joined.round, joined.complete = 9, True
    joined.participants = {a: 0, b: 1, c: 2}
    joined.last_heartbeats = dict.fromkeys(joined.participants, then)
    found = _RendezvousState()
    found.participants = {d: 0, c: 0}
    found.last_heartbeats = {d: then, c: then}
    state = restored(joined, found, now)
    assert (state.round, state.complete, state.closed, state.deadline) == (9, True, False, None)
    assert state.participants == {a: 0, b: 1}
    assert state.wait_list == {c, d}
    assert state.last_heartbeats == {a: now, b: now, c: then, d: then}
    assert joined.participants == {a: 0, b: 1, c: 2}  # what the agent keeps is not changed
    assert not forgotten(9, frozenset(joined.participants), state)


@pytest.mark.parametrize(
    ("state", "numbered"),
    [
        (_state(4, ["b", "c"]), None),
        (_state(5, ["b"], complete=False), None),
        (_state(4, ["a", "b", "c"]), 5),
        (_state(0, [], complete=False), 5),
        (_state(0, ["d"], complete=False), 5),
    ],
    ids=["our-round-left", "the-next-forming", "still-in-it", "empty", "a-newcomers-round"],
)
def test_a_node_re_joining_a_state_begun_again_numbers_the_round_after_its_last(state: Any, numbered: int) -> None:
    """`rejoined_round`: a node that left round 4 joins round 5 or later; a new node knows nothing."""
    assert rejoined_round(4, frozenset({"a", "b", "c"}), "a", state) == numbered
    assert rejoined_round(0, frozenset(), "a", _state(0, [], complete=False)) is None


@pytest.mark.parametrize(
    ("heartbeats", "lost"),
    [({"a", "b", "c"}, []), ({"a", "c"}, ["b"]), ({"a", "b", "c", "d"}, []), (set(), ["a", "b", "c"])],
    ids=["all-alive", "one-dead", "newcomer", "all-dead"],
)
def test_lost_members_are_those_without_heartbeats_whatever_the_round(heartbeats: set[str], lost: list[str]) -> None:
    state = _state(9, ["a"], last_heartbeats=dict.fromkeys(heartbeats, 0))  # the round moved on
    assert lost_members(frozenset({"a", "b", "c"}), state) == lost


@pytest.mark.parametrize(
    ("participants", "extra", "early"),
    [
        (["a", "b"], {}, True),
        (["a"], {}, False),
        (["a"], {"last_heartbeats": {"a": 0}}, False),  # b may be between two rounds
        (["a", "b", "d"], {}, True),
        (["a", "b"], {"wait_list": {"d"}}, False),
        (["a", "b"], {"complete": True}, False),
        (["b"], {}, False),
        (["a", "b"], {"closed": True}, False),
    ],
    ids=["all-rejoined", "one-still-coming", "one-without-heartbeat", "with-a-stranger", "joiner-waiting",
         "already-complete", "not-in-it", "closed"],
)  # fmt: skip
def test_complete_early_when_every_member_of_the_last_round_rejoined(
    participants: list[str], extra: dict[str, Any], early: bool
) -> None:
    state = _state(8, participants, **({"complete": False, "last_heartbeats": {"a": 0, "b": 0}} | extra))
    assert complete_early(frozenset({"a", "b"}), "a", state, min_nodes=1) is early


@pytest.mark.parametrize(
    ("participants", "gone", "early"),
    [(["a"], {"b"}, True), (["a"], {"c"}, False), (["a", "b"], {"b"}, True), (["b"], {"b"}, False)],
    ids=["missing-one-gone", "someone-else-gone", "gone-but-back", "not-in-it"],
)
def test_complete_early_does_not_wait_for_a_member_known_gone(
    participants: list[str], gone: set[str], early: bool
) -> None:
    state = _state(8, participants, complete=False, last_heartbeats={"a": 0})
    assert complete_early(frozenset({"a", "b"}), "a", state, min_nodes=1, gone=frozenset(gone)) is early


@pytest.mark.parametrize(
    ("records", "since", "names"),
    [
        ({"p/n1": b"4", "p/n2": b"6"}, 5, {"n2"}),
        ({"p/n1": b"4", "p/n2": b"6"}, 4, {"n1", "n2"}),
        ({"p/n1": b"junk", "q/n2": b"9"}, 0, set()),
    ],
    ids=["earlier-round-ignored", "same-round-counts", "junk-and-foreign-keys"],
)
def test_departed_since_reads_the_round_each_node_left(records: dict[str, bytes], since: int, names: set[str]) -> None:
    assert departed_since(records, "p/", since) == names


@pytest.mark.parametrize(
    ("trained", "early"), [(False, True), (True, False)], ids=["join-never-trained", "join-trained"]
)
def test_a_joiner_of_a_round_that_never_trained_is_not_waited_for(trained: bool, early: bool) -> None:
    """Round 8 added d to a, b, c; c is lost before the survivors' workers switched to it (they train
    on in round 7 while d sets up): round 9 completes with a and b. Had round 8 trained, d is a
    member like any other and is waited for."""
    joined = frozenset({"a", "b", "c", "d"})
    newcomers = newcomers_of(joined, frozenset({"a", "b", "c"}))
    assert newcomers == {"d"}
    expected = expected_members(joined, newcomers, trained=trained)
    state = _state(9, ["a", "b"], complete=False, last_heartbeats={"a": 0, "b": 0, "d": 0})
    assert complete_early(expected, "a", state, min_nodes=1, gone=frozenset({"c"})) is early


@pytest.mark.parametrize(
    ("round_", "participants", "extra", "released"),
    [
        (8, ["a", "b", "d"], {}, ["d"]),
        (8, ["a", "b", "c", "d"], {"wait_list": {"e"}}, []),
        (8, ["a", "d"], {"complete": False}, []),
        (9, ["a", "d"], {}, []),
        (8, ["a", "b"], {}, []),
    ],
    ids=["lost-one", "a-second-joiner", "not-complete", "moved-on", "joiner-left-already"],
)  # fmt: skip
def test_a_survivor_releases_the_joiners_of_the_round_it_leaves_only_after_a_loss(
    round_: int, participants: list[str], extra: dict[str, Any], released: list[str]
) -> None:
    """Round 8 added d to a, b, c and never trained: after c's loss a survivor takes d out of it, so the
    round moves on once the survivors left it; a change that lost nobody leaves d in (the survivors'
    deferred join goes on), and so does a state that is no longer round 8 as it was."""
    state = _state(round_, participants, **({"complete": True} | extra))
    members = frozenset({"a", "b", "c", "d"})
    assert joiners_to_release(8, members, frozenset({"d"}), state) == released


@pytest.mark.parametrize(
    ("participants", "expected", "min_nodes", "deferred"),
    [
        (["a", "b", "d"], {"a", "b", "c"}, 1, ["d"]),
        (["a", "b", "c", "d"], {"a", "b", "c"}, 1, []),
        (["a", "d"], {"a", "b", "c"}, 2, []),
        (["a", "d"], set(), 1, []),
    ],
    ids=["after-a-loss", "no-loss", "needed-for-min-nodes", "not-deferring"],
)  # fmt: skip
def test_a_round_after_a_loss_leaves_its_joiners_for_the_next_one(
    participants: list[str], expected: set[str], min_nodes: int, deferred: list[str]
) -> None:
    """c is lost as d comes: the survivors form their round without d, whose round follows as a
    deferred join. A pure growth keeps d (that is the deferred join); so does a round that needs d
    for its minimum size, and one whose completer's workers do not train on meanwhile."""
    state = _state(9, participants, complete=False)
    assert joiners_to_defer(frozenset(expected), state, min_nodes) == deferred


@pytest.mark.parametrize(
    ("participants", "waiting", "expected", "left_waiting", "early"),
    [
        (["a", "b"], {"d"}, {"a", "b", "c"}, {"d"}, True),
        (["a", "b"], {"c"}, {"a", "b", "c"}, set(), False),
        (["a", "b", "c"], {"d"}, {"a", "b", "c"}, set(), False),
        (["a"], {"d"}, set(), set(), False),
    ],
    ids=["after-a-loss", "a-member-waits", "no-loss", "a-first-round"],
)  # fmt: skip
def test_a_joiner_waiting_for_a_round_after_a_loss_does_not_hold_it(
    participants: list[str], waiting: set[str], expected: set[str], left_waiting: set[str], early: bool
) -> None:
    """c is gone and d waits to join (it asked while the round before was complete): the survivors
    complete without d, which stays waiting, as a joining participant would be deferred. A waiting
    member is waited for, and so is a joiner where nobody was lost, or in a first round."""
    state = _state(9, participants, complete=False, wait_list=set(waiting))
    assert waiting_joiners(frozenset(expected), state) == left_waiting
    gone = frozenset({"c"})
    deferred = waiting_joiners(frozenset(expected), state)
    assert complete_early(frozenset(expected), "a", state, 1, gone=gone, deferred=deferred) is early


def test_nobody_is_a_newcomer_of_a_nodes_first_round() -> None:
    """A node's first round (nothing before it): every member is new to it, none a known joiner, so
    the next round waits for them all even before anyone trained."""
    joined = frozenset({"a", "b"})
    assert newcomers_of(joined, frozenset()) == frozenset()
    assert expected_members(joined, newcomers_of(joined, frozenset()), trained=False) == joined


def test_complete_early_needs_min_nodes_and_a_previous_round() -> None:
    state = _state(8, ["a", "b"], complete=False, last_heartbeats={"a": 0, "b": 0})
    assert complete_early(frozenset({"a", "b"}), "a", state, min_nodes=3) is False
    assert complete_early(frozenset(), "a", state, min_nodes=1) is False  # a first round waits its last call


def test_torchs_records_are_named_as_it_names_them_without_reading_the_stack(run_id: str) -> None:
    """`method_name` answers as torch's `get_method_name` (the caller of the function that asks),
    and every handler built here makes torch's dynamic rendezvous use it."""

    def record() -> str:  # as torch's `_record` asks, for its caller
        return method_name()

    def named_here() -> str:
        return record()

    assert named_here() == "named_here"
    params = RendezvousParameters("etcd-v3", "127.0.0.1:1", run_id, 1, 1, connect_timeout="0.1")
    with pytest.raises(RendezvousConnectionError):  # nobody listens there: built up to the connection
        create_handler(params)
    assert dynamic_rendezvous.get_method_name is method_name


def _handlers(
    etcd: EtcdServer, run_id: str, n: int, min_nodes: int = 1, **settings: str
) -> list[EtcdV3RendezvousHandler]:
    """`n` handlers of one run (torch gives each its own node id in one process), of at most 3 nodes
    unless `max_nodes` says. By default heartbeats every 5 s (dead after 15 s) and a 30 s last call:
    neither can be what makes a round form within the 10 s join timeout."""
    max_nodes = int(settings.pop("max_nodes", "3"))
    conf = {"keep_alive_interval": "5", "last_call_timeout": "30", "join_timeout": "10"} | settings
    params = RendezvousParameters("etcd-v3", etcd.endpoint, run_id, min_nodes, max_nodes, **conf)
    return [create_handler(params) for _ in range(n)]  # type: ignore[misc]


def _waiting(handler: EtcdV3RendezvousHandler) -> int:
    """The nodes in the rendezvous's wait list, read afresh."""
    handler._watch.expire()
    handler._watch.sync()
    return len(handler._watch.state.wait_list)


def _join(handlers: list[EtcdV3RendezvousHandler]) -> list[tuple[int, int]]:
    """Every handler's next round, joined at once: (rank, world size) each."""
    with ThreadPoolExecutor(len(handlers)) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    return [(info.rank, info.world_size) for info in infos]


def test_leaving_node_and_prompt_round_let_the_others_reform_at_once(
    etcd: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node stopped by a signal takes itself out: the others see it within 5 s (not the 15 s
    its heartbeats would take) and form their round of two at once. The last call (30 s) is
    longer than the join timeout (10 s): a round that waited for the member that left fails.
    torch spreads the first joins of round 0 over up to 0.3 s; the re-form (from round 0 too)
    is not spread."""
    delays: list[float | tuple[float, float]] = []
    spread = dynamic_rendezvous._delay  # type: ignore[attr-defined]

    def recorded(seconds: float | tuple[float, float]) -> None:
        delays.append(seconds)
        spread(seconds)

    monkeypatch.setattr(dynamic_rendezvous, "_delay", recorded)
    a, b, c = handlers = _handlers(etcd, run_id, 3)
    try:
        assert sorted(_join(handlers)) == [(0, 3), (1, 3), (2, 3)]  # max_nodes: complete at once
        assert delays == [(0, 0.3)] * 3
        delays.clear()
        assert a.num_nodes_waiting() == 0

        assert not node_leaving()
        c.leave()
        assert node_leaving()  # its workers know before the others can see it gone
        assert wait_for(a.num_nodes_waiting, timeout=5, what="the member's departure") == 1
        # It left while still putting its liveness key: the workers keep their own grace (2 s) to
        # finish the step, where the leaving node's emergency checkpoint is written.
        assert Path(os.environ[PEER_LOST_ENV]).read_text() == ""
        assert sorted(_join([a, b])) == [(0, 2), (1, 2)]
        assert delays == []  # the re-form from round 0 was not spread
        assert b.num_nodes_waiting() == 0
    finally:
        for handler in handlers:
            handler.leave()


def test_dead_node_is_not_waited_for(etcd: EtcdServer, run_id: str) -> None:
    """A node whose heartbeats stop (a hard eviction) is found dead after 3 s, and the others
    form their round of two without waiting out the 30 s last call (join timeout 10 s)."""
    a, b, c = handlers = _handlers(etcd, run_id, 3, keep_alive_interval="1")
    try:
        assert sorted(_join(handlers)) == [(0, 3), (1, 3), (2, 3)]
        c._stop_heartbeats()  # what a killed node does: nothing more
        assert wait_for(a.num_nodes_waiting, timeout=10, what="the member found dead") == 1
        assert sorted(_join([a, b])) == [(0, 2), (1, 2)]
    finally:
        for handler in (a, b):
            handler.leave()


@contextlib.contextmanager
def _trained_pair(
    etcd: EtcdServer, run_id: str, *, trained: bool = True, **settings: str
) -> Iterator[tuple[EtcdV3RendezvousHandler, EtcdV3RendezvousHandler, EtcdV3RendezvousHandler, Handover]]:
    """a and b in a round of two that trained (unless not `trained`: the workers took no step yet), as
    agents whose workers train on while a joiner sets up (this process's live worker, registered as the
    trainer registers, stamped a step of it); d a node not in it yet; and the worker, to stamp the next
    steps. (c, the third of the first round, left.)"""
    a, b, c, d = _handlers(etcd, run_id, 4, 1, **settings)
    folder = Path(os.environ[PEER_LOST_ENV]).parent  # the agents' folder: these handlers share it
    worker = Handover(folder, 7)
    try:
        worker.register(stamps_steps=True)
        assert sorted(_join([a, b, c])) == [(0, 3), (1, 3), (2, 3)]  # max_nodes: complete at once
        c.leave()
        wait_for(a.num_nodes_waiting, timeout=5, what="c's departure")
        assert sorted(_join([a, b])) == [(0, 2), (1, 2)]
        if trained:
            worker.stepped(a.current_round)
        yield a, b, d, worker
    finally:
        for name in ("live-7", "stepped-7", "failed-7", "ack-7"):
            (folder / name).unlink(missing_ok=True)
        for handler in (a, b, d):
            handler.leave()


def test_a_worker_failed_in_its_round_with_no_member_lost_gets_a_next_round(etcd: EtcdServer, run_id: str) -> None:
    """Every rank fails a step alike where the heal's agreement refutes a hand-over, and no member is
    lost: nothing would change the round, and the workers waited for a next one until their 30 s
    ran out (a soak's survivor was restarted so). Twice the liveness timeout after the failure the
    agents re-form, the same members; a failure from before the worker entered the round does not
    count, however old."""
    with _trained_pair(etcd, run_id, liveness_timeout="0.75") as (a, b, _, worker):
        worker.report_failure()  # in the round before
        failed = Path(os.environ[PEER_LOST_ENV]).parent / "failed-7"
        os.utime(failed, (time.time() - 60, time.time() - 60))
        worker._acknowledge(a.current_round)  # it entered the round (`Handover.enter`)
        assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
        worker.report_failure()  # then failed in it
        failed_at = time.monotonic()
        assert a.num_nodes_waiting() == 0  # a lost member's is judged by liveness first
        wait_for(a.num_nodes_waiting, timeout=5, what="a re-forming")
        assert time.monotonic() - failed_at >= 1.5
        assert b.num_nodes_waiting() >= 1
        assert sorted(_join([a, b])) == [(0, 2), (1, 2)]
        assert a.num_nodes_waiting() == 0  # once: the failure was of the round before this one


def test_after_a_loss_the_survivors_do_not_wait_for_a_joiner_of_a_round_that_never_trained(
    etcd: EtcdServer, run_id: str
) -> None:
    """The next round adds d to a and b, whose workers train on in their round while d sets up (no
    step of the new one). b leaves, and d, still setting up, does not come back: a forms its next
    round alone at once, not at the 30 s last call (past the 10 s join timeout: a round that waited
    for d fails). d then joins the round after, as any joiner does, once a's workers trained in
    their round."""
    with _trained_pair(etcd, run_id) as (a, b, d, worker), ThreadPoolExecutor(1) as pool:
        joining = pool.submit(d.next_rendezvous)
        wait_for(a.num_nodes_waiting, timeout=5, what="d waiting to join")
        assert sorted(_join([a, b])) == [(0, 3), (1, 3)]
        assert joining.result(timeout=10).world_size == 3
        assert _grows(a)  # every member of the round before is in it: a deferred join may take it
        joined = a.current_round  # its workers still train in the round before (no step of this one)
        b.leave()
        wait_for(a.num_nodes_waiting, timeout=5, what="b's departure")
        assert _join([a]) == [(0, 1)]  # without d, which has not come back
        assert a.current_round == joined + 1
        assert not _grows(a)
        joining = pool.submit(d.next_rendezvous)
        wait_for(lambda: _waiting(a), timeout=5, what="d waiting to join again")
        assert a.num_nodes_waiting() == 0  # held until a's workers train in their round
        worker.stepped(a.current_round)
        wait_for(a.num_nodes_waiting, timeout=5, what="d let in")
        assert _join([a]) == [(0, 2)]
        assert joining.result(timeout=10).world_size == 2


def _grows(handler: EtcdV3RendezvousHandler) -> bool:
    """Its `grows_only`, read afresh (a property mypy would narrow across its rounds)."""
    return handler.grows_only


def _after_joiner_entered(
    member: EtcdV3RendezvousHandler, joiner: EtcdV3RendezvousHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hold `member`'s next join (torch's join op, after its exit op opened the round) until `joiner` is a
    participant of the round: the order in which a joiner comes as a member was lost, made certain.
    Once: the joins after it run as they come."""
    run = member._op_executor.run
    held = True
    holder = _BackendRendezvousStateHolder(member._backend, member._settings, cache_duration=0)

    def entered() -> bool:
        holder.sync()
        return joiner._this_node in holder.state.participants

    def run_after_joiner(op: Any, *args: Any) -> None:
        nonlocal held
        if held and isinstance(op, _RendezvousJoinOp):
            held = False
            wait_for(entered, timeout=10, what="the joiner in the round")
        run(op, *args)

    monkeypatch.setattr(member._op_executor, "run", run_after_joiner)


def test_a_node_that_comes_as_a_member_is_lost_joins_the_round_after_the_survivors_re_formed(
    etcd: EtcdServer, run_id: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """d waits to join as b leaves: a completes the next round without d, so its workers re-form at
    once instead of waiting in the new group for d's start-up, and d joins the round after, held
    until they trained in theirs (the other test) or, as here, failed in it and wait for a next.
    a says so once the round formed (not as it writes a completion that might lose). d comes as a
    member: a's join waits until d is in the round a's leaving opened (on 2 busy cores a completed it
    before d's look, and d then waited in the wait list: the other tests' case)."""
    with _trained_pair(etcd, run_id) as (a, b, d, worker), ThreadPoolExecutor(1) as pool:
        joining = pool.submit(d.next_rendezvous)
        wait_for(a.num_nodes_waiting, timeout=5, what="d waiting to join")
        b.leave()
        _after_joiner_entered(a, d, monkeypatch)
        with caplog.at_level(logging.WARNING, logger="torchspot_trainer.rendezvous.handler"):
            assert _join([a]) == [(0, 1)]  # the survivor alone, d left waiting
        said = [r.getMessage() for r in caplog.records if "without its joiner" in r.getMessage()]
        assert len(said) == 1
        assert said[0].endswith(f"a loss formed without its joiner(s) {d._this_node}: they join the next one")
        assert _waiting(a) == 1
        assert a.num_nodes_waiting() == 0  # held until a's workers train in their round, or fail in it
        worker.report_failure()  # (a heal refuted: the worker waits for the next round)
        wait_for(a.num_nodes_waiting, timeout=2, what="d let in")  # well within the hold's 5 s bound here
        assert _join([a]) == [(0, 2)]
        assert joining.result(timeout=10).world_size == 2


def test_a_joiner_that_waits_for_the_round_after_a_loss_does_not_hold_it(etcd: EtcdServer, run_id: str) -> None:
    """A joiner that asked to join while the survivors' round was still complete waits in the wait list,
    and moves into the next round only at its own next look, which a joiner still starting may make
    late; the survivors then left it out all the same. Here the joiner never looks again (a node no
    handler drives): a, whose workers train on while a joiner sets up, completes the round after b's
    loss without it, well within the 10 s join timeout (the 30 s last call would fail it), and the
    joiner still waits for the round after."""
    with _trained_pair(etcd, run_id) as (a, b, _, worker):
        joiner = _NodeDesc(addr="node-starting", pid=1, local_id=0)
        holder = _BackendRendezvousStateHolder(a._backend, a._settings, cache_duration=0)
        holder.sync()
        holder.state.wait_list.add(joiner)
        holder.state.last_heartbeats[joiner] = datetime.now(UTC)
        holder.mark_dirty()
        assert holder.sync()
        b.leave()
        wait_for(a.num_nodes_waiting, timeout=5, what="b's departure")
        began = time.monotonic()
        assert _join([a]) == [(0, 1)]
        assert time.monotonic() - began < 5
        holder.sync()
        assert holder.state.wait_list == {joiner}
        assert a.num_nodes_waiting() == 0  # and held again, as any joiner after a loss
        worker.stepped(a.current_round)
        assert a.num_nodes_waiting() == 1


def test_a_node_lost_before_anyone_trained_leaves_a_joiner_for_the_round_after(etcd: EtcdServer, run_id: str) -> None:
    """a and b are set up in place and took no step in their round (the workers of a joiner's first
    round, or of a round that lost a member as it formed); d comes as b is lost. a completes the next
    round without d and holds d until its workers trained, as a survivor that trained would: a soak's
    joiner (n55) completed such a round with another joiner in it (n56) still starting, and the
    survivors waited 1.0 s in the new group for its start-up. A worker that stamps its steps says so as
    it registers, before its first step."""
    with _trained_pair(etcd, run_id, trained=False) as (a, b, d, worker), ThreadPoolExecutor(1) as pool:
        joining = pool.submit(d.next_rendezvous)
        wait_for(a.num_nodes_waiting, timeout=5, what="d waiting to join")
        b.leave()
        assert _join([a]) == [(0, 1)]  # without d, whether or not it came first
        assert _waiting(a) == 1
        assert a.num_nodes_waiting() == 0  # held until a's workers train in their round
        worker.stepped(a.current_round)
        wait_for(a.num_nodes_waiting, timeout=5, what="d let in")
        assert _join([a]) == [(0, 2)]
        assert joining.result(timeout=10).world_size == 2


def test_a_round_after_a_loss_that_an_add_fills_forms_without_its_joiner(etcd: EtcdServer, run_id: str) -> None:
    """a, b and c trained in a full round (max_nodes 3); d waits to join; c is lost. torch completes a
    round the moment an add fills it, with no join action the survivors' deferral sees, and the round
    after the loss filled so, with d: a soak's survivors then waited 1.19 s in the new group for d's
    start-up. Whoever adds last now (d, which leaves the round to its members, or a survivor, which
    defers d as it completes it), the round forms of a and b, and d joins the one after once they
    trained."""
    a, b, c, d = _handlers(etcd, run_id, 4, 1)
    folder = Path(os.environ[PEER_LOST_ENV]).parent  # the agents' folder: these handlers share it
    worker = Handover(folder, 7)
    try:
        worker.register(stamps_steps=True)
        assert sorted(_join([a, b, c])) == [(0, 3), (1, 3), (2, 3)]  # max_nodes: complete at once
        worker.stepped(a.current_round)
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(d.next_rendezvous)  # a full round: d is a spare until c goes
            c.leave()
            wait_for(lambda: _waiting(a), timeout=5, what="d waiting to join")  # so a and b wait for its add
            assert sorted(_join([a, b])) == [(0, 2), (1, 2)]
            assert _waiting(a) == 1
            assert a.num_nodes_waiting() == 0  # held until a's workers train in their round
            worker.stepped(a.current_round)
            wait_for(a.num_nodes_waiting, timeout=5, what="d let in")
            assert sorted(_join([a, b])) == [(0, 3), (1, 3)]
            assert joining.result(timeout=10).world_size == 3
    finally:
        for name in ("live-7", "stepped-7"):
            (folder / name).unlink(missing_ok=True)
        for handler in (a, b, d):
            handler.leave()


def test_a_joiner_whose_first_round_lost_a_member_before_it_stepped_leaves_the_next_to_the_survivors(
    etcd: EtcdServer, run_id: str
) -> None:
    """d joins a and b (its first round); b is lost before anyone trained in it. d's agent knows the
    round before it (it was in it), yet it is a joiner there: it neither completes the next round
    (a `joinloss` trial's joiner did, with a joiner still starting in it, and the survivor waited
    1.12 s in the new group) nor fills it; a, a member, does, and leaves d for the round after. Once
    d's worker stepped in its round, or where nobody departed, it is a member like any other."""
    with _trained_pair(etcd, run_id) as (a, b, d, worker), ThreadPoolExecutor(1) as pool:
        joining = pool.submit(d.next_rendezvous)
        wait_for(a.num_nodes_waiting, timeout=5, what="d waiting to join")
        assert sorted(_join([a, b])) == [(0, 3), (1, 3)]
        assert joining.result(timeout=10).world_size == 3
        forming = _state(a.current_round + 1, [], complete=False)
        d_was_in, a_was_in = d._joined, a._joined  # what each passes as it joins the next round
        assert d_was_in is not None
        assert a_was_in is not None
        assert not d._joins_after_loss(forming, d_was_in)  # nobody departed: a pure growth
        b.leave()
        wait_for(a.num_nodes_waiting, timeout=5, what="b's departure")
        assert d._joins_after_loss(forming, d_was_in)  # its worker never stepped in its first round
        assert not a._joins_after_loss(forming, a_was_in)
        trained_in = a.current_round - 1
        worker.stepped(a.current_round)  # had it stepped there, it would be a member
        assert not d._joins_after_loss(forming, d_was_in)
        worker.stepped(trained_in)  # (back to the round a's workers train in)
        rejoining = pool.submit(d.next_rendezvous)
        assert _join([a]) == [(0, 1)]  # without d, whoever looked first
        assert _waiting(a) == 1
        worker.stepped(a.current_round)
        wait_for(a.num_nodes_waiting, timeout=5, what="d let in")
        assert _join([a]) == [(0, 2)]
        assert rejoining.result(timeout=10).world_size == 2


def test_a_re_join_while_etcd_does_not_answer_waits_for_it_instead_of_failing(etcd: EtcdServer, run_id: str) -> None:
    """The nodes re-join while etcd is down for a moment (a thawed node's first requests time out so):
    they form their round once it answers again. torch's join fails at the first error, and the
    agent's shutdown then closed the rendezvous for every node."""
    a, _, _ = handlers = _handlers(etcd, run_id, 3)
    try:
        assert sorted(_join(handlers)) == [(0, 3), (1, 3), (2, 3)]  # max_nodes: complete at once
        etcd.stop()
        with ThreadPoolExecutor(3) as pool:
            joins = [pool.submit(h.next_rendezvous) for h in handlers]
            wait_for(lambda: a._backend._failing_since is not None, timeout=10, what="a join meeting the outage")
            etcd.start()
            infos = [join.result(timeout=20) for join in joins]
        assert sorted((info.rank, info.world_size) for info in infos) == [(0, 3), (1, 3), (2, 3)]
    finally:
        for handler in handlers:
            handler.leave()


def _state_in_etcd(handler: EtcdV3RendezvousHandler) -> Any:
    """The rendezvous state as etcd holds it now, read past the handler's own cache."""
    holder = _BackendRendezvousStateHolder(handler._backend, handler._settings, cache_duration=0)
    holder.sync()
    return holder.state


@contextlib.contextmanager
def _round_then_wiped(
    etcd: EtcdServer, run_id: str
) -> Iterator[tuple[EtcdV3RendezvousHandler, EtcdV3RendezvousHandler, EtcdV3RendezvousHandler, int]]:
    """a, b and c in round 1 of a run of at most 4 nodes (round 0 had a fourth, which left), then etcd
    wiped (its pod moved, and the managed etcd keeps its data in memory); the round they are in is
    yielded too."""
    a, b, c, left = handlers = _handlers(etcd, run_id, 4, max_nodes="4")
    try:
        assert sorted(_join(handlers)) == [(0, 4), (1, 4), (2, 4), (3, 4)]  # max_nodes: complete at once
        left.leave()
        wait_for(a.num_nodes_waiting, timeout=5, what="the fourth's departure")
        assert sorted(_join([a, b, c])) == [(0, 3), (1, 3), (2, 3)]
        assert {h.current_round for h in (a, b, c)} == {1}
        etcd.restart(wipe=True)
        assert _state_in_etcd(a).round == 0  # torch's empty state
        for handler in (a, b, c):  # their next look reads etcd, not the state they cached before the wipe
            handler._watch.expire()
        yield a, b, c, 1
    finally:
        for handler in handlers:
            handler.leave()


def test_after_etcd_lost_its_data_a_loss_is_found_and_the_next_round_follows_the_last(
    etcd: EtcdServer, run_id: str
) -> None:
    """etcd comes back empty under a running round: the members write their round back as they joined
    it (nothing changes for their workers), so liveness can take a killed member out of it within
    about a second, and the survivors' next round is numbered after it. Before, the empty state was
    no change at all: nobody could be taken out of it (the loss waited for the workers' own 30 s), and
    the rounds began again at 0, older than the generation in-place workers train in, which they
    refuse (`reconfigure`: every worker was then restarted)."""
    with _round_then_wiped(etcd, run_id) as (a, b, c, round_):
        assert (a.num_nodes_waiting(), b.num_nodes_waiting(), c.num_nodes_waiting()) == (0, 0, 0)
        state = _state_in_etcd(a)
        assert (state.round, state.complete) == (round_, True)
        assert state.participants == a._joined_state.participants  # the ranks too
        for survivor in (a, b):
            heard = survivor._liveness
            assert heard is not None
            wait_for(lambda: str(c._this_node) in heard._receipts, 5, what="a put of c since the restart")  # noqa: B023
        assert c._liveness is not None
        c._liveness.stop()
        c._stop_heartbeats()  # a killed node: nothing more from it (torch's heartbeat: 15 s)
        wait_for(a.num_nodes_waiting, timeout=5, what="the killed member taken out")
        assert sorted(_join([a, b])) == [(0, 2), (1, 2)]
        assert a.current_round == b.current_round == round_ + 1


def test_after_etcd_lost_its_data_a_newcomers_round_waits_for_the_one_after_the_members(
    etcd: EtcdServer, run_id: str
) -> None:
    """A newcomer reaches the empty etcd first and starts a round 0 of its own (it knows no other):
    the members write their round back over it, the newcomer waits for the next round, and that round
    follows theirs, with all four. Before, every member left its round for the newcomer's round 0,
    and a newcomer alone could complete it beside the running group."""
    with _round_then_wiped(etcd, run_id) as (a, b, c, round_), ThreadPoolExecutor(1) as pool:
        (d,) = _handlers(etcd, run_id, 1, max_nodes="4")
        try:
            joining = pool.submit(d.next_rendezvous)
            wait_for(lambda: d._this_node in _state_in_etcd(a).participants, 5, what="the newcomer's round 0")
            assert wait_for(a.num_nodes_waiting, timeout=5, what="the newcomer waiting") == 1
            state = _state_in_etcd(a)
            assert (state.round, state.wait_list) == (round_, {d._this_node})
            assert sorted(_join([a, b, c])) == [(0, 4), (1, 4), (2, 4)]
            assert joining.result(timeout=10).world_size == 4
            assert {h.current_round for h in (a, b, c, d)} == {round_ + 1}
        finally:
            d.leave()


def test_after_etcd_lost_its_data_a_member_that_re_joins_first_numbers_the_round_after_its_last(
    etcd: EtcdServer, run_id: str
) -> None:
    """A member's agent re-joins (its workers failed) before any member looked at the empty etcd: its
    join numbers the round after the one it left, and the others, seeing their round end, join it."""
    with _round_then_wiped(etcd, run_id) as (a, b, c, round_), ThreadPoolExecutor(1) as pool:
        rejoining = pool.submit(c.next_rendezvous)
        wait_for(lambda: c._this_node in _state_in_etcd(a).participants, 5, what="c in a round of its own")
        assert _state_in_etcd(a).round == round_ + 1
        assert a.num_nodes_waiting() == 1  # its round ended
        assert b.num_nodes_waiting() == 1
        assert sorted(_join([a, b])) == [(0, 3), (1, 3)]
        assert rejoining.result(timeout=10).world_size == 3
        assert {h.current_round for h in (a, b, c)} == {round_ + 1}


def _no_workers() -> None:
    """The entry point of an agent whose rendezvous never completes (it starts no worker)."""


def test_an_agent_that_fails_leaves_the_rendezvous_open_for_the_nodes_in_it(
    etcd: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's agent fails (here at its join timeout, in a round that needs 3 nodes): torch's launcher
    then shuts its handler down, which closed the rendezvous for the node waiting in the round with it
    (and, the round's last member out, deleted the run's keys). The agent (InPlaceAgent, through
    torch's own `launch_agent`) leaves instead, and the round forms once the nodes it needs come."""
    register()
    monkeypatch.setattr(launcher_api, "LocalElasticAgent", InPlaceAgent)  # as the launcher does
    waiting, *late = _handlers(etcd, run_id, 3, min_nodes=3, join_timeout="30")
    config = LaunchConfig(
        min_nodes=3, max_nodes=3, nproc_per_node=1, run_id=run_id, rdzv_endpoint=etcd.endpoint,
        rdzv_backend="etcd-v3", rdzv_configs={"join_timeout": "2", "keep_alive_interval": "5"}, max_restarts=0,
        monitor_interval=0.1,
    )  # fmt: skip
    try:
        with ThreadPoolExecutor(3) as pool:
            joining = pool.submit(waiting.next_rendezvous)
            wait_for(lambda: len(waiting._state_holder.state.participants) == 1, timeout=5, what="a node waiting")
            with pytest.raises(RendezvousTimeoutError):
                launch_agent(config, _no_workers, [])
            assert not waiting.is_closed()
            rounds = [pool.submit(handler.next_rendezvous) for handler in late]
            assert joining.result(timeout=20).world_size == 3
            assert [info.result(timeout=20).world_size for info in rounds] == [3, 3]
    finally:
        for handler in (waiting, *late):
            handler.leave()


def test_a_store_read_of_a_round_being_set_up_gives_up_when_a_member_is_gone(etcd: EtcdServer, run_id: str) -> None:
    """A member dies after its round completed and before it wrote what the others wait for in the
    round's store (torch's rank assignment): under `setting_up` the read gives up once the round has
    lost it (its heartbeats expire after 3 s here), naming it, instead of waiting out the store's
    timeout (30 s here, 300 s in torch); the agent then joins the next round (handover.py). A soak
    froze a node so, and the survivor's agent sat there while its worker finished the run."""
    a, b, c = handlers = _handlers(etcd, run_id, 3, keep_alive_interval="1")
    try:
        with ThreadPoolExecutor(3) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        store = infos[0].store  # a's
        store.set_timeout(timedelta(seconds=30))
        c._stop_heartbeats()
        started = time.monotonic()
        with a.setting_up() as set_up, pytest.raises(RoundAbandoned, match="stopped heartbeating"):
            store.get("torchelastic/role_info/2")
        assert time.monotonic() - started < 10
        assert set_up.abandoned is not None
        assert str(c._this_node) in set_up.abandoned
        b.num_nodes_waiting()  # b learns of it too; the next round forms without c
        assert sorted(_join([a, b])) == [(0, 2), (1, 2)]
    finally:
        for handler in (a, b):
            handler.leave()


def test_a_store_read_of_a_round_being_set_up_gives_up_as_soon_as_a_member_is_taken_out(
    etcd: EtcdServer, run_id: str
) -> None:
    """The same, where liveness takes the member out: the read gives up as the state is written, not
    at its next look (within 1 s: a `joinloss` trial's survivor set up a round 1.04 s longer so). b's
    agent takes c out about 0.2 s into a's read."""
    a, b, c = handlers = _handlers(etcd, run_id, 3)
    try:
        with ThreadPoolExecutor(3) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        store = infos[0].store  # a's
        store.set_timeout(timedelta(seconds=30))
        taken: list[float] = []

        def take_c_out() -> None:
            b._evict(str(c._this_node))  # what b's liveness does once c's puts stop
            taken.append(time.monotonic())

        timer = threading.Timer(0.2, take_c_out)
        timer.start()
        with a.setting_up(), pytest.raises(RoundAbandoned, match="stopped heartbeating"):
            store.get("torchelastic/role_info/2")
        gave_up = time.monotonic()
        timer.join()
        assert gave_up - taken[0] < 0.5
    finally:
        for handler in handlers:
            handler.leave()


def test_an_agent_names_its_own_marker_whatever_it_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    """A marker named in the environment by a parent (another agent's) is not this agent's."""
    monkeypatch.setenv(PEER_LOST_ENV, "/tmp/parent-agent/peer-lost")
    name_peer_lost_marker()
    mine = os.environ[PEER_LOST_ENV]
    assert mine != "/tmp/parent-agent/peer-lost"
    name_peer_lost_marker()
    assert os.environ[PEER_LOST_ENV] == mine  # once per process


def test_progress_reports_roundtrip_through_etcd(etcd: EtcdServer) -> None:
    """What trainer rank 0 writes after a commit is what the operator reads."""
    assert CheckpointReporter.from_environment({"TORCHELASTIC_RUN_ID": "r1"}) is None  # not under etcd-v3
    env = {"PET_RDZV_BACKEND": "etcd-v3", "PET_RDZV_ENDPOINT": etcd.endpoint, "TORCHELASTIC_RUN_ID": "run-progress"}
    reporter = CheckpointReporter.from_environment(env)
    assert reporter is not None
    client = etcd.client()
    try:
        reporter.report(400, "az://ckpt/run/step-0000000400/")
        record = wait_for(lambda: milestones.read(client, "run-progress").get("checkpoint"), 10, "the report")
        assert record["step"] == 400
        assert record["uri"].endswith("step-0000000400/")
        assert record["time"].endswith("Z")
        client.put(milestones.milestone_prefix("run-progress") + "round", b"not json", lease=None)
        assert "round" not in milestones.read(client, "run-progress")  # skipped, not fatal
        # The last report, made as the loop ends, is written before close() returns (the process exits next).
        reporter.report(500, "az://ckpt/run/step-0000000500/")
        reporter.close()
        assert milestones.read(client, "run-progress")["checkpoint"]["step"] == 500
    finally:
        reporter.close()
        client.close()


def test_an_etcd_whose_port_was_taken_meanwhile_starts_on_another(tmp_path: Path) -> None:
    """Between free_port choosing a port and etcd binding it another process may take it (seen in CI: a
    fixture's etcd exited with "address already in use" and the test waited 20 s and failed)."""
    server = EtcdServer(tmp_path / "etcd-data", log_path=tmp_path / "etcd.log")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server.port = taken.getsockname()[1]  # what a racing process did to the chosen port
        server.start()
        try:
            assert server.port != taken.getsockname()[1]
            client = server.client()
            try:
                client.put("/k", b"v", lease=None)
                found = client.get("/k")
                assert found is not None
                assert found.value == b"v"
            finally:
                client.close()
        finally:
            server.stop()
    assert b"address already in use" in (tmp_path / "etcd.log").read_bytes()


def test_each_round_has_a_store_listening_before_its_workers_start(etcd: EtcdServer, run_id: str) -> None:
    """The round's rank-0 agent starts a fresh store before it publishes the address, so a worker's
    client connects at once (no back-off: the c10d client waited 0.2-0.6 s when the rank-0 worker
    started the store), and the next round's store is another one."""
    handlers = _handlers(etcd, run_id, 3)
    try:
        with ThreadPoolExecutor(3) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert all(h.use_agent_store for h in handlers)
        stores = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
        assert len(stores) == 1  # every node dials the same one
        addr, port = stores.pop()
        # Listening as the round is published: a first connection is accepted, not refused (a refused one
        # is what made the c10d client back off). The connect's speed is bench/recovery's to measure.
        with socket.create_connection((addr, port), timeout=5):
            pass
        client = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=5))
        client.set("k", "v")
        with ThreadPoolExecutor(3) as pool:  # a restart: every member back, the round completes at once
            again = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert {i.bootstrap_store_info.master_port for i in again} != {port}
        fresh = TCPStore(addr, again[0].bootstrap_store_info.master_port, is_master=False)
        assert not fresh.check(["k"])  # nothing of the last round's
    finally:
        for handler in handlers:
            handler.leave()
