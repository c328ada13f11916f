"""The operator tests' fixture: the emulated API (kmock's emulator over HTTP) with the CRD, no operator yet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.operator.cluster import Cluster
from tests.operator.jobs import crd
from torchspot.lab.kubeapi import KubeApi


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """The emulated API, with KUBECONFIG pointing at it; no operator yet.

    The CRD is applied first, as on a cluster: the emulator then defaults and checks every
    ElasticJob against its schema and CEL rules, and refuses a bad one (422) as the API server would.
    """
    with KubeApi(tmp_path / "api") as server:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
        cluster = Cluster(server)
        cluster.create(crd())
        yield cluster
        server.run(cluster.kube.close())
