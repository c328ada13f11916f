"""Shared fixtures: a real etcd server on a free loopback port, and local agent jobs."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchspot_lab.azurite import Azurite
from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import JobConfig, LocalNode, NodeFactory
from torchspot_operator.metrics import METRICS_PORT_ENV

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
    """Start `n` local nodes for a job; every process tree is killed at teardown."""
    started: list[LocalNode] = []

    def start(job: JobConfig, n: int) -> list[LocalNode]:
        new = [LocalNode(f"n{len(started) + i}", job) for i in range(n)]
        for node in new:
            node.start()
        started.extend(new)
        return new

    yield start
    for node in started:
        node.stop()
