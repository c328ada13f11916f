"""The agent's hand-over (handover.py) with real torchspot-run agents, a real etcd and gloo
workers (the lab's toy program with `--in-place`): at a kill and at a join the registered workers
re-form in place in the processes they started in, and a worker that does not acknowledge is
restarted by its agent while the others still re-form in place."""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import JobConfig, LocalNode, NodeFactory, first_step_at, read_events, stop_after, wait_for
from torchspot_trainer import launch
from torchspot_trainer.handover import (
    NO_STEP,
    STEP_CREDIT_SECONDS,
    Assignment,
    Handover,
    acknowledged,
    assignment_record,
    last_step,
    live_workers,
    notice_agreed,
    parse_assignment,
    registered,
    stepped_generation,
)
from torchspot_trainer.launch import leave_then_stop
from torchspot_trainer.markers import LEAVING_MARKER, PEER_LOST_ENV
from torchspot_trainer.recovery.live import LiveGroup

WAIT = 60.0
"""Generous bound for each wait: failing it means "did not happen", not "slow"."""


def test_an_assignment_names_each_local_worker_and_nobody_else() -> None:
    record = json.loads(json.dumps(assignment_record(7, 6, "10.0.0.4", 29400, {0: 2, 1: 3}, node=1, grows=True)))
    assert parse_assignment(record, 1) == Assignment(7, 3, 6, "10.0.0.4", 29400, node=1, grows=True)
    assert parse_assignment(record, 2) is None
    del record["grows"]  # a record without it: no deferred join
    assert parse_assignment(record, 1) == Assignment(7, 3, 6, "10.0.0.4", 29400, node=1, grows=False)


_REGISTERED_WORKER = """
import os
from torchspot_trainer.recovery.signals import EvictionNotice, watch_sigterm
watch_sigterm(EvictionNotice(), stuck_exit_after=60.0)
read_fd, _ = os.pipe()
print("ready", flush=True)
os.read(read_fd, 1)  # blocked in C, as in a collective
"""


def test_a_node_leaving_with_live_workers_only_marks_it_and_leaves_after_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to an agent whose workers re-form in place: the leaving mark, not the rendezvous left at
    once (the others would re-form without us and break the group the notice's checkpoint needs); the
    same agent without live workers leaves at once (nothing to mark). The first leaves once its worker
    has shared the notice with its group (before its emergency checkpoint). Either way, an agent still
    running STACKS_AFTER_NOTICE later prints its threads' stacks (here after 0.1 s), and a worker of its
    still running, blocked in C, prints its own (`ask_for_stacks`).

    A dump still armed when the test closes that file would be written to whatever reuses its descriptor
    (an xdist worker crashed so, 2026-12-07): the second dump is told from the first by the file's size
    before it, and awaited.

    The stacks go to a file of the test's own as the agent's stderr (faulthandler writes to its
    descriptor): read through `capfd`, whose every read truncates the capture file, a dump written
    while it was read came back cut, its header lost (three failures in a row on 2026-11-27, after
    passing in the suite). The dump is written thread by thread: the test waits for its own thread's
    frame in it, not for its first header (a CI run read it half written, 2026-11-27)."""
    monkeypatch.setattr(launch, "STACKS_AFTER_NOTICE", 0.1)
    handlers = sys.modules.get(launch.HANDLER_MODULE)
    if handlers is not None:  # (another test's rendezvous handlers in this process: their etcd is gone)
        monkeypatch.setattr(handlers, "_ACTIVE", [])
    stderr_path, worker_stderr_path = tmp_path / "agent-stderr", tmp_path / "worker-stderr"
    stderr = stderr_path.open("w")
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv(PEER_LOST_ENV, str(tmp_path / "peer-lost"))
    with (
        worker_stderr_path.open("w") as worker_stderr,
        subprocess.Popen(
            [sys.executable, "-c", _REGISTERED_WORKER], stdout=subprocess.PIPE, stderr=worker_stderr, text=True
        ) as worker,
    ):
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready"
            (tmp_path / "live-0").write_text(str(worker.pid))
            assert live_workers(tmp_path)
            with pytest.raises(SignalException):
                leave_then_stop(signal.SIGTERM, None)
            assert (tmp_path / LEAVING_MARKER).exists()
            (leaving,) = [thread for thread in threading.enumerate() if thread.name == "torchspot-leave"]
            assert leaving.is_alive()  # it leaves once the worker has shared the notice with its group
            Handover(tmp_path, 0).agreed()
            leaving.join(WAIT)
            assert not leaving.is_alive()

            def worker_stacks() -> bool:  # its main thread's frame, in the script it runs
                return 'File "<string>", line 7' in worker_stderr_path.read_text(errors="replace")

            assert wait_for(worker_stacks, WAIT, "the stacks of a worker still there after its agent's notice")
            assert worker.poll() is None  # asked for its stacks, not stopped
        finally:
            worker.kill()

    (tmp_path / LEAVING_MARKER).unlink()
    (tmp_path / "live-0").write_text("999999999")  # the worker is gone: a stale registration
    assert not live_workers(tmp_path)
    stderr.flush()
    before = stderr_path.stat().st_size  # (the first call's dump names this test too: the second's is awaited)
    with pytest.raises(SignalException):
        leave_then_stop(signal.SIGTERM, None)
    assert not (tmp_path / LEAVING_MARKER).exists()  # left (no handler here to leave), not only marked

    def stacks() -> bool:  # this thread's stack, where it waits: the dump's last part, so awaited whole
        return "test_a_node_leaving_with_live_workers" in stderr_path.read_text(errors="replace")[before:]

    try:
        assert wait_for(stacks, WAIT, "the stacks of a stopping agent that is still here")
        assert "most recent call first" in stderr_path.read_text(errors="replace")[before:]
    finally:
        faulthandler.cancel_dump_traceback_later()  # (none armed by now; its file is closed next)
        stderr.close()


def test_a_leaving_agent_waits_for_the_notice_of_every_running_worker_and_of_none_ended(tmp_path: Path) -> None:
    """`notice_agreed`: each registered worker that still runs must have shared the notice with its
    group (its `agreed-` file); one that has ended is not waited for. A worker that registers takes a
    previous worker's file of its local rank away (a restart's SIGTERM touched it): the next notice
    waits for its own."""
    Handover(tmp_path, 0).agreed()  # a previous worker of local rank 0, stopped by a restart
    Handover(tmp_path, 0).register()
    Handover(tmp_path, 1).register()
    assert not notice_agreed(tmp_path)
    Handover(tmp_path, 0).agreed()
    assert not notice_agreed(tmp_path)  # local rank 1 has not
    Handover(tmp_path, 1).agreed()
    assert notice_agreed(tmp_path)
    (tmp_path / "agreed-1").unlink()
    (tmp_path / "live-1").write_text("999999999")  # it ended: nothing to wait for
    assert notice_agreed(tmp_path)


def test_only_registered_running_workers_and_only_newer_acknowledgements_count(tmp_path: Path) -> None:
    assert not registered(tmp_path, {})  # no worker: nothing to hand a round to
    (tmp_path / "live-0").write_text("100")
    (tmp_path / "live-1").write_text("999")  # a stale file of a worker since replaced
    assert registered(tmp_path, {0: 100})
    assert not registered(tmp_path, {0: 100, 1: 101})
    (tmp_path / "ack-0").write_text("4")
    assert acknowledged(tmp_path, [0], 4)
    assert not acknowledged(tmp_path, [0], 5)
    assert not acknowledged(tmp_path, [0, 1], 4)


def test_a_completed_step_is_stamped_with_its_generation_and_read_back_only_for_it(tmp_path: Path) -> None:
    """`Handover.stepped` leaves the step's time for the agent's liveness judge (`last_step`), for the
    generation it was completed in only: a step of an older group proves nothing about a newer one.
    The newest generation stepped in (`stepped_generation`) tells the rendezvous whether a round
    trained."""
    assert last_step(tmp_path, 4) is None  # no live worker stepped
    assert stepped_generation(tmp_path) is None
    worker, other = Handover(tmp_path, 0), Handover(tmp_path, 1)
    worker.register(stamps_steps=True)  # before its first step: a stamp that no round can match
    assert stepped_generation(tmp_path) == NO_STEP
    assert last_step(tmp_path, 0) is None
    worker.stepped(4)
    path = tmp_path / "stepped-0"
    os.utime(path, (1_000.0, 1_000.0))  # as if long ago
    worker.stepped(4)  # the next step: only touched
    stamp = last_step(tmp_path, 4)
    assert stamp is not None
    assert abs(stamp - time.time()) < 60
    assert last_step(tmp_path, 5) is None
    other.stepped(3)  # another local worker still in an older generation
    assert last_step(tmp_path, 3) is not None
    assert last_step(tmp_path, 4) == stamp
    assert stepped_generation(tmp_path) == 4
    worker.stepped(5)  # the next generation's first step rewrites the file
    assert path.read_text() == "5"
    assert last_step(tmp_path, 4) is None
    assert stepped_generation(tmp_path) == 5
    worker.register(stamps_steps=True)  # registered again: a stamp already there is kept
    assert stepped_generation(tmp_path) == 5


def test_a_steps_stamp_counts_ahead_by_the_step_before_it_in_its_generation(tmp_path: Path) -> None:
    """Each member is busy with the next step after a completed one: the stamp counts until that step is
    due by the last one's duration (capped), so the liveness judge does not take out a member whose
    agent is starved while the group's slow steps go on; a generation's first step counts as of its
    own time."""
    clock = [1_000_000.0]
    worker = Handover(tmp_path, 0, clock=lambda: clock[0])
    worker.stepped(4)
    assert last_step(tmp_path, 4) == 1_000_000.0  # the generation's first: no credit
    clock[0] += 3.3
    worker.stepped(4)
    assert last_step(tmp_path, 4) == pytest.approx(1_000_003.3 + 3.3, abs=1e-3)
    clock[0] += 60.0  # a step that took a minute (an evaluation between): the credit is capped
    worker.stepped(4)
    assert last_step(tmp_path, 4) == pytest.approx(1_000_063.3 + STEP_CREDIT_SECONDS, abs=1e-3)
    clock[0] += 2.0
    worker.stepped(5)  # a new generation: the time since was the re-form's
    assert last_step(tmp_path, 5) == pytest.approx(1_000_065.3, abs=1e-3)


def test_a_local_failure_ends_the_credit_of_the_step_before_it(tmp_path: Path) -> None:
    """A collective that failed in the generation says the step the credit counts on did not complete:
    the stamp counts no later than the failure. A failure from before the worker entered the
    generation (an older group's) changes nothing."""
    clock = [1_000_000.0]
    worker = Handover(tmp_path, 0, clock=lambda: clock[0])
    ack, failed = tmp_path / "ack-0", tmp_path / "failed-0"
    ack.write_text("4")
    os.utime(ack, (999_990.0, 999_990.0))  # entered generation 4
    worker.stepped(4)
    clock[0] += 1.8
    worker.stepped(4)  # counts until 1_000_003.6, the next step's due time
    worker.report_failure()
    os.utime(failed, (999_980.0, 999_980.0))  # an older generation's failure
    assert last_step(tmp_path, 4) == pytest.approx(1_000_003.6, abs=1e-3)
    os.utime(failed, (1_000_002.9, 1_000_002.9))  # the next step's all-reduce failed 1.1 s in
    assert last_step(tmp_path, 4) == pytest.approx(1_000_002.9, abs=1e-3)
    os.utime(failed, (1_000_009.0, 1_000_009.0))  # a failure after the credit ran out: the stamp stands
    assert last_step(tmp_path, 4) == pytest.approx(1_000_003.6, abs=1e-3)


_GIVE_UP = """
import os
import sys
import time
from datetime import timedelta
from torch._C._distributed_c10d import TCPStore
from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.live import LiveGroup
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
live = LiveGroup(op_timeout=timedelta(seconds=5))
live.supersede(5)
began = time.monotonic()
older = live.reconfigure(Assignment(4, 0, 2, "127.0.0.1", store.port), began + 30)
print(older, time.monotonic() - began)
print(live.reconfigure(Assignment(5, 0, 1, "127.0.0.1", store.port), time.monotonic() + 30), live.broken.is_set())
sys.stdout.flush()
os._exit(0)  # the abandoned build's thread is still in gloo: an interpreter exit would abort on it
"""


def test_a_round_seen_before_a_reconfigure_gives_up_the_older_one_at_once() -> None:
    """The watcher saw round 5 while the worker was about to enter round 4: 4 is given up at once, not
    after its deadline (its peers moved on), and 5 forms (a one-rank group on a real store). In a
    process of its own: the group's threads must not be there when another test forks."""
    done = subprocess.run([sys.executable, "-c", _GIVE_UP], check=True, capture_output=True, text=True, timeout=60)
    first, second = done.stdout.split("\n")[:2]
    formed, seconds = first.split()
    assert formed == "False"
    assert float(seconds) < 1.0
    assert second == "True False"


_IDLE_GRAVES = """
import os
import sys
import time
from datetime import timedelta
import torch
from torch._C._distributed_c10d import TCPStore
from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.generation import GRAVEYARD
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import Outcome
from live_worker import gloo_loops  # (run from this folder)
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
live = LiveGroup(op_timeout=timedelta(seconds=30))
waits = []
for generation in range(2 * GRAVEYARD):  # each group's collectives all completed: nothing can write later
    assert live.reconfigure(Assignment(generation, 0, 1, "127.0.0.1", store.port), time.monotonic() + 30)
    began = time.monotonic()
    while live.graves() and time.monotonic() - began < 5:  # the reaper's, beside this thread
        time.sleep(0.005)
    waits.append(time.monotonic() - began)
    assert live.all_reduce(torch.ones(3), time.monotonic() + 5) is Outcome.DONE
print(live.graves(), gloo_loops(), max(waits) < 1.0)
sys.stdout.flush()
os._exit(0)
"""


def test_a_group_with_no_collective_in_flight_leaves_the_graveyard_as_it_is_left() -> None:
    """Only a group abandoned inside a collective is held until the op timeout (a zombie op may still
    write into its staging copy): twice GRAVEYARD re-forms within the op timeout, each group's
    collectives completed, never fill it (a soak of 40 faults a minute did, and fell back to a
    restart), and each is let go within a second of being left, its gloo loop with it: one loop
    left, the current group's. One-rank groups on a real store, in a process of their own."""
    done = subprocess.run([sys.executable, "-c", _IDLE_GRAVES], check=True, capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parent)  # fmt: skip
    assert done.stdout.split() == ["0", "1", "True"]


_DEFER = """
import os
import sys
import threading
import time
from datetime import timedelta
import torch
from torch._C._distributed_c10d import TCPStore
from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import Outcome
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
live = LiveGroup(op_timeout=timedelta(seconds=5), defer_joins=True)
assert live.reconfigure(Assignment(3, 0, 1, "127.0.0.1", store.port), time.monotonic() + 30)
live.offer(Assignment(4, 0, 3, "127.0.0.1", store.port, grows=True))  # two join
building = live._prebuilt is not None and not live._prebuilt.done.is_set()  # round 4's group, waiting for them
trains_on = live.all_reduce(torch.ones(1), time.monotonic() + 5)  # beside it
print(live.broken.is_set(), live.joiners_ready.is_set(), trains_on is Outcome.DONE and building)  # deferred
joiners = [LiveGroup(op_timeout=timedelta(seconds=5)) for _ in range(2)]
entered = []
threads = [threading.Thread(target=lambda rank=rank: entered.append(joiners[rank - 1].reconfigure(
    Assignment(4, rank, 3, "127.0.0.1", store.port), time.monotonic() + 30))) for rank in (1, 2)]
for thread in threads:
    thread.start()  # both joiners are set up and enter round 4: its group forms
began = time.monotonic()
while not live.joiners_ready.is_set() and time.monotonic() - began < 5:
    time.sleep(0.01)
for thread in threads:
    thread.join(5)  # the joiners' groups formed with the one built beside round 3: before this rank switched
print(live.broken.is_set(), live.joiners_ready.is_set(), time.monotonic() - began, entered.count(True))
began = time.monotonic()
switched = live.reconfigure(Assignment(4, 0, 3, "127.0.0.1", store.port, grows=True), time.monotonic() + 30)
three = torch.ones(1)
sums = [threading.Thread(target=joiner.all_reduce, args=(torch.ones(1), time.monotonic() + 5)) for joiner in joiners]
for thread in sums:
    thread.start()
outcome = live.all_reduce(three, time.monotonic() + 5)
print(switched, entered.count(True), time.monotonic() - began, outcome.value, float(three))
for thread in sums:
    thread.join(10)
again = LiveGroup(op_timeout=timedelta(seconds=5), defer_joins=True)
assert again.reconfigure(Assignment(3, 0, 1, "127.0.0.1", store.port), time.monotonic() + 30)
again.offer(Assignment(4, 0, 3, "127.0.0.1", store.port, grows=True))
again.offer(Assignment(5, 0, 2, "127.0.0.1", store.port))  # a newer round while 4 waits: at once
print(again.broken.is_set())
shrink = LiveGroup(op_timeout=timedelta(seconds=5), defer_joins=True)
assert shrink.reconfigure(Assignment(3, 0, 1, "127.0.0.1", store.port), time.monotonic() + 30)
shrink.offer(Assignment(4, 0, 1, "127.0.0.1", store.port))  # no rank added: nothing to wait for
print(shrink.broken.is_set())
thawed = LiveGroup(op_timeout=timedelta(seconds=5), defer_joins=True)
assert thawed.reconfigure(Assignment(3, 0, 1, "127.0.0.1", store.port), time.monotonic() + 30)
thawed.offer(Assignment(6, 0, 3, "127.0.0.1", store.port, grows=True))  # rounds 4 and 5 went by without it
print(thawed.broken.is_set())
building = LiveGroup(op_timeout=timedelta(seconds=5), defer_joins=True)
formed = []
entering = threading.Thread(target=lambda: formed.append(
    building.reconfigure(Assignment(3, 0, 2, "127.0.0.1", store.port), time.monotonic() + 30)))
entering.start()  # round 3's other rank never comes: its build waits
while building.assignment is None:
    time.sleep(0.01)
began = time.monotonic()
building.offer(Assignment(4, 0, 3, "127.0.0.1", store.port, grows=True))  # it moved on to round 4: so must this rank
entering.join(10)
print(formed, time.monotonic() - began)
replaced = LiveGroup(op_timeout=timedelta(seconds=5), defer_joins=True)
assert replaced.reconfigure(Assignment(3, 0, 1, "127.0.0.1", store.port), time.monotonic() + 30)
replaced.offer(Assignment(4, 0, 3, "127.0.0.1", store.port, grows=False))  # larger, but a member was lost in it
print(replaced.broken.is_set())
sys.stdout.flush()
os._exit(0)
"""


def test_a_round_that_adds_ranks_waits_for_them_while_the_group_trains_on() -> None:
    """With defer_joins (the trainer's), a round that grows the world does not break the current
    generation, which trains on while the round's group is built beside it; once the joiners came
    and it formed, `joiners_ready`, which the loop agrees on at a boundary, and the switch takes the
    group as built. A newer round meanwhile, a round that
    adds nobody, one that comes while the current generation's group is still being built, or one
    that does not follow it directly (a thawed node's), breaks it at once. Real stores and a one-rank
    gloo group, in a process of its own."""
    done = subprocess.run([sys.executable, "-c", _DEFER], check=True, capture_output=True, text=True, timeout=60)
    deferred, ready, switch, newer, shrunk, thawed, building, replaced = done.stdout.split("\n")[:8]
    assert deferred == "False False True"
    broken, set_, seconds, joined = ready.split()
    assert (broken, set_, joined) == ("False", "True", "2")
    assert float(seconds) < 1.0
    switched, entered, seconds, outcome, total = switch.rsplit(" ", 4)
    assert (switched, entered, outcome, total) == ("True", "2", "done", "3.0")
    assert float(seconds) < 1.0  # the group built while round 3 trained on: taken as it is
    assert newer == "True"
    assert shrunk == "True"
    assert thawed == "True"  # a node that missed rounds has no generation to train on in
    formed, seconds = building.rsplit(" ", 1)
    assert formed == "[False]"  # given up for round 4, not deferred behind a build that cannot finish
    assert float(seconds) < 1.0
    assert replaced == "True"


Members = dict[str, dict[str, Any]]
"""Node name -> its worker's `joined` record in one generation."""


def _joined(
    job: JobConfig, world: int, after: float, names: list[str], where: Callable[[Members], bool]
) -> Members | None:
    """For each of `names`, its worker's `joined` record of the first generation of `world` formed
    after `after` in which they all took part, a step was taken, and `where` holds (None until one)."""
    events = read_events(job.events)
    starts = [e for e in events if e["event"] == "start" and e["world"] == world and e["t"] > after]
    for start in starts:
        members = {e["node"]: e for e in events if e["event"] == "joined" and e["group"] == start["group"]}
        if all(name in members for name in names) and first_step_at(events, world, start["t"]) and where(members):
            return {name: members[name] for name in names}
    return None


def _await(
    job: JobConfig, nodes: list[LocalNode], world: int, after: float, what: str, *,
    where: Callable[[Members], bool] = lambda _: True,
) -> Members:  # fmt: skip
    """`_joined` for `nodes`; on a timeout, the nodes' logs."""
    try:
        found: Members = wait_for(lambda: _joined(job, world, after, [n.name for n in nodes], where), WAIT, what)
    except TimeoutError as exc:
        logs = "\n".join(f"--- {n.name}\n{n.log_tail(60)}" for n in nodes)
        pytest.fail(f"{exc}\n{logs}")
    return found


@pytest.mark.slow(seconds=24)
def test_survivors_and_joined_peers_re_form_in_place_and_a_deaf_worker_is_restarted(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """A kill (3 -> 2), then a join (2 -> 3). torch ranks a round's nodes by address: the survivor n1
    (127.0.0.2) is rank 0 after the kill, and the joiner (127.0.0.1) takes rank 0 from it in place
    (a CI run's survivor, made rank 2 so, once never exited: now the run ends with every node's exit)."""
    job = JobConfig(
        workdir=tmp_path / "job", backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes="2:3",
        steps=100_000, step_time=0.02, toy_args=["--in-place", "--deaf-node", "n0"],
        local_addrs={"n0": "127.0.0.3", "n1": "127.0.0.2"},
    )  # fmt: skip
    deaf, live, doomed = nodes(job, 3)
    first = _await(job, [deaf, live, doomed], 3, 0, "a step of all three at world size 3")
    pid = first["n1"]["pid"]

    killed = time.time()
    doomed.kill()
    # The deaf worker's own collective failed too, so it may take a generation or two in place before
    # its agent's wait for an acknowledgement runs out: then it is restarted, and the others re-form.
    after_kill = _await(
        job, [deaf, live], 2, killed, "the deaf worker restarted, at world size 2",
        where=lambda members: members["n0"]["pid"] != first["n0"]["pid"],
    )  # fmt: skip
    assert after_kill["n1"]["pid"] == pid, "the survivor's worker was restarted, not re-formed in place"
    assert after_kill["n1"]["rank"] == 0

    joined = time.time()
    (joiner,) = nodes(job, 1)
    after_join = _await(
        job, [deaf, live, joiner], 3, joined, "the deaf worker restarted again, at world size 3",
        where=lambda members: members["n0"]["pid"] != after_kill["n0"]["pid"],
    )  # fmt: skip
    assert after_join["n1"]["pid"] == pid, "the joined-into worker was restarted, not re-formed in place"
    assert (after_join["n3"]["rank"], after_join["n1"]["rank"]) == (0, 1)  # rank 0 went to the joiner

    last = stop_after(job, 20)
    for node in (deaf, live, joiner):
        assert node.wait(WAIT) == 0, node.log_tail(60)
    finished = [e for e in read_events(job.events) if e["event"] == "finished" and e["t"] > joined]
    assert sorted(e["node"] for e in finished) == ["n0", "n1", "n3"]
    assert {e["step"] for e in finished} == {last}
    assert len({json.dumps(e["w"]) for e in finished}) == 1, "the ranks' weights differ: a peer was not healed"
    # No step is committed twice: after each re-form the group goes on from the newest step a rank
    # committed, so rank 0's steps only ever increase (the one in flight at the change is redone).
    steps = [e["step"] for e in read_events(job.events) if e["event"] == "step"]
    assert all(a < b for a, b in itertools.pairwise(steps))


def test_a_round_breaks_only_a_generation_older_than_itself() -> None:
    """The watcher's judgement is against the assignment under the lock `reconfigure` replaces it
    under: the round being entered (a watcher that read the one before) breaks nothing."""
    live = LiveGroup()
    live.supersede(0)
    assert live.broken.is_set()  # no group yet: any round is newer
    live.broken.clear()
    live.assignment = Assignment(3, 0, 2, "127.0.0.1", 0)
    live.supersede(3)
    assert not live.broken.is_set()
    live.supersede(4)
    assert live.broken.is_set()
