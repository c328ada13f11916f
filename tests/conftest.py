"""Shared fixtures (a real etcd server on a free loopback port, local agent jobs), and the order in
which the suite's tests are handed to its workers."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchspot_lab.azurite import Azurite
from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import JobConfig, LocalNode, NodeFactory
from torchspot_operator.metrics import METRICS_PORT_ENV

SLOW_DEFAULT_SECONDS = 10.0
"""What a `slow` test without `seconds=` is taken to last, for the order below."""


def expected_seconds(item: pytest.Item) -> float:
    """How long a test is expected to run: its `slow` marker's `seconds`, 10 for another slow test, else 0."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return 0.0
    return float(marker.kwargs.get("seconds", SLOW_DEFAULT_SECONDS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first, longest first, each followed by a quick one; then the other quick tests.

    `make test` runs the suite on pytest-xdist workers that each hold the test they run and the
    next one (`--maxschedchunk 1`), and take the next test in this order as they finish one. Longest
    first keeps the end of the run from waiting on one long test that started late; the quick test
    after each slow one keeps two slow tests from queueing on one worker while another is idle.
    Serially, the order changes nothing: each test sets up and cleans up its own processes.
    """
    slow = sorted((i for i in items if expected_seconds(i) > 0), key=expected_seconds, reverse=True)
    quick = [i for i in items if expected_seconds(i) == 0]
    ordered: list[pytest.Item] = []
    for index, item in enumerate(slow):
        ordered.append(item)
        if index < len(quick):
            ordered.append(quick[index])
    ordered.extend(quick[len(slow) :])
    items[:] = ordered


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
