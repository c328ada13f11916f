"""Two replicas of the real operator (separate processes, as two pods) against the kmock API emulator.

With `--peering`, kopf lets only the replica of highest priority handle jobs; the other
waits, and takes over when the active one is gone: at once when it exits cleanly, after
`PEERING_LIFETIME` seconds when it dies without a word (SIGKILL here, a lost node in a
cluster). Which replica handled a job is read from the replicas' own logs (kopf logs each
handler it ran with the job's name).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.operator.cluster import NS, Cluster, wait_for
from tests.operator.jobs import good_job
from torchspot_operator import constants

PEERING = "torchspot-test"
RESUMED = "Resuming operations after the pause"
"""kopf's line when a replica starts handling objects (it starts paused, until it has seen its peers)."""
ROOT = Path(__file__).resolve().parents[2]


class Replica:
    """`python -m torchspot_operator --peering ...` as its own process, logging to a file."""

    def __init__(self, cluster: Cluster, folder: Path, priority: int) -> None:
        self.identity = f"operator-{priority}"
        self.log = folder / f"{self.identity}.log"
        env = {**os.environ, "KUBECONFIG": str(cluster.api.kubeconfig), "POD_ID": self.identity}
        command = [sys.executable, "-m", "torchspot_operator", f"--peering={PEERING}", f"--priority={priority}"]
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [*command, "--all-namespaces", "--verbose"], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )

    def text(self) -> str:
        return self.log.read_text()

    def handled(self, job: str) -> bool:
        """Whether this replica ran a handler for the job (kopf prefixes such lines `[ns/name]`)."""
        return f"[{NS}/{job}] Handler" in self.text()

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


def test_one_replica_acts_a_higher_one_takes_over_and_a_standby_replaces_a_dead_one(
    api: Cluster, replicas: list[Replica], tmp_path: Path
) -> None:
    cluster = api
    cluster.add_node("spot-1")

    # Alone, the first replica creates the peering object itself and handles jobs.
    low = Replica(cluster, tmp_path, priority=100)
    replicas.append(low)
    wait_for("the first replica's peering record", lambda: "operator-100" in _peers(cluster))
    assert _peers(cluster)["operator-100"]["lifetime"] == constants.PEERING_LIFETIME
    cluster.create(good_job("first"))
    wait_for("first's three workers", lambda: len(cluster.pods("first")) == 3)
    assert low.handled("first")

    # A replica of higher priority starts (a rolling update's new pod): the first one pauses.
    high = Replica(cluster, tmp_path, priority=200)
    replicas.append(high)
    wait_for("the second replica's peering record", lambda: "operator-200" in _peers(cluster))
    wait_for("the first replica pausing", lambda: "Pausing operations in favour of" in low.text())
    cluster.create(good_job("second"))
    wait_for("second's three workers", lambda: len(cluster.pods("second")) == 3)
    wait_for("the active replica's handler", lambda: high.handled("second"))
    assert not low.handled("second")
    # A lost worker is replaced once, by the active replica alone (the names say: one new pod).
    cluster.evict("second-worker-0")
    wait_for("second's replacement", lambda: cluster.names("second")[-1] == "second-worker-3")
    assert cluster.live("second") == ["second-worker-1", "second-worker-2", "second-worker-3"]  # worker-0 kept
    assert not low.handled("second")

    # The active replica dies without a word: the standby takes over once its record expires.
    killed = time.monotonic()
    assert high.stop(signal.SIGKILL) == -signal.SIGKILL
    wait_for(
        "the standby resuming",
        lambda: low.text().count(RESUMED) == 2,  # the first: when it started alone
        timeout=constants.PEERING_LIFETIME + 15,
    )
    assert time.monotonic() - killed < constants.PEERING_LIFETIME + 15
    cluster.evict("second-worker-1")
    replaced = ["second-worker-2", "second-worker-3", "second-worker-4"]  # the lowest free number (kept: 0, 1)
    wait_for("the standby's replacement", lambda: cluster.live("second") == replaced)
    assert low.handled("second")
    assert _worker_count(cluster, "first", "second") == {"first": 3, "second": 3}  # nothing doubled

    # A clean exit takes the replica's record with it.
    assert low.stop() == 0
    assert "operator-100" not in _peers(cluster)
