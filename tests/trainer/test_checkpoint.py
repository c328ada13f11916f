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
    LATEST_OBJECT,
    CheckpointConfig,
    CheckpointManager,
    SaveReport,
    committed_steps,
    read_latest,
    snapshot,
    state_object,
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
    storage.put(step_dir(20) + state_object(), b"half of a checkpoint")  # died before COMMIT
    with caplog.at_level(logging.WARNING):
        loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 10
    assert "step-0000000020/: no commit marker" in caplog.text


def test_corrupt_object_is_skipped_with_a_warning(storage: CheckpointStorage, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(storage)
    assert manager.save_sync(10, _state(10), {}).ok
    assert manager.save_sync(20, _state(20), {}).ok
    name = _state_object(storage, 20)
    good = storage.get(step_dir(20) + name)
    storage.put(step_dir(20) + name, good[:-10] + b"0123456789")  # same size, other bytes
    with caplog.at_level(logging.WARNING):
        loaded = manager.load_latest()
    assert loaded is not None
    assert loaded.step == 10
    assert f"step-0000000020/: {name} does not match its checksum" in caplog.text


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
    ((name, listed),) = commit["objects"].items()
    assert name.startswith("state-")  # a save's own object
    assert name.endswith(".pt")
    assert set(listed) == {"bytes", "sha256"}
    assert commit["meta"] == {"world_size": 3}
    assert storage.list(step_dir(5)) == sorted([step_dir(5) + COMMIT_OBJECT, step_dir(5) + name])


def test_a_checkpoint_whose_state_object_has_the_former_fixed_name_still_loads(storage: CheckpointStorage) -> None:
    """Checkpoints written before each save named its own object hold `state.pt`: their COMMIT names it."""
    manager = CheckpointManager(storage)
    assert manager.save_sync(5, _state(5), {}).ok
    name = _state_object(storage, 5)
    data = storage.get(step_dir(5) + name)
    commit = json.loads(storage.get(step_dir(5) + COMMIT_OBJECT))
    commit["objects"] = {"state.pt": commit["objects"][name]}
    storage.delete_prefix(step_dir(5))
    storage.put(step_dir(5) + "state.pt", data)
    storage.put(step_dir(5) + COMMIT_OBJECT, json.dumps(commit).encode())
    loaded = manager.load_step(5)
    assert loaded is not None
    assert torch.equal(loaded.state["model"]["w"], torch.full((64,), 5.0))


def _state_object(storage: CheckpointStorage, step: int) -> str:
    """The name of the state object the COMMIT of `step` names."""
    ((name, _),) = json.loads(storage.get(step_dir(step) + COMMIT_OBJECT))["objects"].items()
    return str(name)


class _Paused:
    """`storage` whose writes of objects whose names end with `at` wait for `go` (once set, they
    proceed): the moment between two of a writer's calls, held open while another writer runs."""

    def __init__(self, storage: CheckpointStorage, at: str) -> None:
        self._storage, self._at = storage, at
        self.reached, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def _pause(self, name: str) -> None:
        if name.endswith(self._at):
            self.reached.set()
            assert self.go.wait(30)

    def put(self, name: str, data: bytes) -> None:
        self._pause(name)
        self._storage.put(name, data)

    def put_new(self, name: str, data: bytes) -> bool:
        self._pause(name)
        return self._storage.put_new(name, data)

    def put_if(self, name: str, data: bytes, version: str | None) -> bool:
        self._pause(name)
        return self._storage.put_if(name, data, version)


def _in_thread(save: Any) -> tuple[threading.Thread, list[SaveReport]]:
    reports: list[SaveReport] = []
    thread = threading.Thread(target=lambda: reports.append(save()))
    thread.start()
    return thread, reports


def test_two_writers_of_one_prefix_never_tear_a_step_move_latest_back_or_prune_an_upload(
    storage: CheckpointStorage,
) -> None:
    """Writers that overlap on one prefix (an emergency save beside rank 0's saver, an old rank 0's saver
    finishing after a re-form). Same step: the slower one's COMMIT came last and named the other's
    object (a torn pair, skipped on load); now the first COMMIT stands, naming its own object. latest.json:
    read then written, the slower writer of an older step moved it back; now its write is conditional
    on what it read. Pruning: every uncommitted step older than the newest committed one went, an upload
    still in flight included, whose COMMIT then named nothing; now steps from the oldest kept one on stay."""
    # Same step: A has written its object and waits before its COMMIT while B saves the step whole.
    slow = _Paused(storage, COMMIT_OBJECT)
    writer_a, reports_a = _in_thread(lambda: CheckpointManager(slow).save_sync(20, _state(20), {"by": "a"}))
    assert slow.reached.wait(30)
    assert CheckpointManager(storage).save_sync(20, _state(21), {"by": "b"}).ok
    slow.go.set()
    writer_a.join(30)
    assert reports_a[0].ok  # the step is committed (by B)
    loaded = CheckpointManager(storage).load_step(20)
    assert loaded is not None
    assert loaded.meta == {"by": "b"}
    assert torch.equal(loaded.state["model"]["w"], torch.full((64,), 21.0))
    assert storage.list(step_dir(20)) == sorted(
        [step_dir(20) + COMMIT_OBJECT, step_dir(20) + _state_object(storage, 20)]
    )

    # latest.json: A (step 25) read it (at 20) and waits before its write while B commits step 30.
    slow = _Paused(storage, LATEST_OBJECT)
    writer_a, reports_a = _in_thread(lambda: CheckpointManager(slow).save_sync(25, _state(25), {}))
    assert slow.reached.wait(30)
    assert CheckpointManager(storage).save_sync(30, _state(30), {}).ok
    slow.go.set()
    writer_a.join(30)
    assert reports_a[0].ok
    latest = read_latest(storage)
    assert latest is not None
    assert latest["step"] == 30

    # Pruning (keep 3: 25, 30, 40): A uploads step 27 and waits before its COMMIT while B commits 40 and prunes.
    slow = _Paused(storage, COMMIT_OBJECT)
    config = CheckpointConfig(keep=3)
    writer_a, reports_a = _in_thread(lambda: CheckpointManager(slow, config).save_sync(27, _state(27), {}))
    assert slow.reached.wait(30)
    assert CheckpointManager(storage, config).save_sync(40, _state(40), {}).ok
    slow.go.set()
    writer_a.join(30)
    assert reports_a[0].ok
    loaded = CheckpointManager(storage).load_step(27)
    assert loaded is not None  # its object was still there when its COMMIT came
    assert committed_steps(storage.list("step-"))[-3:] == [27, 30, 40]
    assert CheckpointManager(storage, config).save_sync(50, _state(50), {}).ok  # 27 goes once older than the kept
    assert {_parse(name) for name in storage.list("step-")} == {30, 40, 50}


def _parse(name: str) -> int:
    return int(name.split("/", maxsplit=1)[0].removeprefix("step-"))


def test_conditional_writes_create_once_and_replace_only_what_was_read(storage: CheckpointStorage) -> None:
    assert storage.read_versioned("x") is None
    assert storage.put_new("x", b"first")
    assert not storage.put_new("x", b"second")
    found = storage.read_versioned("x")
    assert found is not None
    assert found[0] == b"first"
    assert not storage.put_if("x", b"blind", None)  # it exists
    assert storage.put_if("x", b"third", found[1])
    assert not storage.put_if("x", b"stale", found[1])  # written since that read
    assert storage.get("x") == b"third"
    assert storage.list() == ["x"]  # nothing written aside is left


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
