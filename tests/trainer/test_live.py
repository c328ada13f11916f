"""Re-formation in place (recovery/live.py) with real gloo groups in processes of their own: the
survivors of a kill or a freeze go on in the same processes, a thawed peer's abandoned collective
changes nothing, and a rank that lost a committed step heals from a peer. The test plays the agent:
it writes each generation's assignment (live_worker.py's files) and hosts each round's store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from torchspot_lab.local import wait_for
from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import Outcome
from torchspot_trainer.recovery.planes import (
    NCCL_SHRINK_HANG_VERSION,
    NCCL_SHRINK_VERSION,
    NONBLOCKING_TIMEOUT_ENV,
    RUNTIME_CONNECT_ENV,
    SHRINK_ABORT,
    SHRINK_DEFAULT,
    Replace,
    cuda_probe,
    device_healthy,
    generation_environment,
    generation_options,
    plane_for,
    replacement,
    shrink_flags,
    shrink_plan,
)
from torchspot_trainer.recovery.resume import newest

WORKER = Path(__file__).with_name("live_worker.py")
REFORM_BOUND = 5.0
"""Seconds a re-form may take here: far above its measured milliseconds, far below the 30 s op
timeout an old group's destructor would wait for (what the graveyard avoids)."""


class Job:
    """The workers of one test, its rounds' stores and assignments."""

    def __init__(self, folder: Path, nodes: dict[str, str], plane: str = "host") -> None:
        self.folder = folder
        self.stores: list[Any] = []
        self.worlds: list[int] = []
        self.procs = {
            node: subprocess.Popen([sys.executable, str(WORKER), node, str(folder), partial, plane])
            for node, partial in nodes.items()
        }

    def assign(self, ranks: dict[str, int]) -> None:
        """The next generation: a fresh store (as the round's rank-0 agent starts one), then its file."""
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        self.stores.append(store)
        generation = len(self.worlds)
        self.worlds.append(len(ranks))
        data = {"generation": generation, "ranks": ranks, "store_port": store.port}
        temporary = self.folder / f".assign-{generation}"
        temporary.write_text(json.dumps(data))
        temporary.rename(self.folder / f"assign-{generation}.json")

    def counts(self, node: str) -> list[float]:
        path = self.folder / f"progress-{node}.json"
        try:
            return list(json.loads(path.read_text())["counts"])
        except (OSError, ValueError):
            return [0.0] * 4

    def progress(self, node: str, key: str) -> int:
        """A number of `node`'s last progress file (-1 before its first)."""
        try:
            return int(json.loads((self.folder / f"progress-{node}.json").read_text())[key])
        except (OSError, ValueError, KeyError):
            return -1

    def reached(self, nodes: list[str], generation: int, steps: int) -> bool:
        return all(self.counts(node)[generation] >= steps for node in nodes)

    def finish(self, nodes: list[str]) -> dict[str, dict[str, Any]]:
        """Stop the workers 5 steps past the furthest one, all at the same step, and read their results."""
        last = max(int(sum(self.counts(node))) for node in nodes)
        temporary = self.folder / ".stop"
        temporary.write_text(str(last + 5))
        temporary.rename(self.folder / "stop")
        for node in nodes:
            assert self.procs[node].wait(timeout=60) == 0
        return {node: json.loads((self.folder / f"result-{node}.json").read_text()) for node in nodes}

    def expected_w(self, counts: list[float]) -> float:
        """The weight after these steps: a generation of world n takes 0.01 x (1 + ... + n) / n a step."""
        return -sum(0.005 * (world + 1) * counts[g] for g, world in enumerate(self.worlds))

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()


def _check(job: Job, results: dict[str, dict[str, Any]]) -> None:
    """The survivors hold one model, the one their agreed step history gives."""
    first = next(iter(results.values()))
    for result in results.values():
        assert result["counts"] == first["counts"]
        assert result["w"] == first["w"]
        assert all(reform < REFORM_BOUND for reform in result["reforms"]), result["reforms"]
    assert first["w"] == pytest.approx([job.expected_w(first["counts"])] * 8, abs=1e-9)


_SIT_OUT = """
import os
import sys
import threading
import time
from datetime import timedelta
import torch
from torch._C._distributed_c10d import TCPStore
from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.transfer import StateArrival, send_beside
from torchspot_trainer.recovery.outcome import GroupChanged, Outcome
from torchspot_trainer.recovery.wire import WireError
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
lives = [LiveGroup(op_timeout=timedelta(seconds=5)) for _ in range(3)]
def enter(generation, rank):
    assert lives[rank].reconfigure(Assignment(generation, rank, 3, "127.0.0.1", store.port), time.monotonic() + 30)
threads = [threading.Thread(target=enter, args=(1, rank)) for rank in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(10)
state = {"model": {"w": torch.arange(6.0)}, "step": 40, "rng": {"python": torch.arange(625)}}
began = time.monotonic()
sending = send_beside(lives[0], state, [2], torch.device("cpu"))  # the receiver has not asked yet
posted = time.monotonic() - began
sums = {}
def step(rank):  # the trainers' step: its all-reduce waits for the receiver's zeros
    if rank == 0:
        sending.result()  # the source's sends are posted before its all-reduce, as the trainer's are
    value = torch.ones(1) if rank < 2 else torch.zeros(1)
    sums[rank] = (lives[rank].all_reduce(value, time.monotonic() + 5), float(value))
trainers = [threading.Thread(target=step, args=(rank,)) for rank in (0, 1)]
for thread in trainers:
    thread.start()
time.sleep(0.2)
arrived = StateArrival(lives[2], 0, torch.device("cpu"), time.monotonic() + 5).result()
step(2)
for thread in trainers:
    thread.join(10)
print(round(posted, 3), arrived["step"], arrived["model"]["w"].tolist(), torch.equal(arrived["rng"]["python"],
      torch.arange(625)), sep="|")
print(sorted((rank, outcome.value, value) for rank, (outcome, value) in sums.items()))
ended = time.monotonic() + 5
while lives[0]._staging and time.monotonic() < ended:
    time.sleep(0.01)
print(len(lives[0]._staging))  # the sends ended: their buffers let go
try:
    send_beside(lives[0], {"model": object()}, [2], torch.device("cpu")).result()  # nothing sent
    print("sent")
except WireError as exc:
    print(type(exc).__name__, len(lives[0]._staging))
threads = [threading.Thread(target=enter, args=(2, rank)) for rank in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(10)
waiting = StateArrival(lives[2], 0, torch.device("cpu"), time.monotonic() + 30)  # nothing is sent
began = time.monotonic()
threading.Timer(0.2, lives[2].supersede, args=(3,)).start()  # a newer round breaks the generation
try:
    waiting.result()
    print("arrived")
except GroupChanged as exc:
    print(exc.failed, round(time.monotonic() - began, 1))
sys.stdout.flush()
os._exit(0)  # the abandoned receive's thread is still in gloo
"""


@pytest.mark.slow(seconds=5)
def test_a_heal_sends_the_state_while_its_trainers_step_and_a_broken_generation_ends_the_wait() -> None:
    """`send_beside` returns before its receiver asks, packing and posting on the group's sending thread
    (the source trains meanwhile); the receiver's `StateArrival` gets the state whole, after which its
    zeros complete the trainers' all-reduce; the sends' buffers are let go once they ended; a state
    that cannot be sent raises to the source when it waits for its sends. A receiver waiting for a
    state that never comes gives up when a newer round breaks the generation, not at its deadline.
    Three real gloo ranks on one store, in a process of their own (its group threads must not be
    there when another test forks)."""
    done = subprocess.run([sys.executable, "-c", _SIT_OUT], check=True, capture_output=True, text=True, timeout=60)
    arrival, sums, held, refused, broken = done.stdout.split("\n")[:5]
    _posted, *received = arrival.split("|")  # (the script asks for the state only after the post returned: a
    # post that waited for its receiver would never return, and the script would time out)
    assert received == ["40", "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]", "True"]
    assert sums == "[(0, 'done', 2.0), (1, 'done', 2.0), (2, 'done', 2.0)]"
    assert held == "0"
    assert refused == "WireError 0"  # raised to whoever waits for the sends; nothing posted nor held
    failed, seconds = broken.split()
    assert failed == "False"
    assert float(seconds) < 2.0


_UNWAITED = """
import os
import sys
import threading
import time
from datetime import timedelta
import torch
from torch._C._distributed_c10d import TCPStore
from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.live import LiveGroup
from live_worker import gloo_loops, on_threads  # (run from this folder)
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
lives = [LiveGroup(op_timeout=timedelta(seconds=60)) for _ in range(2)]
def enter(generation):
    def run(rank):
        assert lives[rank].reconfigure(Assignment(generation, rank, 2, "127.0.0.1", store.port), time.monotonic() + 30)
    on_threads(run, 0, 1)
def settled(graves):  # the graves held once the reaper got to them: (graves, gloo loops, seconds)
    began = time.monotonic()
    while [live.graves() for live in lives] != graves and time.monotonic() - began < 5:
        time.sleep(0.01)
    return [live.graves() for live in lives], gloo_loops(), round(time.monotonic() - began, 1)
enter(1)
for live in lives:  # each rank's bucket of a step that then broke: posted, never waited for
    live.post(torch.ones(4), control=False, owned=True)
ended = time.monotonic() + 10
while any(live._staging for live in lives) and time.monotonic() < ended:
    time.sleep(0.01)
print([len(live._staging) for live in lives])
enter(2)
print(*settled([0, 0]))
finish = lives[0].post(torch.ones(4), control=False, owned=True)  # rank 1 never takes part: in flight
for generation in (3, 4):  # rank 0 goes on alone; rank 1 stays in generation 2, its group open
    assert lives[0].reconfigure(Assignment(generation, 0, 1, "127.0.0.1", store.port), time.monotonic() + 30)
began = time.monotonic()
while lives[0].graves() and time.monotonic() - began < 5:
    time.sleep(0.01)
gone = time.monotonic() - began
began = time.monotonic()
alone = lives[1].all_reduce(torch.ones(4), time.monotonic() + 30)  # rank 1, still in generation 2
print(lives[0].graves(), gone < 1.0, finish(time.monotonic() + 5).value, alone.value, time.monotonic() - began < 1.0)
sys.stdout.flush()
os._exit(0)  # rank 0's abandoned all-reduce's thread is still in gloo
"""


@pytest.mark.slow(seconds=4)
def test_a_collective_never_waited_for_is_let_go_when_it_ends_and_its_generation_with_it() -> None:
    """A step's gradient buckets are posted during its backward pass and, when the step breaks
    first, never waited for. Each one's copy is held with its generation only until the collective
    ends (`LiveGroup._hold`), and the generation's grave is let go as soon as it is left, by the
    reaper, not after the op timeout (a soak's graveyard then filled within it and a worker fell back
    to a restart: bench/README.md's history) nor at the next re-form (a dead peer's group spun its loop until
    then: live.py's module docstring); its gloo loop goes with it. A generation left with one still
    in flight (a peer that never took part) has its connections closed by the reaper: that collective
    fails, the grave goes within a second, not at the op timeout (60 s here), waited for after the
    generation was left it says so, and the peer still in that generation finds its connection
    closed: its next collective fails at once instead of waiting there. Two real gloo ranks in a
    process of their own (its group threads must not be there when another test forks)."""
    done = subprocess.run([sys.executable, "-c", _UNWAITED], check=True, capture_output=True, text=True, timeout=60,
                          cwd=WORKER.parent)  # fmt: skip
    ended, let_go, in_flight = done.stdout.split("\n")[:3]
    assert ended == "[0, 0]"
    graves, loops, seconds = let_go.rsplit(" ", 2)
    assert (graves, loops) == ("[0, 0]", "2")  # generation 1 gone; each rank's generation 2 left
    assert float(seconds) < 1.0
    assert in_flight == "0 True broken failed True"


_REFUSED = """
import os
import sys
import threading
import time
from datetime import timedelta
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.generation import close_connections
from torchspot_trainer.recovery.live import LiveGroup
from torchspot_trainer.recovery.outcome import GroupChanged
from live_worker import SeparateGloo, on_threads
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
def assignment(generation, rank, world):
    return Assignment(generation, rank, world, "127.0.0.1", store.port)
# An enqueue that raises. gloo: a send on a pair whose connection closed (real).
lives = [LiveGroup(op_timeout=timedelta(seconds=10)) for _ in range(2)]
on_threads(lambda rank: lives[rank].reconfigure(assignment(1, rank, 2), time.monotonic() + 10), 0, 1)
close_connections(lives[0]._group)
try:
    lives[0].post_send(torch.zeros(1), 1, 5)
    print("sent")
except GroupChanged as exc:
    print("GroupChanged", exc.failed)
class Refusing:
    # Stands in for an NCCL communicator that recorded an asynchronous error (not here: no GPU): NCCL
    # refuses every new work at its enqueue, which torch raises as DistBackendError.
    def allreduce(self, *args):
        raise dist.DistBackendError("NCCL communicator was aborted on rank 0")
    broadcast = allreduce
lives[0]._group = lives[0]._data = Refusing()
deadline = time.monotonic() + 5
print(lives[0].all_reduce(torch.zeros(1), deadline).value, lives[0].post(torch.zeros(1), control=False)(deadline).value,
      lives[0].broadcast(torch.zeros(1), 0, deadline).value)
# The graveyard, on a data plane of its own (SeparateGloo stands in for NCCL's, which cannot run here).
separate = [LiveGroup(op_timeout=timedelta(seconds=20), plane=SeparateGloo()) for _ in range(2)]
on_threads(lambda rank: separate[rank].reconfigure(assignment(2, rank, 2), time.monotonic() + 10), 0, 1)
separate[0].post(torch.zeros(1), control=False)  # rank 1 never takes part: its copy is held, in flight
on_threads(lambda rank: separate[rank].reconfigure(assignment(3, rank, 2), time.monotonic() + 10), 0, 1)
began = time.monotonic()
while separate[0].graves() and time.monotonic() - began < 10:
    time.sleep(0.01)
print(separate[0].graves(), round(time.monotonic() - began, 1))  # let go once its abort returned, not at 20 s
# An abandoned build whose communicator waits in C++ for a peer that never comes: aborted by whoever
# abandons it, and its grave kept until the build ended.
class Waiting(SeparateGloo):
    aborted, ended = threading.Event(), threading.Event()
    def make(self, store, control, *, timeout, parent, abandoned, made=lambda group: None):
        made("communicator")  # made: its first collective waits for an init that no peer completes
        self.ended.wait(30)  # in C++: `abandoned` is out of its reach; the abort ends it (below)
        raise RuntimeError("aborted")
    def abort(self, group):
        self.aborted.set()
alone = LiveGroup(op_timeout=timedelta(seconds=20), plane=Waiting())
timer = threading.Timer(0.3, alone.supersede, args=(5,))
timer.start()
formed = alone.reconfigure(assignment(4, 0, 1), time.monotonic() + 30)
Waiting.aborted.wait(5)
held = alone.graves()  # while the build's thread is still in its wait
Waiting.ended.set()  # the abort's effect: the wait ends
began = time.monotonic()
while alone.graves() and time.monotonic() - began < 10:
    time.sleep(0.01)
print(formed, Waiting.aborted.is_set(), held, alone.graves())
sys.stdout.flush()
os._exit(0)  # the abandoned collectives' threads are still in gloo
"""


@pytest.mark.slow(seconds=3)
def test_a_collective_refused_at_its_start_re_forms_and_device_graves_are_bounded() -> None:
    """A collective that cannot even start (a gloo send on a closed connection; an NCCL communicator
    that recorded an error refuses every enqueue: a stand-in here) is a FAILED collective, not an
    error that escapes the re-form and restarts every local worker. A data plane of its own (NCCL's
    on a GPU; gloo stands in): an old generation's copies that its communicator's work used go once
    that communicator's abort returned, not after the op timeout (eight re-forms within it pushed
    every survivor to the restart path); and an abandoned build's communicator, whose first
    collective waits in C++ for a peer that never comes, is aborted by the thread that abandons it,
    its grave counted until the build ended. Two real gloo ranks in a process of their own."""
    done = subprocess.run([sys.executable, "-c", _REFUSED], check=True, capture_output=True, text=True, timeout=60,
                          cwd=WORKER.parent)  # fmt: skip
    refused, collectives, graves, abandoned = done.stdout.split("\n")[:4]
    assert refused == "GroupChanged True"
    assert collectives == "failed failed failed"
    held, seconds = graves.split()
    assert held == "0"
    assert float(seconds) < 5.0  # the op timeout is 20 s
    assert abandoned == "False True 1 0"  # given up; aborted from here; held while it lived, then let go


@pytest.mark.parametrize(("rows", "chosen"), [([[7.0], [8.0], [8.0]], (8, 1)), ([[3.0], [3.0]], (3, 0))])
def test_newest_is_the_max_step_and_the_lowest_rank_holding_it(
    rows: list[list[float]], chosen: tuple[int, int]
) -> None:
    assert newest(rows) == chosen


@pytest.mark.slow(seconds=12)
def test_survivors_of_a_kill_go_on_in_the_same_processes(tmp_path: Path) -> None:
    """And the killed generation's group is let go at once, its gloo loop gone with it: held until the
    next re-form, such a group's loop spun at half a core beside a goodput run's training for 70 s
    (live.py's module docstring). The survivors' failed all-reduce ended: nothing of it can run."""
    job = Job(tmp_path, {"a": "-1", "b": "-1", "c": "-1"})
    try:
        job.assign({"a": 0, "b": 1, "c": 2})
        wait_for(lambda: job.reached(["a", "b", "c"], 0, 10), 60, "three ranks training")
        assert [job.progress(node, "loops") for node in "abc"] == [1, 1, 1]
        job.procs["c"].kill()
        job.assign({"a": 0, "b": 1})  # the agents' verdict
        wait_for(lambda: job.reached(["a", "b"], 1, 10), 30, "the survivors training at world 2")
        wait_for(lambda: all(job.progress(node, "graves") == 0 for node in "ab"), 5, "generation 0 let go")
        wait_for(lambda: all(job.progress(node, "loops") == 1 for node in "ab"), 5, "its gloo loop gone")
        results = job.finish(["a", "b"])
        _check(job, results)
        assert all(len(r["reforms"]) == 1 for r in results.values())
    finally:
        job.close()


@pytest.mark.slow(seconds=14)
def test_a_partial_commit_heals_and_a_frozen_peer_thawed_later_changes_nothing(tmp_path: Path) -> None:
    """a loses its 8th update after the all-reduce (b and c committed it): the re-form's agreement
    heals a from b. Then c freezes inside a collective and the survivors go on; when c thaws, its
    abandoned all-reduce completes into the survivors' staging copies, not their weights. The data
    travel on a group of their own beside the agreements' (as NCCL's on a GPU: live_worker.SeparateGloo
    stands in for it), retired at each change, and the device is probed after each generation left
    with data work in flight."""
    job = Job(tmp_path, {"a": "8", "b": "-1", "c": "-1"}, plane="separate")
    try:
        job.assign({"a": 0, "b": 1, "c": 2})
        wait_for(lambda: job.reached(["b", "c"], 0, 8), 60, "b and c past a's lost step")
        job.assign({"a": 0, "b": 1, "c": 2})
        wait_for(lambda: job.reached(["a", "b", "c"], 1, 5), 30, "the three healed and training")
        os.kill(job.procs["c"].pid, signal.SIGSTOP)
        job.assign({"a": 0, "b": 1})
        wait_for(lambda: job.reached(["a", "b"], 2, 10), 30, "a and b training without c")
        os.kill(job.procs["c"].pid, signal.SIGCONT)
        job.procs["c"].wait(timeout=30)  # it finds itself left out, and leaves
        steps = int(job.counts("a")[2])
        wait_for(lambda: job.reached(["a", "b"], 2, steps + 10), 30, "training after the thaw")
        results = job.finish(["a", "b"])
        _check(job, results)
        # Held: none. The groups abandoned inside a collective (generation 1's by both: c froze inside
        # one; 0's by b, whose next all-reduce a never joined) held only their data copies, let go once
        # their data group's abort returned (before, until the op timeout: eight re-forms within it sent
        # every survivor to the restart path).
        assert {name: r["graves"] for name, r in results.items()} == {"a": 0, "b": 0}
        assert {name: r["retirements"] for name, r in results.items()} == {"a": 2, "b": 2}
        # Probed: after generation 1 by both (c froze inside its all-reduce), after 0 only by b (a had
        # dropped its update after a completed all-reduce; b's next one waited for a in vain).
        assert {name: r["probes"] for name, r in results.items()} == {"a": 1, "b": 2}
    finally:
        job.close()


@pytest.mark.parametrize(
    ("version", "loss_only", "how"),
    [
        (None, True, Replace.NEW),  # no NCCL (a CPU build)
        ((2, 26, 5), True, Replace.NEW),  # no ncclCommShrink
        (NCCL_SHRINK_VERSION, True, Replace.SHRINK),
        (NCCL_SHRINK_VERSION, False, Replace.NEW),  # a join: c10d 2.13 has no grow
        (NCCL_SHRINK_HANG_VERSION, True, Replace.SHRINK_THEN_ABORT),  # pytorch#194679
        ((2, 33, 0), False, Replace.NEW),
    ],
)
def test_a_communicator_shrinks_only_after_a_loss_on_an_nccl_that_can(
    version: tuple[int, int, int] | None, loss_only: bool, how: Replace
) -> None:
    assert replacement(version, loss_only=loss_only) is how


@pytest.mark.parametrize(
    ("how", "clean", "flags"),
    [
        (Replace.NEW, True, None),
        (Replace.SHRINK, True, SHRINK_DEFAULT),  # a departure with notice: nothing in flight
        (Replace.SHRINK, False, SHRINK_ABORT),  # a loss inside a collective: end the parent's work first
        (Replace.SHRINK_THEN_ABORT, True, SHRINK_DEFAULT),
        (Replace.SHRINK_THEN_ABORT, False, None),  # SHRINK_ABORT hangs there: a new communicator
    ],
)
def test_a_parent_with_work_in_flight_shrinks_only_with_abort_and_only_where_that_works(
    how: Replace, clean: bool, flags: int | None
) -> None:
    assert shrink_flags(how, clean=clean) == flags


@pytest.mark.parametrize(
    ("members", "parent", "excluded"),
    [
        ([(4, 0), (4, 2)], (4, 3), [1]),  # rank 1 lost, the others keep their order
        ([(4, 1), (4, 2)], (4, 3), [0]),
        ([(4, 0), (4, 1), (4, 2)], (4, 3), None),  # nobody lost
        ([(4, 2), (4, 0)], (4, 3), None),  # renumbered against the old order: a shrink cannot
        ([(4, 0), (-1, -1)], (4, 3), None),  # a joiner
        ([(4, 0), (3, 1)], (4, 3), None),  # a rank that missed generation 4 (frozen through it)
        ([], (4, 3), None),
    ],
)
def test_a_generation_is_a_shrink_of_its_parent_only_when_its_ranks_are_the_survivors_in_order(
    members: list[tuple[int, int]], parent: tuple[int, int], excluded: list[int] | None
) -> None:
    assert shrink_plan(members, parent) == excluded


def test_the_device_probe_fails_a_device_that_raises_or_hangs_within_its_deadline() -> None:
    """After an abort: a probe that returns means a healthy device; one that raises (a sticky CUDA
    error) or never returns (a hung context) means the restart path, decided within the deadline."""
    assert device_healthy(lambda: None)

    def sticky() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert not device_healthy(sticky)
    hung = threading.Event()

    def never_returns() -> None:
        hung.wait()

    started = time.monotonic()
    assert not device_healthy(never_returns, timeout=0.3)
    assert time.monotonic() - started < 2.0
    hung.set()


@pytest.mark.cuda
def test_a_generation_communicator_is_non_blocking_and_a_healthy_device_passes_the_probe() -> None:
    """Needs a CUDA build and GPU: the options a generation's NCCL group is made with, and the probe
    on a real device."""
    options = generation_options(timedelta(seconds=30))
    assert options.config.blocking == 0  # an int field of NCCL's config: 0 is non-blocking
    assert device_healthy(cuda_probe(torch.device("cuda", 0)))


@pytest.mark.cuda
def test_one_ranks_generations_on_nccl_carry_device_data_and_retire_the_old_communicator() -> None:
    """Needs a CUDA build and GPU: a rank's generations on the NCCL plane, one after another on its
    device (one rank: a shrink is never planned, each generation gets a new communicator): the data
    all-reduced on the device, the agreements on gloo, the old communicator aborted while the next one
    forms. A loss between GPUs cannot be made on one device (design.md): not measured."""
    device = torch.device("cuda", 0)
    live = LiveGroup(plane=plane_for(device))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    for generation in range(3):
        deadline = time.monotonic() + 60
        assert live.reconfigure(Assignment(generation, 0, 1, "127.0.0.1", store.port), deadline)
        data = torch.full((1024,), 2.0, device=device)
        assert live.all_reduce(data, deadline) is Outcome.DONE
        assert data.device == device
        assert float(data[0]) == 2.0
        assert live.agree([float(generation)], deadline) == [[float(generation)]]
    assert live.retirements == 2
    assert live.probes == 0  # nothing was abandoned in flight
    wait_for(lambda: live.retiring() == 0, 10, "the old communicators' aborts (an H200 took up to 1 s)")


@pytest.mark.cuda
def test_a_collective_an_aborted_communicator_refuses_fails_the_generation_on_nccl() -> None:
    """Needs a CUDA build and GPU: NCCL refuses work on a communicator that recorded an error (here it
    was aborted, as a grave's is); the enqueue raises, and the generation's collective is FAILED, not
    an error that escapes the re-form (what test_live's gloo stand-in shows on CPU). Not measured: a
    communicator whose peer failed, which one device cannot make (design.md)."""
    device = torch.device("cuda", 0)
    live = LiveGroup(plane=plane_for(device))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    deadline = time.monotonic() + 60
    assert live.reconfigure(Assignment(0, 0, 1, "127.0.0.1", store.port), deadline)
    live.plane.abort(live._data)
    assert live.all_reduce(torch.ones(8, device=device), deadline) is Outcome.FAILED


def test_a_worker_in_place_on_nccl_bounds_its_waits_and_connects_at_init_unless_the_user_chose() -> None:
    """`generation_environment`: torch's nonblocking timeout at the generation's op timeout (its own
    default, 30 minutes, is how long a build whose peer never comes waits in C++), and NCCL's
    connections made at init (on the build's thread) rather than at a generation's first gradient
    all-reduce on the training thread. A value the user set stays."""
    assert generation_environment({}, timedelta(seconds=30)) == {
        NONBLOCKING_TIMEOUT_ENV: "30", RUNTIME_CONNECT_ENV: "0"
    }  # fmt: skip
    assert generation_environment({RUNTIME_CONNECT_ENV: "1"}, timedelta(seconds=0.2)) == {NONBLOCKING_TIMEOUT_ENV: "1"}
