"""Two replicas of the real operator (separate processes, as two pods) against the kmock API emulator.

With `--peering`, kopf lets only the replica of highest priority handle jobs; the other waits, and
takes over when the active one is gone: at once when it exits cleanly, after the peering lifetime
when it dies without a word (SIGKILL here, a lost node in a cluster). Priorities count down from
each replica's start time, so the oldest live replica leads and one started later never takes
over from it. Which replica handled a job is read from the replicas' own logs (kopf logs each
handler it ran with the job's name); whether it knows it is a standby, from its liveness
endpoint and its /metrics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.operator.cluster import NS, Cluster, wait_for
from tests.operator.jobs import good_job
from torchspot_lab.etcd import free_port
from torchspot_lab.scrape import metric_sum
from torchspot_operator import constants
from torchspot_operator.metrics import METRICS_PORT_ENV

PEERING = "torchspot-test"
LIFETIME = 15
"""The replicas' peering lifetime here (`constants.PEERING_LIFETIME_ENV`; 60 s by default)."""
RESUMED = "Resuming operations after the pause"
"""kopf's line when a replica starts handling objects (it starts paused, until it has seen its peers)."""
ROOT = Path(__file__).resolve().parents[2]


class Replica:
    """`python -m torchspot_operator --peering ...` as its own process, logging to a file, with its
    liveness endpoint and /metrics on ports of its own."""

    def __init__(self, cluster: Cluster, folder: Path, name: str) -> None:
        self.identity = name
        self.log = folder / f"{self.identity}.log"
        self.liveness, self.metrics = free_port(), free_port()
        env = {
            **os.environ, "KUBECONFIG": str(cluster.api.kubeconfig), "POD_ID": self.identity,
            constants.PEERING_LIFETIME_ENV: str(LIFETIME), METRICS_PORT_ENV: str(self.metrics),
        }  # fmt: skip
        command = [
            sys.executable, "-m", "torchspot_operator", f"--peering={PEERING}", "--all-namespaces", "--verbose",
            "--liveness", f"http://127.0.0.1:{self.liveness}/healthz",
        ]  # fmt: skip
        with self.log.open("w") as out:
            self.process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text()

    def handled(self, job: str) -> bool:
        """Whether this replica ran a handler for the job (kopf prefixes such lines `[ns/name]`)."""
        return f"[{NS}/{job}] Handler" in self.text()

    def health(self) -> dict[str, Any]:
        """What its liveness endpoint answers (kopf: each probe's result by id); {} while it cannot."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness}/healthz", timeout=5) as answer:
                found: dict[str, Any] = json.loads(answer.read())
                return found
        except OSError:
            return {}

    def jobs_reported(self) -> float:
        """The sum of its `torchspot_jobs` gauge (0 when it reports none)."""
        return metric_sum(self.metrics, "torchspot_jobs")

    def started(self, cluster: Cluster) -> None:
        """Wait for its record in the peering object; where it exits first (a port it could not bind, a
        crash), fail at once with the end of its log, which a timeout alone would not show."""

        def recorded() -> bool:
            if self.process.poll() is not None:
                pytest.fail(f"{self.identity} exited with {self.process.returncode}:\n{self.text()[-4000:]}")
            return self.identity in _peers(cluster)

        wait_for(f"{self.identity}'s peering record", recorded)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        self.process.send_signal(sig)
        return self.process.wait(30)


@pytest.fixture
def replicas(api: Cluster, tmp_path: Path) -> Iterator[list[Replica]]:
    """Started replicas; whatever still runs at the end is stopped."""
    started: list[Replica] = []
    yield started
    for replica in started:
        if replica.process.poll() is None:
            replica.stop(signal.SIGKILL)


def _peers(cluster: Cluster) -> dict[str, Any]:
    found = cluster.api.run(cluster.kube.get(constants.PEERING_API_VERSION, constants.PEERING_KIND, None, PEERING))
    return dict((found or {}).get("status") or {})


def _worker_count(cluster: Cluster, *jobs: str) -> dict[str, int]:
    return {job: len(cluster.live(job)) for job in jobs}


def test_the_oldest_replica_leads_a_standby_knows_it_and_takes_over_when_the_leader_dies(
    api: Cluster, replicas: list[Replica], tmp_path: Path
) -> None:
    cluster = api
    cluster.add_node("spot-1")

    # Alone, the first replica creates the peering object itself and handles jobs.
    first = Replica(cluster, tmp_path, "operator-a")
    replicas.append(first)
    first.started(cluster)
    assert _peers(cluster)["operator-a"]["lifetime"] == LIFETIME
    cluster.create(good_job("first"))
    wait_for("first's three workers", lambda: len(cluster.pods("first")) == 3)
    assert first.handled("first")

    # A second replica starts (a rolling update's new pod, or a restarted standby): it started later,
    # so its priority is lower, and it waits; the leader keeps leading.
    second = Replica(cluster, tmp_path, "operator-b")
    replicas.append(second)
    second.started(cluster)
    assert _peers(cluster)["operator-b"]["priority"] < _peers(cluster)["operator-a"]["priority"]
    wait_for("the second replica a standby", lambda: "this replica is a standby: operator-a leads" in second.text())
    cluster.create(good_job("second"))
    wait_for("second's three workers", lambda: len(cluster.pods("second")) == 3)
    wait_for("the leader's handler", lambda: first.handled("second"))
    # A lost worker is replaced once, by the leader alone (the names say: one new pod).
    cluster.evict("second-worker-0")
    wait_for("second's replacement", lambda: cluster.names("second")[-1] == "second-worker-3")
    assert cluster.live("second") == ["second-worker-1", "second-worker-2", "second-worker-3"]  # worker-0 kept
    assert not second.handled("second")
    assert RESUMED not in second.text()  # kopf started it paused, and it stayed so
    assert "Pausing operations" not in first.text()
    # The standby knows: healthy as a standby (its reconciles stopped on purpose), and no job phases
    # beside the leader's.
    wait_for("the standby saying so", lambda: second.health().get("reconciling") == "standby", timeout=30)
    assert second.jobs_reported() == 0
    assert first.health().get("reconciling") == "ok"
    assert first.jobs_reported() == 2

    # The leader dies without a word: the standby takes over once its record expires.
    killed = time.monotonic()
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_for(
        "the standby resuming",
        lambda: second.text().count(RESUMED) == 1,  # it started paused: this is its first
        timeout=LIFETIME + 15,
    )
    assert time.monotonic() - killed < LIFETIME + 15
    cluster.evict("second-worker-1")
    replaced = ["second-worker-2", "second-worker-3", "second-worker-4"]  # the lowest free number (kept: 0, 1)
    wait_for("the new leader's replacement", lambda: cluster.live("second") == replaced)
    assert second.handled("second")
    assert _worker_count(cluster, "first", "second") == {"first": 3, "second": 3}  # nothing doubled
    wait_for("the new leader saying so", lambda: second.health().get("reconciling") == "ok", timeout=30)
    wait_for("and reporting the jobs", lambda: second.jobs_reported() == 2)

    # A clean exit takes the replica's record with it.
    assert second.stop() == 0
    assert "operator-b" not in _peers(cluster)
