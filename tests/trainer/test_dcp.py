"""Sharded checkpoints on Azure Blob through torch's distributed checkpoint (checkpoint/dcp.py), against a
real Azurite: a save and a load, asynchronous too; a writer killed mid-upload, whose checkpoint is never
loaded; two writers of one checkpoint, of which the first to commit wins; saves beside the loop's updates
(AsyncSaver); retention. Ranks writing their shards at once and loaded at another world size:
test_sharded.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save

from torchspot_lab.azurite import Azurite
from torchspot_trainer.checkpoint import dcp as blob
from torchspot_trainer.checkpoint.dcp import (
    AsyncSaver,
    BlobReader,
    BlobWriter,
    CheckpointConflict,
    TornCheckpoint,
    committed,
    load,
    prune,
)
from torchspot_trainer.checkpoint.manager import step_dir
from torchspot_trainer.checkpoint.storage import blob_container

BLOCK = 1 << 20
"""The tests' block (the product's is 8 MiB): several blocks per shard at a few MiB of state."""


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blob, "BLOCK_BYTES", BLOCK)


pytestmark = pytest.mark.usefixtures("one_rank_group")


def _state(seed: int) -> dict[str, torch.Tensor]:
    """A state with a tensor of several blocks beside small ones."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "large": torch.randn(3 * BLOCK // 4 + 1000, generator=generator),  # 3 blocks and a bit
        "small": torch.randn(7, 5, generator=generator),
        "step": torch.tensor(seed),
    }


def _empty() -> dict[str, torch.Tensor]:
    return {key: torch.zeros_like(value) for key, value in _state(0).items()}


def _prefix() -> str:
    return f"az://dcp/{uuid.uuid4().hex[:10]}"


def test_a_checkpoint_saved_to_blob_loads_whole_and_is_listed_once_committed(azurite: Azurite) -> None:
    env, prefix = azurite.env(), _prefix()
    save(_state(1), storage_writer=BlobWriter(f"{prefix}/step-1", env=env))
    loaded = _empty()
    dcp_load(loaded, storage_reader=BlobReader(f"{prefix}/step-1", env=env))
    assert all(torch.equal(loaded[key], value) for key, value in _state(1).items())
    assert committed(prefix, env=env) == [f"{prefix}/step-1"]


def test_an_async_saver_keeps_the_step_saved_though_the_loop_updates_once_it_is_staged(azurite: Azurite) -> None:
    """Two saves through one AsyncSaver, each followed by the loop's update as soon as `staged()` returns:
    each checkpoint holds the step saved, not the update after it. A third, into a checkpoint already
    committed, fails at the next wait, once, and the saver's close then succeeds."""
    env, prefix = azurite.env(), _prefix()
    state = _state(2)
    saver = AsyncSaver(env=env)
    for step in (2, 3):
        saver.save(state, f"{prefix}/step-{step}")  # (step 3's waits for step 2's upload)
        saver.staged()
        state["large"].add_(1.0)  # the next update
    saver.save(state, f"{prefix}/step-3")
    with pytest.raises(CheckpointException, match="already exists"):
        saver.wait(timeout=120)
    saver.close()
    for step, added in ((2, 0.0), (3, 1.0)):
        loaded = _empty()
        load(loaded, f"{prefix}/step-{step}", env=env)
        assert torch.equal(loaded["large"], _state(2)["large"] + added)
        assert torch.equal(loaded["small"], _state(2)["small"])


_KILLED_MID_UPLOAD = """
import os, signal, sys
from datetime import timedelta
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import save
from torchspot_trainer.checkpoint import dcp as blob
from tests.trainer.test_dcp import _state

def commit_then_die(self):  # every block of the first shard staged, none committed
    while self._staging:
        self._staging.popleft().result()
    os.kill(os.getpid(), signal.SIGKILL)

blob._BlockWriter.commit = commit_then_die
blob.BLOCK_BYTES = 1 << 20  # (the test's BLOCK)
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
save(_state(3), storage_writer=blob.BlobWriter(sys.argv[1]))
"""


def test_a_writer_killed_mid_upload_leaves_a_checkpoint_that_is_never_loaded(
    azurite: Azurite, caplog: pytest.LogCaptureFixture
) -> None:
    """A real writer process, killed (SIGKILL) with its shard's blocks staged and not committed: no metadata,
    so the checkpoint is not listed, a load refuses it in one line, and the one before it still loads."""
    env, prefix = azurite.env(), _prefix()
    save(_state(1), storage_writer=BlobWriter(f"{prefix}/step-1", env=env))
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_UPLOAD, f"{prefix}/step-3"], env={**_environ(), **env},
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    assert committed(prefix, env=env) == [f"{prefix}/step-1"]
    with caplog.at_level(logging.WARNING), pytest.raises(TornCheckpoint):
        load(_empty(), f"{prefix}/step-3", env=env)
    assert [r.message for r in caplog.records if "no metadata" in r.message] == [
        f"checkpoint {prefix}/step-3 has no metadata: its writer stopped before it committed; not loaded"
    ]
    loaded = _empty()
    load(loaded, f"{prefix}/step-1", env=env)
    assert torch.equal(loaded["large"], _state(1)["large"])


def _environ() -> dict[str, str]:
    return dict(os.environ)


class _HeldWriter(BlobWriter):
    """A writer that waits before its commit until told: another writer of the checkpoint commits first."""

    def __init__(self, uri: str, env: dict[str, str]) -> None:
        super().__init__(uri, env=env)
        self.at_commit, self.go = threading.Event(), threading.Event()

    def finish(self, *args: object, **kwargs: object) -> None:
        self.at_commit.set()
        self.go.wait(60)
        super().finish(*args, **kwargs)  # type: ignore[arg-type]


def test_of_two_writers_of_one_checkpoint_the_first_to_commit_wins_and_their_shards_never_mix(
    azurite: Azurite,
) -> None:
    env, uri = azurite.env(), f"{_prefix()}/step-4"
    held = _HeldWriter(uri, env)
    failed: list[BaseException] = []

    def second() -> None:
        try:
            save(_state(5), storage_writer=held)
        except BaseException as exc:  # what the test reads
            failed.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    assert held.at_commit.wait(60)  # its shards are written, its metadata not yet
    save(_state(4), storage_writer=BlobWriter(uri, env=env))
    held.go.set()
    thread.join(60)
    (error,) = failed
    assert isinstance(error, CheckpointException), error  # DCP's, with each rank's own error
    assert [type(exc) for exc, _trace in error.failures.values()] == [CheckpointConflict]
    loaded = _empty()
    dcp_load(loaded, storage_reader=BlobReader(uri, env=env))
    assert all(torch.equal(loaded[key], value) for key, value in _state(4).items())


def test_retention_keeps_the_newest_committed_and_a_newer_save_in_flight(azurite: Azurite) -> None:
    """Three committed checkpoints and two torn ones (one older than the newest committed, one newer: a
    save in flight): keeping two deletes the oldest committed and the older torn one, nothing else."""
    env, prefix = azurite.env(), _prefix()
    small = {"small": _state(0)["small"]}
    for step in (100, 200, 300):
        save(small, storage_writer=BlobWriter(f"{prefix}/{step_dir(step).rstrip('/')}", env=env))
    container, base = prefix.removeprefix("az://").split("/", 1)
    blobs = blob_container(container, env)
    for step in (250, 350):  # a shard with no metadata
        blobs.upload_blob(f"{base}/{step_dir(step)}__0_0.distcp", b"partial")
    gone = prune(prefix, keep=2, env=env)
    assert gone == [f"{prefix}/{step_dir(step).rstrip('/')}" for step in (100, 250)]
    assert committed(prefix, env=env) == [f"{prefix}/{step_dir(step).rstrip('/')}" for step in (200, 300)]
    left = {blob.name.split("/")[1] for blob in blobs.list_blobs(name_starts_with=f"{base}/")}
    assert left == {step_dir(step).rstrip("/") for step in (200, 300, 350)}
    with pytest.raises(ValueError, match="keep=0"):
        prune(prefix, keep=0, env=env)
