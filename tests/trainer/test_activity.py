"""The agent's look at its workers' CPU (activity.py), on real processes: one that trains, and one whose
gloo collective waits for a peer that never comes (the hang the operator's stall rule must still see
in a program that reports no steps)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from torchspot_lab.local import wait_for
from torchspot_trainer.activity import ACTIVE_CPU_SHARE, Activity, active, cpu_seconds

_TRAINS = """
import torch
print("ready", flush=True)
w = torch.randn(256, 256)
while True:
    w = torch.tanh(w @ w)
"""

_HANGS = """
import sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
print("ready", flush=True)
if rank == 0:
    dist.all_reduce(torch.ones(1))  # rank 1 never takes part: waits here (gloo's timeout: 30 min)
time.sleep(3600)
"""


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts, each killed at its end."""
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _start(processes: list[subprocess.Popen[str]], script: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    processes.append(process)
    return process


def test_a_worker_that_trains_is_active_and_one_waiting_in_a_collective_is_not(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    trains = _start(started, _TRAINS)
    store = tmp_path / "store"
    waiting, idle = (_start(started, _HANGS, str(rank), str(store)) for rank in (0, 1))
    for process in (trains, waiting, idle):
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
    for pids in ([trains.pid], [waiting.pid]):
        activity = Activity(every=1.0)
        assert activity.look(pids) is None  # the first look only starts the count
        assert _verdict(activity, pids) is (pids == [trains.pid])


def _verdict(activity: Activity, pids: list[int]) -> bool | None:
    """The next look's verdict, once its window has passed (looks within it say None)."""
    verdicts: list[bool | None] = []

    def looked() -> bool:
        verdicts.append(activity.look(pids))
        return verdicts[-1] is not None

    wait_for(looked, 10, "the next look")
    return verdicts[-1]


def test_activity_is_a_share_of_a_core_and_a_restart_starts_the_count_again() -> None:
    """`active`: ACTIVE_CPU_SHARE of a core over the window. `Activity`: one verdict per window; none
    where the workers changed (a restart: new processes, whose CPU time began again)."""
    assert active(ACTIVE_CPU_SHARE * 10, 10.0)
    assert not active(ACTIVE_CPU_SHARE * 10 * 0.9, 10.0)
    assert not active(1.0, 0.0)
    now, used = [0.0], {frozenset({1}): [0.0, 5.0], frozenset({2}): [100.0]}

    def measure(pids: Iterable[int]) -> float:
        return used[frozenset(pids)].pop(0)

    activity = Activity(measure=measure, clock=lambda: now[0], every=10.0)
    assert activity.look([1]) is None
    now[0] = 5.0
    assert activity.look([1]) is None  # not due
    now[0] = 10.0
    assert activity.look([1]) is True  # 5 CPU seconds in 10
    now[0] = 20.0
    assert activity.look([2]) is None  # another worker: counted afresh
    assert cpu_seconds([999_999_999]) == 0.0  # a process that is gone counts nothing
