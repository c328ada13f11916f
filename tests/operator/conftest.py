"""The operator tests' fixture: the emulated API (kmock's emulator over HTTP), no operator yet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.operator.cluster import Cluster
from torchspot.lab.kubeapi import KubeApi


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """The emulated API, with KUBECONFIG pointing at it; no operator yet."""
    with KubeApi(tmp_path / "api") as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
        cluster = Cluster(server)
        yield cluster
        server.run(cluster.kube.close())
