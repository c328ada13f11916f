"""Shared fixtures (a real etcd server on a free loopback port, local agent jobs), and the order in
which the suite's tests are handed to its workers."""

from __future__ import annotations

import fcntl
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from torchspot_lab.azurite import Azurite
from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import JobConfig, LocalNode, NodeFactory
from torchspot_operator.metrics import METRICS_PORT_ENV

SLOW_DEFAULT_SECONDS = 10.0
"""What a `slow` test without `seconds=` is taken to last, for the order below."""
QUICK_SECONDS = 0.3
"""What any other test is taken to last (about 590 of them take about 180 s in one process)."""
XDIST_WORKER_ENV = "PYTEST_XDIST_WORKER"
"""Set by pytest-xdist in each of its worker processes (gw0, gw1...)."""
HEAVY_TIMEOUT = 600
"""pytest-timeout's limit for a CPU-heavy test, which may first wait for another to finish."""
HEAVY_SLOTS = 2
"""CPU-heavy tests share this many slots: one of weight 1 takes a slot, one of weight 2 takes all."""
SLOT_LOOK_SECONDS = 0.2
"""Between a weight-1 test's tries at the free slots (flock cannot wait for any one of several)."""
WAITING_FOLDER = "operator"
"""The tests of tests/operator/ run the operator against the API emulator: mostly waits on backoffs and
timeouts (the suite's 321 of them took 178 s at about 22% of one core, 2026-11-27, once the CRD was
parsed once per process: tests/operator/jobs.py), none of them trains. They are what a CPU-heavy
test's neighbour should be (`pytest_collection_modifyitems`)."""
WAITING_SECONDS = 0.55
"""What one of the WAITING_FOLDER tests takes on average, for the order (178 s over 321 tests)."""


def expected_seconds(item: pytest.Item) -> float:
    """How long a test is expected to run: its `slow` marker's `seconds` (10 without), else WAITING_SECONDS
    for an operator test (`waits`), else QUICK_SECONDS."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return WAITING_SECONDS if waits(item) else QUICK_SECONDS
    return float(marker.kwargs.get("seconds", SLOW_DEFAULT_SECONDS))


def waits(item: pytest.Item) -> bool:
    """Whether a test mostly waits rather than computes: a test of WAITING_FOLDER that is not `slow`."""
    return item.path.parent.name == WAITING_FOLDER and item.get_closest_marker("slow") is None


def cpu_weight(item: pytest.Item) -> int:
    """A test marked `slow(cpu_heavy=N)` (True is 1): real trainers computing at once. Two that hold
    both cores side by side slow each other by a third and more, past what their timelines allow (a
    CI run failed the sandbox's that way). A test of weight 2 (HEAVY_SLOTS: the same-model test's
    five jobs, the liveness test's busy loops) runs beside no other heavy one; two of weight 1 (the
    sandbox's paced job, 0.6 of a core; two paced workers per node) may run together
    (`_cpu_heavy_slots`). 0 for any other test."""
    marker = item.get_closest_marker("slow")
    return 0 if marker is None else int(marker.kwargs.get("cpu_heavy", 0))


def cpu_heavy(item: pytest.Item) -> bool:
    """Whether a test is CPU-heavy at all (`cpu_weight`)."""
    return cpu_weight(item) > 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order in which the workers take the tests: CPU-heavy ones longest first, each followed by a
    quick one and then enough other tests to keep the other workers busy while it runs, operator tests
    first (`waits`: they leave it the cores); the other slow tests longest first, each followed by a
    quick one; then the rest.

    `make test` runs the suite on pytest-xdist workers that each hold the test they run and the
    next one (`--maxschedchunk 1`), and take the next test in this order as they finish one. So:
    longest first keeps the end of the run from waiting on one long test that started late; a quick
    test after each slow one keeps two slow ones from queueing on one worker while another idles;
    and the next CPU-heavy test comes up about when the last one ends (if it comes up earlier, its
    worker waits for the lock). Serially the order changes nothing: each test cleans up after itself.
    """
    workers = int(config.getoption("numprocesses", default=None) or 1)
    heavy = sorted((i for i in items if cpu_heavy(i)), key=lambda i: (cpu_weight(i), expected_seconds(i)), reverse=True)
    slow = sorted((i for i in items if i.get_closest_marker("slow") and not cpu_heavy(i)), key=expected_seconds,
                  reverse=True)  # fmt: skip
    waiting = [i for i in items if waits(i)]
    quick = [i for i in items if not i.get_closest_marker("slow") and not waits(i)]
    light: list[pytest.Item] = []
    for index, item in enumerate(slow):
        light.append(item)
        if index < len(quick):
            light.append(quick[index])
    light.extend(quick[len(slow) :])
    ordered: list[pytest.Item] = []
    for index, item in enumerate(heavy):
        item.add_marker(pytest.mark.timeout(HEAVY_TIMEOUT))
        ordered.append(item)
        quick_next = next((i for i in light if not i.get_closest_marker("slow")), None)
        if quick_next is not None:  # what its worker holds next waits for it: something short
            light.remove(quick_next)
            ordered.append(quick_next)
        following = heavy[index + 1] if index + 1 < len(heavy) else None
        if following is not None and cpu_weight(item) + cpu_weight(following) <= HEAVY_SLOTS:
            continue  # the next heavy one may run beside this one: let another worker take it now
        budget = expected_seconds(item) * max(workers - 1, 1)
        while budget > 0 and (waiting or light):
            filler = waiting.pop(0) if waiting else light.pop(0)
            ordered.append(filler)
            budget -= expected_seconds(filler)
    ordered.extend(light)
    ordered.extend(waiting)
    items[:] = ordered


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `cuda` is skipped, with the reason in the summary (`-ra`), where torch sees no
    CUDA device: CI has none, and such a test must be reported as not run, never as passed."""
    if item.get_closest_marker("cuda") is None:
        return
    import torch  # here, so that the operator's tests never pay torch's import

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: not run on this machine")


@pytest.fixture(autouse=True)
def _cpu_heavy_slots(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A CPU-heavy test holds as many of HEAVY_SLOTS lock files as its weight (`cpu_weight`), in the
    folder the run's xdist workers share (each worker's temp folder is one below it): a test of
    weight 2 takes them in order (so two such never deadlock), one of weight 1 the first that is
    free. One process runs one test at a time anyway, and its temp folder's parent is shared with
    other runs: no lock."""
    weight = cpu_weight(request.node)
    if not weight or XDIST_WORKER_ENV not in os.environ:
        yield
        return
    folder = tmp_path_factory.getbasetemp().parent
    slots = [(folder / f"cpu-heavy-{index}.lock").open("a") for index in range(HEAVY_SLOTS)]
    try:  # a lock is released when its file closes, or the worker dies
        if weight >= HEAVY_SLOTS:
            for slot in slots:
                fcntl.flock(slot, fcntl.LOCK_EX)
        else:
            while not any(_took(slot) for slot in slots):  # stops at the first slot it takes
                time.sleep(SLOT_LOOK_SECONDS)
        yield
    finally:
        for slot in slots:
            slot.close()


def _took(slot: IO[str]) -> bool:
    try:
        fcntl.flock(slot, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


# Every operator these tests start (in-process or as a subprocess) serves /metrics on a free port:
# several run at once (peering), and a fixed port may be taken on the machine.
os.environ.setdefault(METRICS_PORT_ENV, "0")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd 3.5 server (v3 API) with its data in the test's temp folder."""
    server = EtcdServer(tmp_path / "etcd-data", log_path=tmp_path / "etcd.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """A real Azurite Blob server (npm `azurite`), shared by the session's tests."""
    server = Azurite(tmp_path_factory.mktemp("azurite"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def run_id() -> str:
    """A run id no other test uses."""
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def nodes() -> Iterator[NodeFactory]:
    """Start `n` local nodes for a job; every process tree is killed at teardown. Safe to call from
    several threads (a test may drive two jobs side by side): each node gets a name of its own."""
    started: list[LocalNode] = []
    naming = threading.Lock()

    def start(job: JobConfig, n: int) -> list[LocalNode]:
        with naming:
            new = [LocalNode(f"n{len(started) + i}", job) for i in range(n)]
            started.extend(new)
        for node in new:
            node.start()
        return new

    yield start
    for node in started:
        node.stop()
