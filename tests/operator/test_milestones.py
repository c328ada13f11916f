"""The operator's reader of a run's milestones against real etcd servers with mutual TLS, as a job's
managed etcd serves them.

A job deleted and re-created under its name gets a new CA and client certificate while its etcd
Service keeps its address; the reader keys its clients by the job's uid, so the new job's reads do
not go through the old job's client (whose certificate the new etcd refuses), and closing a job
closes only its own clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchspot_lab.etcd import EtcdServer, free_port
from torchspot_operator.certs import etcd_certificates
from torchspot_operator.milestones import MilestoneReader
from torchspot_trainer.rendezvous import milestones

RUN = "run-1"


def _serving(tmp_path: Path, name: str, port: int | None, round_: int) -> EtcdServer:
    """A TLS etcd for job `name` (its own CA) that holds one round milestone for `RUN`."""
    server = EtcdServer(tmp_path / name, tls=etcd_certificates(f"{name}-etcd", "default"))
    if port is not None:
        server.port = port  # the same Service address as the job's predecessor
    server.start()
    client = server.client()
    try:
        milestones.write(client, RUN, milestones.ROUND, {"round": round_, "nodes": 2}, lease=None)
    finally:
        client.close()
    return server


async def _refreshed(reader: MilestoneReader, server: EtcdServer, job: str) -> dict[str, Any]:
    """What the reader has once a refresh for `job` has ended (it answers from its cache at once)."""
    reader.forget(RUN)
    reader.latest(server.endpoint, RUN, server.client_tls(), job=job)
    for _ in range(200):
        found = reader.latest(server.endpoint, RUN, server.client_tls(), job=job)
        if found.get("reachable") is not None:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError("the reader never finished a refresh")


async def _read(reader: MilestoneReader, server: EtcdServer, job: str, tries: int = 3) -> dict[str, Any]:
    """The first refresh for `job` that reached the etcd, else the last of `tries`. A client whose read
    failed is closed and the next refresh opens another; on a loaded machine a first TLS read can outlast
    its MILESTONE_TIMEOUT (a CI run's failed so, the suite's two workers starting). A reader that goes
    through the wrong client (a certificate the etcd refuses) fails every try alike."""
    found: dict[str, Any] = {}
    for _ in range(tries):
        found = await _refreshed(reader, server, job)
        if found["reachable"]:
            break
    return found


def test_a_recreated_job_reads_its_new_etcd_through_its_own_client(tmp_path: Path) -> None:
    async def scene() -> None:
        reader = MilestoneReader()
        old = _serving(tmp_path, "old", None, round_=3)
        try:
            seen = await _read(reader, old, job="uid-old")
            assert seen["reachable"] is True
            assert seen[milestones.ROUND]["round"] == 3
        finally:
            old.stop()
        new = _serving(tmp_path, "new", old.port, round_=7)  # re-created: new CA, same address
        try:
            seen = await _read(reader, new, job="uid-new")
            assert seen["reachable"] is True, seen  # keyed by address, the old certificate would be refused
            assert seen[milestones.ROUND]["round"] == 7
            reader.close_job("uid-old")  # the controller does this when it sees the job re-created
            assert {job for job, _ in reader._clients} == {"uid-new"}
            assert (await _read(reader, new, job="uid-new"))[milestones.ROUND]["round"] == 7
        finally:
            reader.close()
            new.stop()

    asyncio.run(scene())


class _Clock:
    """The reader's clock, moved by the test: when a read is due is the subject."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _settled(reader: MilestoneReader) -> None:
    """Every refresh the reader started has ended."""
    await asyncio.gather(*reader._refreshing.values(), return_exceptions=True)


def _write_round(server: EtcdServer, run: str, round_: int) -> None:
    client = server.client()
    try:
        milestones.write(client, run, milestones.ROUND, {"round": round_, "nodes": 2}, lease=None)
    finally:
        client.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A plain etcd server, stopped after the test."""
    started = EtcdServer(tmp_path / "etcd")
    started.start()
    yield started
    started.stop()


def test_runs_share_a_read_budget_and_a_stall_timeout_bounds_the_wait(server: EtcdServer) -> None:
    """Two reads a second across four runs: each run is read every 2 s (not at each reconcile), unless its
    `max_age` (a quarter of its stall timeout) is shorter; a run never read is read at once."""
    clock = _Clock()
    runs = [f"run-{n}" for n in range(4)]

    async def scene() -> None:
        reader = MilestoneReader(reads_per_second=2.0, clock=clock)
        try:
            for run in runs:
                _write_round(server, run, 1)
                reader.latest(server.endpoint, run, job=run)
            await _settled(reader)
            assert all(reader.latest(server.endpoint, run, job=run)["round"]["round"] == 1 for run in runs)
            for run in runs:
                _write_round(server, run, 2)
            clock.now += 1.9  # within the budget's 2 s: answered from the cache, nothing read
            assert [reader.latest(server.endpoint, run, job=run)["round"]["round"] for run in runs] == [1] * 4
            assert reader.latest(server.endpoint, "run-0", job="run-0", max_age=1.5)["round"]["round"] == 1
            await _settled(reader)  # the max_age run was read: 1.9 s > 1.5 s
            assert reader.latest(server.endpoint, "run-0", job="run-0")["round"]["round"] == 2
            assert reader.latest(server.endpoint, "run-1", job="run-1")["round"]["round"] == 1
            clock.now += 0.1  # 2 s since the others' reads
            for run in runs[1:]:
                reader.latest(server.endpoint, run, job=run)
            await _settled(reader)
            assert [reader.latest(server.endpoint, run, job=run)["round"]["round"] for run in runs] == [2] * 4
        finally:
            reader.close()

    asyncio.run(scene())


def test_open_clients_are_bounded_and_a_failed_read_closes_its_own(server: EtcdServer) -> None:
    """At most `channels` clients stay open (the least recently used is closed); a client whose read failed
    (an etcd not up yet) is closed at once, and the run reads again through a new one once it serves."""
    clock = _Clock()

    async def scene() -> None:
        reader = MilestoneReader(channels=2, clock=clock)
        try:
            for job in ("a", "b", "c"):
                _write_round(server, f"run-{job}", 1)
                reader.latest(server.endpoint, f"run-{job}", job=job)
                await _settled(reader)
            assert [job for job, _ in reader._clients] == ["b", "c"]  # a's, the least recently used, closed
            assert reader.latest(server.endpoint, "run-a", job="a")["reachable"] is True

            nothing = f"127.0.0.1:{free_port()}"  # no etcd there yet
            reader.latest(nothing, "run-d", job="d")
            await _settled(reader)
            assert reader.latest(nothing, "run-d", job="d")["reachable"] is False
            assert "d" not in {job for job, _ in reader._clients}
        finally:
            reader.close()

    asyncio.run(scene())


def test_a_run_whose_worker_exited_is_read_at_once_whatever_the_budget(server: EtcdServer) -> None:
    """The run's last records (its final checkpoint, written as its loop ended) come from a read awaited
    then and there, though the budget says a read is not due: a finished job's are never read again."""
    clock = _Clock()

    async def scene() -> None:
        reader = MilestoneReader(reads_per_second=0.01, clock=clock)  # one read every 100 s for one run
        try:
            _write_round(server, RUN, 1)
            reader.latest(server.endpoint, RUN, job=RUN)
            await _settled(reader)
            _write_round(server, RUN, 2)
            clock.now += 1.0
            assert reader.latest(server.endpoint, RUN, job=RUN)["round"]["round"] == 1  # not due
            assert (await reader.fresh(server.endpoint, RUN, job=RUN))["round"]["round"] == 2
            reader.forget(RUN)
            reader.latest(server.endpoint, RUN, job=RUN)  # a read under way, begun before round 3
            _write_round(server, RUN, 3)
            found = await reader.fresh(server.endpoint, RUN, job=RUN)  # after it, not beside it
            assert (found["round"]["round"], found["reachable"]) == (3, True)
            assert reader.latest(server.endpoint, RUN, job=RUN)["round"]["round"] == 3
        finally:
            reader.close()

    asyncio.run(scene())
