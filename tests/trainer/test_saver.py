"""The checkpoint saver process: real child processes, real shared memory, real storage."""

from __future__ import annotations

import os
import signal
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from torchspot_lab.azurite import Azurite
from torchspot_lab.local import wait_for
from torchspot_trainer.checkpoint.manager import CheckpointConfig, CheckpointManager, SaveReport
from torchspot_trainer.checkpoint.saver import ALIGN, TensorRef, buffer_layout, fill, unpack
from torchspot_trainer.checkpoint.storage import LocalStorage, open_storage


def _state(value: float) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64,), value), "mask": torch.tensor([True, False]), "bf": torch.ones(3).bfloat16()},
        "optimizer": {"state": {0: {"momentum": torch.full((2, 3), value)}}, "param_groups": [{"lr": 0.1}]},
        "rng": (3, torch.arange(5, dtype=torch.uint8)),
        "scalar": torch.tensor(value),
        "empty": torch.zeros(0, 4),
        "step": int(value),
    }


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_plan_fill_unpack_roundtrip_keeps_every_dtype_and_aligns() -> None:
    state = _state(2.5)
    skeleton, size = buffer_layout(state)
    refs = [skeleton["model"]["w"], skeleton["model"]["mask"], skeleton["model"]["bf"], skeleton["scalar"]]
    assert all(isinstance(ref, TensorRef) and ref.offset % ALIGN == 0 for ref in refs)
    assert skeleton["step"] == 2
    buffer = torch.empty(size, dtype=torch.uint8)
    fill(buffer, state, skeleton)
    state["model"]["w"].fill_(-1)  # the copy does not alias the original
    copy = unpack(skeleton, buffer)
    _assert_same(copy, _state(2.5))


def _manager(tmp_path: Path, **kwargs: Any) -> CheckpointManager:
    folder = tmp_path / "ckpt"
    return CheckpointManager(LocalStorage(folder), reopen=partial(LocalStorage, folder), **kwargs)


def test_async_save_runs_in_a_child_process_from_a_boundary_snapshot(tmp_path: Path) -> None:
    reports: list[SaveReport] = []
    manager = _manager(tmp_path, on_report=reports.append)
    try:
        pid = manager.saver_pid
        assert pid is not None
        assert pid != os.getpid()
        assert pid in {child.pid for child in psutil.Process().children()}
        state = _state(1)
        manager.save_async(1, state, {"epoch": 0})
        state["model"]["w"].fill_(99)  # the next training step
        report = manager.wait()
        assert report is not None
        assert report.ok
        assert manager.last_committed == 1  # recorded before wait() returned
        assert [r.step for r in reports] == [1]
        # The state grows (an optimizer's buffers appear after the first step): a larger buffer is sent.
        bigger = _state(2)
        bigger["optimizer"]["state"][1] = {"momentum": torch.randn(1000, 10)}
        manager.save_async(2, bigger, {"epoch": 0})
        assert manager.wait() == reports[-1]
        loaded = manager.load_latest()
        assert loaded is not None
        assert loaded.step == 2
        assert loaded.meta == {"epoch": 0}
        _assert_same(loaded.state, bigger)
        first = manager.load_step(1)
        assert first is not None
        _assert_same(first.state, _state(1))
    finally:
        manager.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_manager_that_saved_on_a_thread_saves_in_a_child_once_told_and_stops_it_when_told_again(
    tmp_path: Path,
) -> None:
    """In place, a rank 0 whose predecessor was lost is told to save in a saver process (train.py's
    `_ranks_changed`), and stops it once it is another rank: each save's report says where it ran."""
    folder = tmp_path / "ckpt"
    reports: list[SaveReport] = []
    manager = CheckpointManager(LocalStorage(folder), on_report=reports.append)
    try:
        manager.save_async(1, _state(1), {})
        assert manager.wait() is not None
        assert [manager.saver_pid] == [None]  # (a list: mypy would take the property for None from here on)
        manager.save_in_child(partial(LocalStorage, folder))
        assert [manager.saver_pid] == [None]  # started by the next save, not on the re-form's path
        manager.save_async(2, _state(2), {})
        pid = manager.saver_pid
        assert pid is not None
        assert pid in {child.pid for child in psutil.Process().children()}
        assert manager.wait() is not None
        manager.save_in_child(partial(LocalStorage, folder))  # a rank 0 that stays rank 0: the same child
        manager.save_async(3, _state(3), {})
        assert manager.saver_pid == pid
        manager.save_on_thread()  # with step 3 in flight: it is finished, then the child stops
        report = manager.wait()
        assert report is not None
        assert (report.step, report.ok, report.saver) == (3, True, "process")
        assert [manager.saver_pid] == [None]
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10,
                 "the saver process to stop")  # fmt: skip
        manager.save_async(4, _state(4), {})
        assert manager.wait() is not None
        emergency = manager.save_sync(5, _state(5), {})
        assert [(r.step, r.ok, r.saver) for r in reports] == [
            (1, True, "thread"), (2, True, "process"), (3, True, "process"), (4, True, "thread"), (5, True, "caller")
        ]  # fmt: skip
        assert emergency == reports[-1]
        loaded = manager.load_latest()
        assert loaded is not None
        _assert_same(loaded.state, _state(5))
    finally:
        manager.close()


def test_saver_ignores_sigterm_meant_for_the_pod(tmp_path: Path) -> None:
    """An eviction signals every process of the pod; the trainer decides when saving stops."""
    manager = _manager(tmp_path)
    try:
        pid = manager.saver_pid
        assert pid is not None
        manager.save_async(1, _state(1), {})
        assert manager.wait() is not None  # the child is up and has installed its handlers
        os.kill(pid, signal.SIGTERM)
        manager.save_async(2, _state(2), {})
        report = manager.wait()
        assert report is not None
        assert report.ok
        assert manager.saver_pid == pid
    finally:
        manager.close()


def test_saver_death_fails_the_save_in_flight_and_saving_goes_on(tmp_path: Path) -> None:
    """The child retries against a Blob endpoint that does not answer; it is killed meanwhile."""
    unreachable = partial(
        open_storage,
        "az://ckpt/run",
        {"AZURE_STORAGE_ACCOUNT_URL": "http://127.0.0.1:9/devstoreaccount1", "AZURE_STORAGE_SAS_TOKEN": "sv=x"},
        timeout=0.5,
        create_container=False,
    )
    folder = tmp_path / "ckpt"
    manager = CheckpointManager(
        LocalStorage(folder), CheckpointConfig(retries=50, backoff=0.2, max_backoff=0.2), reopen=unreachable
    )
    try:
        pid = manager.saver_pid
        assert pid is not None
        manager.save_async(7, _state(7), {})
        os.kill(pid, signal.SIGKILL)
        failed = manager.wait()
        assert failed is not None
        assert not failed.ok
        assert failed.step == 7
        assert "exited during a save" in (failed.error or "")
        assert manager.last_error is not None
        # Training goes on; the next save runs on a thread of this process, to the parent's storage.
        manager.save_async(8, _state(8), {})
        report = manager.wait()
        assert report is not None
        assert report.ok
        assert manager.saver_pid is None
        assert manager.last_error is None
    finally:
        manager.close()


def test_storage_the_child_cannot_open_is_reported_not_lost(tmp_path: Path) -> None:
    """No credentials in the child's environment: every save says so, and training goes on."""
    manager = CheckpointManager(LocalStorage(tmp_path), reopen=partial(open_storage, "az://ckpt/run", {}))
    try:
        manager.save_async(1, _state(1), {})
        report = manager.wait()
        assert report is not None
        assert not report.ok
        assert "cannot open checkpoint storage" in (report.error or "")
        assert "AZURE_STORAGE_CONNECTION_STRING" in (report.error or "")
    finally:
        manager.close()


def test_child_saves_to_blob_with_credentials_from_the_environment(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in a pod: the connection string is in the environment, not in anything sent to the child."""
    for key, value in azurite.env().items():
        monkeypatch.setenv(key, value)
    uri = f"az://checkpoints/{uuid.uuid4().hex}"
    manager = CheckpointManager(open_storage(uri), reopen=partial(open_storage, uri))
    try:
        manager.save_async(3, _state(3), {})
        report = manager.wait()
        assert report is not None
        assert report.ok
        loaded = manager.load_latest()
        assert loaded is not None
        _assert_same(loaded.state, _state(3))
    finally:
        manager.close()


def test_child_tells_the_parent_it_is_retrying_so_the_next_save_is_skipped(tmp_path: Path) -> None:
    """Blob goes away under the child: its retry notes cross the pipe, the next save is skipped
    rather than waited for, and the retrying save commits once Blob is back."""
    blob = Azurite(tmp_path / "azurite")
    blob.start()
    uri = f"az://checkpoints/{uuid.uuid4().hex}"
    reopen = partial(open_storage, uri, blob.env(), timeout=1.0)
    reports: list[SaveReport] = []
    manager = CheckpointManager(
        reopen(), CheckpointConfig(retries=200, backoff=0.2, max_backoff=0.2), on_report=reports.append, reopen=reopen
    )
    try:
        manager.save_async(1, _state(1), {})
        assert manager.wait() is not None
        blob.stop()
        manager.save_async(2, _state(2), {})
        wait_for(lambda: manager.last_error and "(retrying)" in manager.last_error, 60, "the child's retry note")
        assert manager.save_async(3, _state(3), {}) < 1
        assert [(r.step, r.ok) for r in reports] == [(1, True), (3, False)]
        assert "storage is failing" in (reports[-1].error or "")
        blob.start()
        report = manager.wait()
        assert report is not None
        assert (report.step, report.ok) == (2, True)
        assert report.attempts > 1
        loaded = manager.load_latest()
        assert loaded is not None
        _assert_same(loaded.state, _state(2))
    finally:
        manager.close()
        blob.stop()
