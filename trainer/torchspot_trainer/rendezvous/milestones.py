"""A run's milestones as the operator reads them: the last round formed, the last checkpoint
committed and the step reached, small JSON keys beside the rendezvous state.

    <KEY_ROOT>/<run id>/status/round        {"round": 7, "nodes": 3, "time": ...}   (the agents)
    <KEY_ROOT>/<run id>/status/checkpoint   {"step": 1200, "uri": ..., "time": ...} (trainer rank 0)
    <KEY_ROOT>/<run id>/status/step         {"step": 1234, "time": ...}             (trainer rank 0, each minute)
    <KEY_ROOT>/<run id>/status/activity     {"at": 1796530000, "node": ..., "time": ...} (an agent whose workers
                                                                      used the CPU lately, each minute)

Why etcd: the operator can always reach the job's etcd (it runs it), while reading
the checkpoints' `latest.json` would need the job's Blob credentials. The keys sit
under the run's prefix, so the last agent out deletes them with the rest; the
operator keeps the last values it saw in the job's status.

The keys keep the path `status/` they had before these were called milestones: an operator
upgraded under a running job still reads what its older trainers write.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

from torchspot_trainer import RUN_ID_ENV
from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError, EtcdTls
from torchspot_trainer.rendezvous.settings import BACKEND_NAME, KEY_ROOT, parse_endpoint

log = logging.getLogger(__name__)

ROUND = "round"
CHECKPOINT = "checkpoint"
MILESTONE_TIMEOUT = 2.0
"""Seconds one milestone write or read may take; training never waits longer for one."""
STEP = "step"
STEP_REPORT_SECONDS = 60.0
"""Rank 0 reports its step at most this often: the operator's stall detection (Stalled) needs
progress between checkpoints, which may be far apart, and an etcd write a minute costs nothing."""
ACTIVITY = "activity"
ACTIVITY_REPORT_SECONDS = 60.0
"""An agent reports its workers' activity (activity.py) at most this often: the stall rule of a program
that reports no steps reads it, as the trainer's step reports (STEP_REPORT_SECONDS)."""
REPORT_TTL = 600
"""Seconds a trainer's checkpoint report lives without a newer one (it has no run lease of its
own; the operator keeps the last value it saw in the job's status after the key is gone)."""


def milestone_prefix(run_id: str) -> str:
    """Where a run's status keys live."""
    return f"{KEY_ROOT}/{run_id}/status/"


def now() -> str:
    """UTC time as Kubernetes writes it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write(client: EtcdClient, run_id: str, name: str, record: dict[str, Any], *, lease: int | None) -> bool:
    """Put one status record on a lease; whether it was written. A failure is logged, never raised (it
    is only a report).

    The lease matters: an abandoned run's keys must all expire, these included.
    """
    try:
        if lease is None:
            lease = client.grant_lease(REPORT_TTL)
        client.put(milestone_prefix(run_id) + name, json.dumps({**record, "time": now()}).encode(), lease=lease)
    except EtcdError as exc:
        log.warning("could not report %s to etcd: %s", name, exc)
        return False
    return True


def read(client: EtcdClient, run_id: str) -> dict[str, Any]:
    """Every status record of a run, by name (a record that is not JSON is skipped)."""
    prefix = milestone_prefix(run_id)
    records: dict[str, Any] = {}
    for key, value in client.get_prefix(prefix).items():
        try:
            records[key[len(prefix) :]] = json.loads(value)
        except ValueError:
            log.warning("ignoring status key %s: not JSON", key)
    return records


class CheckpointReporter:
    """Trainer side: tell the job's etcd about each committed checkpoint, off the training thread.

    Built from the environment torchrun and the operator give a worker: the backend,
    the endpoint (PET_RDZV_*) and the run id (TORCHELASTIC_RUN_ID). Without them
    (plain torchrun, another backend) it reports nothing.
    """

    def __init__(self, client: EtcdClient, run_id: str) -> None:
        self._client = client
        self._run_id = run_id
        self._step_reported = float("-inf")
        self._writes: list[threading.Thread] = []

    @classmethod
    def from_environment(cls, env: dict[str, str] | None = None) -> CheckpointReporter | None:
        """A reporter when this worker runs under the etcd-v3 backend, else None."""
        env = dict(os.environ) if env is None else env
        run_id = env.get(RUN_ID_ENV, "")
        if env.get("PET_RDZV_BACKEND") != BACKEND_NAME or not env.get("PET_RDZV_ENDPOINT") or not run_id:
            return None
        host, port = parse_endpoint(env["PET_RDZV_ENDPOINT"])
        conf = dict(item.split("=", 1) for item in env.get("PET_RDZV_CONF", "").split(",") if "=" in item)
        tls = EtcdTls.from_conf({key.strip(): value.strip() for key, value in conf.items()})
        return cls(EtcdClient(host, port, request_timeout=MILESTONE_TIMEOUT, tls=tls), run_id)

    def report(self, step: int, uri: str) -> None:
        """Record a committed checkpoint (in a daemon thread: etcd may be slow or away)."""
        self._write(CHECKPOINT, {"step": step, "uri": uri}, "checkpoint-report")

    def report_step(self, step: int, *, clock: float | None = None) -> bool:
        """Record the step reached, at most every `STEP_REPORT_SECONDS` (in a daemon thread); whether it did."""
        clock = time.monotonic() if clock is None else clock
        if clock - self._step_reported < STEP_REPORT_SECONDS:
            return False
        self._step_reported = clock
        self._write(STEP, {"step": step}, "step-report")
        return True

    def _write(self, kind: str, record: dict[str, Any], name: str) -> None:
        thread = threading.Thread(
            target=write,
            args=(self._client, self._run_id, kind, record),
            kwargs={"lease": None},
            name=name,
            daemon=True,
        )
        self._writes = [*(t for t in self._writes if t.is_alive()), thread]
        thread.start()

    def close(self) -> None:
        """Let the writes under way finish (each within MILESTONE_TIMEOUT), then close the etcd connection:
        the final checkpoint's record, reported as the loop ends, reaches the operator before the process
        exits."""
        deadline = time.monotonic() + MILESTONE_TIMEOUT
        for thread in self._writes:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._client.close()
