"""The operator's reader of a run's milestones against real etcd servers with mutual TLS, as a job's
managed etcd serves them.

A job deleted and re-created under its name gets a new CA and client certificate while its etcd
Service keeps its address; the reader keys its clients by the job's uid, so the new job's reads do
not go through the old job's client (whose certificate the new etcd refuses), and closing a job
closes only its own clients.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from torchspot_lab.etcd import EtcdServer
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


async def _read(reader: MilestoneReader, server: EtcdServer, job: str) -> dict[str, Any]:
    """What the reader has once a refresh for `job` has ended (it answers from its cache at once)."""
    reader.forget(RUN)
    reader.latest(server.endpoint, RUN, server.client_tls(), job=job)
    for _ in range(200):
        found = reader.latest(server.endpoint, RUN, server.client_tls(), job=job)
        if found.get("reachable") is not None:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError("the reader never finished a refresh")


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
