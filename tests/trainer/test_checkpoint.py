"""Checkpoints on a local folder and on Azure Blob (Azurite): atomic, checked, async."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torchspot_lab.azurite import Azurite
from torchspot_lab.local import wait_for
from torchspot_trainer.checkpoint.manager import (
    COMMIT_OBJECT,
    STATE_OBJECT,
    CheckpointConfig,
    CheckpointManager,
    SaveReport,
    read_latest,
    snapshot,
    step_dir,
)
from torchspot_trainer.checkpoint.storage import CheckpointStorage, LocalStorage, StorageError, open_storage


@pytest.fixture(params=["local", "blob"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStorage]:
    if request.param == "local":
        yield LocalStorage(tmp_path / "ckpt")
        return
    azurite: Azurite = request.getfixturevalue("azurite")
    yield open_storage(f"az://checkpoints/{uuid.uuid4().hex}", azurite.env())


def _state(value: float) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64,), value)},
        "step": int(value),
        "nested": [torch.ones(2) * value],
    }


def test_roundtrip_and_latest_record(storage: CheckpointStorage) -> None:
    manager = CheckpointManager(storage)
    assert manager.load_latest() is None
    assert manager.save_sync(10, _state(10), {"epoch": 0}).ok
    assert manager.save_sync(20, _state(20), {"epoch": 1}).ok
    loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 20
    assert loaded.meta == {"epoch": 1}
    assert torch.equal(loaded.state["model"]["w"], torch.full((64,), 20.0))
    latest = read_latest(storage)
    assert latest is not None
    assert latest["step"] == 20
    assert latest["uri"].endswith(step_dir(20))


def test_a_save_that_commits_late_never_moves_latest_backwards(storage: CheckpointStorage) -> None:
    """A periodic save of step 10 retried past the emergency save of step 15: latest.json stays at 15."""
    manager = CheckpointManager(storage)
    assert manager.save_sync(15, _state(15), {}).ok
    assert manager.save_sync(10, _state(10), {}).ok  # committed, as a step of its own
    latest = read_latest(storage)
    assert latest is not None
    assert latest["step"] == 15
    loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 15


def test_partial_upload_is_skipped_with_a_warning(storage: CheckpointStorage, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(storage)
    assert manager.save_sync(10, _state(10), {}).ok
    storage.put(step_dir(20) + STATE_OBJECT, b"half of a checkpoint")  # died before COMMIT
    with caplog.at_level(logging.WARNING):
        loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 10
    assert "step-0000000020/: no commit marker" in caplog.text


def test_corrupt_object_is_skipped_with_a_warning(storage: CheckpointStorage, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(storage)
    assert manager.save_sync(10, _state(10), {}).ok
    assert manager.save_sync(20, _state(20), {}).ok
    good = storage.get(step_dir(20) + STATE_OBJECT)
    storage.put(step_dir(20) + STATE_OBJECT, good[:-10] + b"0123456789")  # same size, other bytes
    with caplog.at_level(logging.WARNING):
        loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 10
    assert "step-0000000020/: state.pt does not match its checksum" in caplog.text


def test_keeps_the_newest_k_after_each_commit(storage: CheckpointStorage) -> None:
    manager = CheckpointManager(storage, CheckpointConfig(keep=2))
    for step in (1, 2, 3, 4):
        assert manager.save_sync(step, _state(step), {}).ok
    steps = sorted({name.split("/")[0] for name in storage.list("step-")})
    assert steps == [step_dir(3).rstrip("/"), step_dir(4).rstrip("/")]


def test_async_save_snapshots_then_uploads_in_background(tmp_path: Path) -> None:
    """Training may change the tensors right after save_async returns."""
    gate = threading.Event()

    class SlowStorage(LocalStorage):
        def put(self, name: str, data: bytes) -> None:
            gate.wait(10)
            super().put(name, data)

    manager = CheckpointManager(SlowStorage(tmp_path))
    state = _state(1)
    stall = manager.save_async(1, state, {})
    state["model"]["w"].fill_(99)  # the training step after the save
    assert manager.last_committed is None  # still uploading
    gate.set()
    report = manager.wait()
    assert report is not None
    assert report.ok
    assert stall < 5
    loaded = manager.load_latest()
    assert loaded is not None
    assert torch.equal(loaded.state["model"]["w"], torch.full((64,), 1.0))


def test_a_new_save_waits_for_the_previous_one(tmp_path: Path) -> None:
    active = []
    overlap = []

    class Tracking(LocalStorage):
        def put(self, name: str, data: bytes) -> None:
            active.append(name)
            overlap.append(len(active))
            super().put(name, data)
            active.pop()

    manager = CheckpointManager(Tracking(tmp_path))
    for step in range(1, 6):
        manager.save_async(step, _state(step), {})
    manager.close()
    assert max(overlap) == 1
    assert manager.last_committed == 5


def test_a_notice_ends_the_wait_for_the_previous_save_and_skips_this_one(tmp_path: Path) -> None:
    """A SIGTERM while the loop waits for the save in flight: the wait ends at once (the next
    boundary's emergency checkpoint supersedes this save), so the SIGTERM watcher never takes a
    loop that waits on its own upload for one stuck in a collective."""
    released = threading.Event()

    class Slow(LocalStorage):  # an upload that takes as long as the test says
        def put(self, name: str, data: bytes) -> None:
            released.wait(30)
            super().put(name, data)

    reports: list[SaveReport] = []
    notice = threading.Event()
    manager = CheckpointManager(Slow(tmp_path), on_report=reports.append)
    try:
        manager.save_async(5, _state(5), {})
        stalls: list[float] = []
        waiter = threading.Thread(
            target=lambda: stalls.append(manager.save_async(10, _state(10), {}, give_up=notice.is_set))
        )
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # without a notice the next save waits, as before
        notice.set()
        waiter.join(5)
        assert not waiter.is_alive()
        assert len(stalls) == 1
        assert stalls[0] < 5
        assert manager.in_flight == 5
        assert manager.save_async(15, _state(15), {}, give_up=notice.is_set) < 1  # a notice already set: no wait
        released.set()
        report = manager.wait()
        assert report is not None
        assert (report.step, report.ok) == (5, True)
    finally:
        released.set()
        manager.close()
    assert [(r.step, r.ok) for r in reports] == [(5, True)]  # the skipped saves are not failures
    loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 5


class FlakyStorage(LocalStorage):
    """A local folder whose writes fail while `failing` is set, as Blob does during an outage."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failing = threading.Event()

    def put(self, name: str, data: bytes) -> None:
        if self.failing.is_set():
            raise StorageError("blob endpoint unreachable")
        super().put(name, data)


def test_outage_retries_reports_and_loses_nothing_committed(tmp_path: Path) -> None:
    reports: list[SaveReport] = []
    storage = FlakyStorage(tmp_path)
    failing = storage.failing
    naps: list[float] = []
    manager = CheckpointManager(
        storage,
        CheckpointConfig(retries=3, backoff=0.5),
        on_report=reports.append,
        sleep=naps.append,
    )
    assert manager.save_sync(10, _state(10), {}).ok
    failing.set()
    failed = manager.save_sync(20, _state(20), {})
    assert not failed.ok
    assert failed.attempts == 3
    assert naps == [0.5, 1.0]  # exponential backoff between attempts
    assert manager.last_error is not None
    assert "unreachable" in manager.last_error
    assert [r.ok for r in reports] == [True, False]
    loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 10  # the committed checkpoint survived the failed save
    failing.clear()
    assert manager.save_sync(30, _state(30), {}).ok
    assert manager.last_error is None


def test_a_save_due_while_the_previous_one_retries_is_skipped_not_waited_for(tmp_path: Path) -> None:
    """An outage must not stall training: the retrying save goes on, the next one is skipped and reported."""
    reports: list[SaveReport] = []
    storage = FlakyStorage(tmp_path)
    failing = storage.failing
    storage_back = threading.Event()

    def nap(_: float) -> None:  # the backoff lasts until the test brings storage back
        storage_back.wait(30)

    manager = CheckpointManager(storage, CheckpointConfig(retries=3), on_report=reports.append, sleep=nap)
    try:
        failing.set()
        manager.save_async(20, _state(20), {})
        wait_for(lambda: manager.last_error and "(retrying)" in manager.last_error, 30, "the first failed attempt")
        assert manager.save_async(30, _state(30), {}) < 1  # returns at once; the retrying save is not waited for
        assert [(r.step, r.ok, r.error) for r in reports] == [
            (30, False, "skipped: storage is failing and step 20 is still saving")
        ]
        failing.clear()
        storage_back.set()
        report = manager.wait()
        assert report is not None
        assert (report.step, report.ok, report.attempts) == (20, True, 2)
        assert manager.last_error is None
        manager.save_async(40, _state(40), {})  # storage is healthy again: saves wait for each other as before
        final = manager.wait()
        assert final is not None
        assert final.ok
    finally:
        manager.close()
    loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 40


def test_commit_marker_lists_checksums(storage: CheckpointStorage) -> None:
    CheckpointManager(storage).save_sync(5, _state(5), {"world_size": 3})
    commit = json.loads(storage.get(step_dir(5) + COMMIT_OBJECT))
    assert commit["step"] == 5
    assert set(commit["objects"][STATE_OBJECT]) == {"bytes", "sha256"}
    assert commit["meta"] == {"world_size": 3}


def test_snapshot_copies_tensors() -> None:
    zeros = torch.zeros(3)
    original: dict[str, Any] = {"a": [zeros], "b": (torch.ones(1),), "c": 3}
    copy = snapshot(original)
    zeros.fill_(7)
    assert torch.equal(copy["a"][0], torch.zeros(3))
    assert copy["c"] == 3


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://bucket/x", "unknown scheme 's3'"),
        ("az:///prefix", "expected az://CONTAINER/PREFIX"),
        ("az://container/prefix", "set AZURE_STORAGE_CONNECTION_STRING"),
    ],
)
def test_bad_checkpoint_uri_names_the_flag(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match="--checkpoint-uri") as info:
        open_storage(uri, {})
    assert message in str(info.value)


def test_describe_never_shows_the_key(azurite: Azurite) -> None:
    storage = open_storage("az://checkpoints/x", azurite.env())
    assert "AccountKey" not in storage.describe()
    assert azurite.connection_string.split("AccountKey=")[1].split(";")[0] not in storage.describe()


def test_data_set_is_copied_from_a_blob_prefix(azurite: Azurite, tmp_path: Path) -> None:
    from torchspot_lab.datasets import write_synthetic_cifar10
    from torchspot_trainer.data.datasets import load_cifar10
    from torchspot_trainer.data.fetch import fetch_prefix

    archive = write_synthetic_cifar10(tmp_path / "src" / "cifar-10-python.tar.gz", n_train=20, n_test=5)
    prefix = f"az://datasets/{uuid.uuid4().hex}"
    open_storage(prefix, azurite.env()).put("cifar-10-python.tar.gz", archive.read_bytes())

    cache = fetch_prefix(prefix, tmp_path / "cache", azurite.env())
    assert (cache / "cifar-10-python.tar.gz").read_bytes() == archive.read_bytes()
    train, test = load_cifar10(cache / "cifar-10-python.tar.gz")
    assert (len(train), len(test)) == (20, 5)


def test_the_local_ranks_of_a_node_copy_a_data_set_once(azurite: Azurite, tmp_path: Path) -> None:
    """Four processes (a node's local ranks) fetch the same prefix into one cache at once: one
    copies, the others wait for it and find it complete; no partial file is left."""
    prefix = f"az://datasets/{uuid.uuid4().hex}"
    storage = open_storage(prefix, azurite.env())
    for i in range(20):
        storage.put(f"train/c{i % 2}/{i}.bin", bytes([i]) * 50_000)
    cache = tmp_path / "cache"
    code = (
        "import sys; from pathlib import Path; from torchspot_trainer.data.fetch import fetch_prefix; "
        "fetch_prefix(sys.argv[1], Path(sys.argv[2]))"
    )
    env = {**os.environ, **azurite.env()}
    ranks = [subprocess.Popen([sys.executable, "-c", code, prefix, str(cache)], env=env) for _ in range(4)]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0, 0, 0]
    (marker,) = cache.glob(".complete-*")
    assert marker.read_text() == f"{prefix}\n20 objects fetched\n"  # one copier fetched all; the others none
    assert sorted(p.name for p in cache.rglob("*.bin")) == sorted(f"{i}.bin" for i in range(20))
    assert not list(cache.rglob("*.partial"))


def test_sas_token_credentials(azurite: Azurite) -> None:
    """A SAS token (as a Kubernetes Secret would carry it) instead of a connection string."""
    from datetime import UTC, datetime, timedelta

    from azure.storage.blob import BlobServiceClient, ContainerSasPermissions, generate_container_sas

    from torchspot_lab.azurite import ACCOUNT, DEV_KEY

    container = f"sas{uuid.uuid4().hex[:12]}"
    BlobServiceClient.from_connection_string(azurite.connection_string).create_container(container)
    sas = generate_container_sas(
        ACCOUNT, container, account_key=DEV_KEY,
        permission=ContainerSasPermissions(read=True, write=True, delete=True, list=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )  # fmt: skip
    env = {"AZURE_STORAGE_ACCOUNT_URL": azurite.account_url, "AZURE_STORAGE_SAS_TOKEN": sas}
    storage = open_storage(f"az://{container}/run", env, create_container=False)
    manager = CheckpointManager(storage)
    assert manager.save_sync(3, _state(3), {}).ok
    loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 3
    assert sas not in storage.describe()
