"""The operator tests' fixture: the emulated API (kmock's emulator over HTTP) with the CRD, no operator yet."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from kopf.testing import KopfRunner

from tests.operator.cluster import Cluster
from tests.operator.jobs import crd
from torchspot_lab.kubeapi import KubeApi


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


OPERATOR_ARGS = ["run", "--standalone", "--all-namespaces", "-m", "torchspot_operator.handlers"]


@contextlib.contextmanager
def operator_running(*extra: str) -> Iterator[None]:
    """The real operator (kopf in a background thread of this process) until the block ends."""
    with KopfRunner([*OPERATOR_ARGS, *extra], timeout=60) as runner:
        yield
    failure: BaseException | None = runner.exception  # typed as never None, but None when all went well
    assert failure is None, runner.output
    assert runner.exit_code == 0, runner.output


@pytest.fixture
def cluster(api: Cluster) -> Iterator[Cluster]:
    """The emulated API with the operator running against it."""
    with operator_running():
        yield api
