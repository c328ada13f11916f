"""Lost-node detection through liveness keys (rendezvous/liveness.py) against a real etcd: a lost
node is out of the round in about a second, and neither short pauses nor a CPU hog drop anyone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import wait_for
from torchspot_trainer.handover import Handover
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.rendezvous.backend import RunLease
from torchspot_trainer.rendezvous.handler import EtcdV3RendezvousHandler, create_handler
from torchspot_trainer.rendezvous.liveness import Liveness, held_up, stale_members

AGENT = Path(__file__).with_name("liveness_agent.py")


@pytest.mark.parametrize(
    ("receipts", "stale"),
    [
        ({"me": 9.9, "a": 9.5, "b": 8.5}, ["b"]),  # b's last put 1.5 s ago
        ({"me": 9.9, "a": 9.5}, []),  # b never heard from since the watch opened: torch judges it
        ({"me": 9.0, "a": 9.5, "b": 5.0}, []),  # our own put 1 s late: we cannot see, nobody judged
        ({"a": 9.5, "b": 5.0}, []),  # no put of ours arrived yet
        ({"me": 9.9, "a": 9.1, "b": 8.9}, ["b"]),  # exactly at the timeout is not past it
    ],
)
def test_stale_members_judges_only_while_its_own_puts_arrive(receipts: dict[str, float], stale: list[str]) -> None:
    assert stale_members(receipts, {"me", "a", "b"}, "me", now=10.0, timeout=1.0) == stale


@pytest.mark.parametrize(("proven", "stale"), [(9.5, []), (8.5, ["b"]), (None, ["b"])])
def test_a_step_completed_with_every_member_counts_as_a_receipt_from_each(
    proven: float | None, stale: list[str]
) -> None:
    """b's last put 1.5 s ago, but a local worker's step completed with it 0.5 s ago: alive then."""
    receipts = {"me": 9.9, "a": 9.5, "b": 8.5}
    assert stale_members(receipts, {"me", "a", "b"}, "me", now=10.0, timeout=1.0, proven=proven) == stale


@pytest.mark.parametrize(("held", "stale"), [(0.0, ["b"]), (0.2, ["b"]), (0.3, [])])
def test_how_long_etcd_held_our_own_puts_up_is_held_against_nobody(held: float, stale: list[str]) -> None:
    """b's last put 1.25 s ago and our own 0.4 s ago (under timeout / 2: we judge): with our puts
    held up 0.2 s lately it is past the timeout and that; held up 0.3 s, it is not."""
    receipts = {"me": 9.6, "a": 9.7, "b": 8.75}
    assert stale_members(receipts, {"me", "a", "b"}, "me", now=10.0, timeout=1.0, held=held) == stale


@pytest.mark.parametrize(
    ("arrivals", "held"),
    [
        ([9.11, 9.22, 9.33, 9.44], 0.01),  # on time: each put late by its latency alone
        ([9.0, 9.11, 9.22], 0.18),  # the next put, due at 9.32, overdue now
        ([8.5, 9.1, 9.21, 9.32, 9.43], 0.5),  # one arrived 0.5 s late, 0.4 s ago: it still counts
        ([7.9, 8.4, 8.51, 8.62, 8.73, 8.84, 8.95, 9.06, 9.17, 9.28, 9.39], 0.01),  # that one 1.1 s ago no more
        ([8.0, 8.6, 9.3, 9.41], 0.6),  # two late ones within the window: the most
        ([], 0.0),  # none since the watch opened
    ],
)
def test_how_long_our_own_puts_were_held_up_lately(arrivals: list[float], held: float) -> None:
    assert held_up(arrivals, now=9.5, interval=0.1, window=1.0) == pytest.approx(held)


@pytest.mark.slow(seconds=4)
def test_a_member_whose_put_waits_in_a_stalled_etcd_is_not_taken_out(etcd: EtcdServer, run_id: str) -> None:
    """etcd answers nothing for 0.45 s just after our own put arrived (a checkpoint's write on the
    same disk held its log's fsync up so on the goodput market: bench/README.md's history, run 35), while a
    member's agent had been silent for 0.65-0.75 s (its node busy starting a worker); that member's
    put, sent during the stall, arrives as ours does, its puts 1.1-1.2 s apart. Our own put stays
    under `timeout / 2` old, so we judge all the while: without counting the stall that member was
    taken out. It is not, and silent for good afterwards it is, within the timeout and the stall
    it still remembers. A real etcd stopped with SIGSTOP; our Liveness against keys the test puts."""
    client, other = etcd.client(), etcd.client()
    prefix = f"/torchspot/test/{run_id}/"
    taken: list[tuple[str, float]] = []
    own = threading.Event()
    live = Liveness(
        client, prefix, "a", RunLease(client, ttl=30), interval=0.1, timeout=1.0,
        members=lambda: frozenset({"a", "b"}), evict=lambda name: taken.append((name, time.monotonic())),
        state_key=f"{prefix}state", on_state=lambda: None,
    )  # fmt: skip
    watch = other.watch(f"{prefix}alive/a", lambda change: own.set() if isinstance(change, list) else None)
    member = f"{prefix}alive/b"
    try:
        live.start()
        for _ in range(6):  # b heard from, every interval
            other.put(member, b"1", lease=None)
            time.sleep(0.1)
        other.put(member, b"1", lease=None)
        silent_since = time.monotonic()
        while True:  # our own next put after 0.65 s of b's silence: etcd stalls as it arrives
            own.clear()
            assert own.wait(5), "our own put never arrived"
            if time.monotonic() - silent_since >= 0.65:
                break
        woken = threading.Timer(0.05, lambda: other.put(member, b"1", lease=None))  # waits in etcd
        woken.start()
        etcd.stall(0.45)
        woken.join(5)
        stalled_until = time.monotonic()
        wait_for(lambda: taken, timeout=5, what="b taken out once silent for good")
        assert [name for name, _ in taken] == ["b"]
        # Not at the stall: only once silent past the timeout after it (how soon after is bench/recovery's).
        assert taken[0][1] - stalled_until > 1.0
    finally:
        live.stop()
        other.cancel_watch(watch)
        client.close()
        other.close()


def _handlers(etcd: EtcdServer, run_id: str, **settings: str) -> list[EtcdV3RendezvousHandler]:
    """Three handlers of one run whose torch heartbeat needs 15 s to find a node dead."""
    conf = {"keep_alive_interval": "5", "last_call_timeout": "30", "join_timeout": "10"} | settings
    params = RendezvousParameters("etcd-v3", etcd.endpoint, run_id, 1, 3, **conf)
    return [create_handler(params) for _ in range(3)]  # type: ignore[misc]


def _join(handlers: list[EtcdV3RendezvousHandler]) -> list[tuple[int, int]]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    return sorted((info.rank, info.world_size) for info in infos)


def test_a_failed_worker_corroborates_and_the_round_reforms_without_the_lost_node(
    etcd: EtcdServer, run_id: str
) -> None:
    """A liveness timeout of 3 s, shortened to 2.5 puts (0.5 s) after a local failure: the survivors
    see the killed node gone well before 3 s, form their round of two at once (the 30 s last call
    is past the 10 s join timeout), and the node's departure is on record for the next round. The
    failure is a live worker's `failed-` file, which liveness's judge reads itself once a put is
    late, whatever the agent is doing (it was read in the agent's monitor loop, and a kill during a
    round's set-up was judged by the long timeout)."""
    a, b, c = handlers = _handlers(etcd, run_id, liveness_timeout="3")
    folder = Path(os.environ[PEER_LOST_ENV]).parent  # the agents' folder: these handlers share it
    try:
        assert _join(handlers) == [(0, 3), (1, 3), (2, 3)]
        for survivor in (a, b):
            assert survivor._liveness is not None
            # A member that trained a while: the survivors have heard from it (one never heard from
            # is left to torch's heartbeat, 15 s here, and the round could have formed before a put).
            heard = survivor._liveness
            heard_from_c = lambda: str(c._this_node) in heard._receipts  # noqa: B023, E731 - called in this iteration
            wait_for(heard_from_c, 5, what="a put of the member")
        Handover(folder, 7).report_failure()  # a live worker's collective failed
        assert c._liveness is not None
        c._liveness.stop()
        c._stop_heartbeats()  # a killed node: nothing more from it
        lost = time.monotonic()
        wait_for(lambda: a.num_nodes_waiting() == 1, timeout=10, what="the lost node taken out")
        assert time.monotonic() - lost < 2.0
        assert Path(os.environ[PEER_LOST_ENV]).read_text() == "1.5"  # the workers' grace: half the timeout
        assert _join([a, b]) == [(0, 2), (1, 2)]
        assert str(c._this_node) in a._watch.found_dead or str(c._this_node) in b._watch.found_dead
    finally:
        (folder / "failed-7").unlink(missing_ok=True)
        for handler in handlers:
            handler.leave()


@pytest.mark.slow(seconds=6)
def test_a_member_whose_puts_stop_while_its_group_steps_stays_in_the_round(etcd: EtcdServer, run_id: str) -> None:
    """Node c's liveness puts stop (its agent starved, or etcd slow for its puts: the goodput market's
    false alarm) while a local live worker keeps completing steps in the round's generation: the
    others keep c for three timeouts. Once the steps stop too, c is taken out within about a second."""
    a, b, c = handlers = _handlers(etcd, run_id, liveness_timeout="1")
    folder = Path(os.environ[PEER_LOST_ENV]).parent
    stepping = threading.Event()
    try:
        assert _join(handlers) == [(0, 3), (1, 3), (2, 3)]
        for survivor in (a, b):
            heard = survivor._liveness
            assert heard is not None
            wait_for(lambda: str(c._this_node) in heard._receipts, 5, what="a put of c")  # noqa: B023
        worker = Handover(folder, 7)

        def steps() -> None:  # a live worker's steps in the round's generation (train.py's `_finish_step`)
            while not stepping.wait(0.05):
                worker.stepped(a.current_round)

        threading.Thread(target=steps, daemon=True).start()
        assert c._liveness is not None
        c._liveness.stop()  # no more puts from c
        c._stop_heartbeats()  # nor torch's heartbeats
        time.sleep(3.0)  # three timeouts: without the steps, c would be out after one
        assert a.num_nodes_waiting() == 0
        assert b.num_nodes_waiting() == 0
        assert str(c._this_node) not in a._watch.found_dead | b._watch.found_dead
        stepping.set()  # the steps stop: c's group no longer completes any (c frozen or gone)
        stopped = time.monotonic()
        wait_for(lambda: a.num_nodes_waiting() == 1, timeout=10, what="c taken out")
        assert time.monotonic() - stopped < 2.5
    finally:
        stepping.set()
        (folder / "stepped-7").unlink(missing_ok=True)
        for handler in handlers:
            handler.leave()


class _Agent:
    """liveness_agent.py in a process of its own, its output collected as it comes."""

    def __init__(self, etcd: EtcdServer, run_id: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(AGENT), etcd.endpoint, run_id, "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.strip())

    def said(self, word: str) -> list[str]:
        return [line for line in self.lines if line.startswith(word)]


@pytest.mark.slow(seconds=20, cpu_heavy=2)  # busy loops on every core
def test_no_false_alarm_under_pauses_and_a_cpu_hog_then_a_frozen_node_is_found_in_about_a_second(
    etcd: EtcdServer, run_id: str
) -> None:
    """Three agents in processes of their own. For 10 s busy loops hold every core while one agent
    is stopped three times for 0.5 s: nobody sees a change. Then that agent is stopped: both others
    see it gone in under 2.5 s (torch's heartbeat alone would take 15 s here), and once thawed it
    sees that it is out (its agent would rejoin as a new member)."""
    agents = [_Agent(etcd, run_id) for _ in range(3)]
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        wait_for(lambda: all(agent.said("joined") for agent in agents), timeout=60, what="three agents joined")
        victim = agents[2].process
        hog = "import time\nend = time.monotonic() + 10\nwhile time.monotonic() < end: pass"
        hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(os.cpu_count() or 2)]
        for _ in range(3):
            time.sleep(2.0)
            victim.send_signal(signal.SIGSTOP)
            time.sleep(0.5)
            victim.send_signal(signal.SIGCONT)
        for process in hogs:
            process.wait(timeout=30)
        time.sleep(1.5)  # a verdict formed under the hog is acted on by now
        assert [agent.said("changed") for agent in agents] == [[], [], []]

        victim.send_signal(signal.SIGSTOP)
        frozen = time.time()
        wait_for(lambda: all(agent.said("changed") for agent in agents[:2]), timeout=20, what="the frozen node found")
        seen = [float(agent.said("changed")[0].split()[1]) - frozen for agent in agents[:2]]
        assert max(seen) < 2.5, seen
        victim.send_signal(signal.SIGCONT)  # thawed, it finds itself out of the round it trained in
        wait_for(lambda: agents[2].said("changed"), timeout=20, what="the thawed node seeing its round end")
    finally:
        for hog_process in hogs:
            hog_process.kill()
            hog_process.wait()
        for agent in agents:
            agent.process.kill()
            agent.process.wait()
            if agent.process.stdout is not None:
                agent.process.stdout.close()
