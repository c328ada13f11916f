"""Sharded checkpoints on Azure Blob through torch's distributed checkpoint (DCP): a storage writer and a
reader for `az://container/prefix`, on the project's Azure SDK and credentials (storage.py).

- **Each rank writes its own shards**, one blob per rank and write, in blocks of BLOCK_BYTES staged
  `concurrency` at a time while DCP serialises the next (`_BlockWriter`): the rank's upload runs in
  parallel, and the rank holds at most the blocks in flight beyond DCP's own copy of the state. A blob
  appears only when its block list commits, whole.
- **A checkpoint commits when its metadata is written**, last, by DCP's coordinator, create-only
  (If-None-Match): a reader loads only a checkpoint with metadata (a writer killed mid-upload left none,
  and the reader says so in one line), and of two writers of one checkpoint the first to commit wins;
  the other fails, saying why. Their shards never mix: each write names its blobs with its own id.
- **A reader fetches the byte ranges it reads** (a window of READ_BYTES at least), not whole shards: at
  another world size each rank reads the parts of every shard it needs (DCP reshards).
- **Retention** (`prune`) keeps the newest committed checkpoints under a prefix (their folders sort by
  step: checkpoint/manager.py's `step_dir`), deletes older ones and the torn ones older than the newest
  committed (a torn one newer than it may be a save in flight).
- **Asynchronous saving** (`AsyncSaver`) is DCP's own `async_save`, with the copy to host memory on a
  thread of its own into one host buffer per rank, kept from save to save: the loop waits only where its
  next update would change what is still being copied (`AsyncSaver.staged`), and the upload runs on DCP's
  thread while training goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pickle
import uuid
from collections import deque
from collections.abc import Generator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, cast
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save
from torch.distributed.checkpoint.storage import WriteResult

from torchspot_trainer.checkpoint.storage import blob_container

__all__ = [
    "BLOCK_BYTES",
    "METADATA",
    "AsyncSaver",
    "BlobReader",
    "BlobWriter",
    "CheckpointConflict",
    "TornCheckpoint",
    "committed",
    "folders",
    "load",
    "prune",
    "storage_writer",
]

log = logging.getLogger(__name__)

BLOCK_BYTES = 8 << 20
"""One staged block of a shard's blob: large enough that a request's overhead is small beside its
transfer, small enough that `concurrency` of them in flight are a modest buffer."""
READ_BYTES = 16 << 20
"""The least a reader fetches at once from a shard: DCP reads each tensor's slice as many small reads
(torch.load's zip records), which one window serves."""
METADATA = ".metadata"
"""DCP's metadata blob, under the checkpoint's prefix: written last, its presence is the commit."""


class TornCheckpoint(FileNotFoundError):
    """A checkpoint with no metadata: its writer stopped before it committed. Never loaded."""


def _torn(uri: str) -> TornCheckpoint:
    return TornCheckpoint(f"{uri}: no {METADATA} (a writer stopped before it committed)")


class CheckpointConflict(FileExistsError):
    """Another writer committed this checkpoint first; this write's shards are not part of it."""


def _split(uri: str | os.PathLike[str]) -> tuple[str, str]:
    """(container, prefix) of an `az://container/prefix` URI; ValueError for anything else."""
    parsed = urlparse(os.fspath(uri))
    if parsed.scheme != "az" or not parsed.netloc:
        raise ValueError(f"{os.fspath(uri)!r}: expected az://CONTAINER/PREFIX")
    return parsed.netloc, parsed.path.strip("/")


class _BlockWriter(io.RawIOBase):
    """A shard's blob written as DCP writes it: each full block staged on a thread while the next fills, at
    most `concurrency` in flight; the block list committed by `commit` (the blob then appears whole)."""

    def __init__(self, blob: Any, pool: ThreadPoolExecutor, concurrency: int) -> None:
        self._blob, self._pool, self._limit = blob, pool, concurrency
        self._buffer = bytearray()
        self._position = 0
        self._blocks: list[str] = []
        self._staging: deque[Future[None]] = deque()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        """Take `data` a block's room at a time: the buffer never holds more than one block, however large a
        tensor DCP writes at once (it hands over a whole tensor's bytes)."""
        view = memoryview(data).cast("B")
        taken = 0
        while taken < len(view):
            piece = view[taken : taken + BLOCK_BYTES - len(self._buffer)]
            self._buffer += piece
            taken += len(piece)
            if len(self._buffer) == BLOCK_BYTES:
                self._stage(bytes(self._buffer))
                self._buffer.clear()
        self._position += len(view)
        return len(view)

    def tell(self) -> int:
        return self._position

    def _stage(self, block: bytes) -> None:
        while len(self._staging) >= self._limit:  # the oldest first: a failed block fails the write here
            self._staging.popleft().result()
        block_id = f"{len(self._blocks):08d}-{uuid.uuid4().hex[:8]}"
        self._blocks.append(block_id)
        self._staging.append(self._pool.submit(self._blob.stage_block, block_id, block, length=len(block)))

    def commit(self) -> None:
        """The rest staged, every block waited for, then the block list committed."""
        if self._buffer or not self._blocks:
            self._stage(bytes(self._buffer))
            self._buffer.clear()
        while self._staging:
            self._staging.popleft().result()
        self._blob.commit_block_list(self._blocks)


class _RangeReader(io.RawIOBase):
    """A shard's blob read by byte ranges, READ_BYTES at least at a time, the last window kept."""

    def __init__(self, blob: Any) -> None:
        self._blob = blob
        self._size = int(blob.get_blob_properties().size)
        self._position = 0
        self._window = (0, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self._size - self._position)
        if wanted <= 0:
            return 0
        start, data = self._window
        if not (start <= self._position and self._position + wanted <= start + len(data)):
            length = min(max(wanted, READ_BYTES), self._size - self._position)
            data = self._blob.download_blob(offset=self._position, length=length, max_concurrency=4).readall()
            start = self._position
            self._window = (start, data)
        offset = self._position - start
        view[:wanted] = data[offset : offset + wanted]
        self._position += wanted
        return wanted


class _BlobFileSystem(FileSystemBase):
    """DCP's file system on a Blob container: paths are blob names under the checkpoint's prefix."""

    def __init__(self, env: Mapping[str, str] | None, concurrency: int) -> None:
        self._env, self._concurrency = env, concurrency
        self._container: Any = None
        self._name = ""
        """The container's name (`init_path`)."""
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="torchspot-blocks")

    def container(self) -> Any:
        if self._container is None:
            raise RuntimeError("no checkpoint path yet")
        return self._container

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        blob = self.container().get_blob_client(os.fspath(path))
        if "w" in mode:
            writer = _BlockWriter(blob, self._pool, self._concurrency)
            yield writer  # (an error inside leaves the blocks uncommitted: no blob appears)
            writer.commit()
        else:
            from azure.core.exceptions import ResourceNotFoundError  # noqa: PLC0415

            try:
                reader = _RangeReader(blob)
            except ResourceNotFoundError:
                raise FileNotFoundError(os.fspath(path)) from None
            yield reader

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}" if os.fspath(path) else suffix

    def init_path(self, path: str | os.PathLike[str]) -> str:
        name, prefix = _split(path)
        self._container, self._name = blob_container(name, self._env), name
        return prefix

    def uri(self, path: str) -> str:
        """The `az://` URI of `path` (a prefix `init_path` returned)."""
        return f"az://{self._name}/{path}"

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("a blob is not renamed: the metadata is written once, create-only")

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing: a Blob container has no folders."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith("az://")

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return bool(self.container().get_blob_client(os.fspath(path)).exists())

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.container().delete_blob(os.fspath(path))


class _OnBlob:
    """What DCP's Blob writer and reader share: their file system, and the checkpoint's URI, which DCP
    asks for (`checkpoint_id`) and passes back to `reset`, derived from the path it keeps."""

    fs: Any
    path: Any

    def _on_blob(self, uri: str, env: Mapping[str, str] | None, concurrency: int) -> None:
        self.fs = _BlobFileSystem(env, concurrency)
        self.path = self.fs.init_path(uri)

    @property
    def checkpoint_id(self) -> str:
        return cast(_BlobFileSystem, self.fs).uri(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _BlobFileSystem.validate_checkpoint_id(checkpoint_id)


class BlobWriter(_OnBlob, FileSystemWriter):
    """DCP's storage writer for `az://container/prefix` (module docstring): `dcp.save(state,
    storage_writer=BlobWriter(uri))`, or `dcp.async_save`.

    :param uri: the checkpoint's location (one checkpoint per prefix: a step's folder).
    :param env: where the account and credentials come from (storage.py; default os.environ).
    :param concurrency: blocks staged at once per rank.
    """

    def __init__(self, uri: str, *, env: Mapping[str, str] | None = None, concurrency: int = 8) -> None:
        super().__init__(uri, single_file_per_rank=True, sync_files=False, overwrite=False)
        self._on_blob(uri, env, concurrency)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Each rank's shards named with this write's id as well as the rank (DCP names them by rank only):
        two writers of one checkpoint never write the same blob."""
        write = self.save_id.replace("-", "")[:12]
        planned = super().prepare_global_plan(plans)
        return [
            dataclasses.replace(plan, storage_data=type(plan.storage_data)(f"__{write}{plan.storage_data.prefix}"))
            for plan in planned
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: the metadata, which names every rank's shards, written once (If-None-Match). Raises
        CheckpointConflict where another writer committed first."""
        from azure.core.exceptions import ResourceExistsError  # noqa: PLC0415
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION  # noqa: PLC0415

        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        name = self.fs.concat_path(self.path, METADATA)
        try:
            cast(_BlobFileSystem, self.fs).container().upload_blob(name, pickle.dumps(metadata), overwrite=False)
        except ResourceExistsError:
            raise CheckpointConflict(f"{self.checkpoint_id}: committed by another writer first; this write's "
                                     "shards are not part of it") from None  # fmt: skip


class BlobReader(_OnBlob, FileSystemReader):
    """DCP's storage reader for `az://container/prefix`: `dcp.load(state, storage_reader=BlobReader(uri))`
    loads a committed checkpoint at any world size, and refuses a torn one (TornCheckpoint).

    :param uri: the checkpoint's location.
    :param env: where the account and credentials come from (storage.py; default os.environ).
    """

    def __init__(self, uri: str, *, env: Mapping[str, str] | None = None) -> None:
        super().__init__(uri)
        self._on_blob(uri, env, concurrency=1)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata; TornCheckpoint where there is none (`load` says so in one line; DCP
        then looks for a rank's own, which this writer never writes, and fails the load)."""
        try:
            return super().read_metadata(*args, **kwargs)
        except FileNotFoundError:
            raise _torn(self.checkpoint_id) from None


def load(
    state_dict: dict[str, Any],
    uri: str,
    *,
    env: Mapping[str, str] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """`dcp.load` of the checkpoint at `uri` into `state_dict` (at this world size: DCP reshards), only where
    it committed: a torn one raises TornCheckpoint, said in one line, before any rank reads a shard.
    `process_group`: the group DCP coordinates over (default: torch's default group)."""
    reader = BlobReader(uri, env=env)
    if not reader.fs.exists(reader.fs.concat_path(reader.path, METADATA)):
        log.warning("checkpoint %s has no metadata: its writer stopped before it committed; not loaded", uri)
        raise _torn(uri)
    dcp_load(state_dict, storage_reader=reader, process_group=process_group)


def storage_writer(uri: str, *, env: Mapping[str, str] | None = None, concurrency: int = 8) -> FileSystemWriter:
    """DCP's writer for `uri`: BlobWriter for `az://container/prefix`, else torch's own for a local folder
    (its metadata written under a temporary name and renamed: committed last, as on Blob)."""
    if uri.startswith("az://"):
        return BlobWriter(uri, env=env, concurrency=concurrency)
    return FileSystemWriter(uri, single_file_per_rank=True, overwrite=False)


class AsyncSaver:
    """This rank's sharded checkpoints saved beside training (module docstring): `save(state, uri)` returns
    once the copy to host memory has begun on its thread; the upload follows on DCP's (to Blob, or to a
    local folder: `storage_writer`).

    The loop's rule: after `save`, the state may be read (forward and backward passes) but not changed
    until `staged()` returns, so call it before the next optimizer update; the copy is then of the step
    saved, whatever the loop did meanwhile. One save at a time: a `save` first waits for the previous
    one's upload, since both use the one host buffer (a rank holds at most one extra copy of its shards).

    :param env: where the account and credentials come from (storage.py; default os.environ).
    :param concurrency: blocks staged at once per rank (BlobWriter).
    :param process_group: the group DCP coordinates the save over, on its upload thread. Give one used for
        nothing else where the loop runs collectives meanwhile: two threads' collectives on one gloo group
        may interleave in a different order on different ranks. Default: torch's default group.
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        concurrency: int = 8,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._env, self._concurrency = env, concurrency
        self.process_group = process_group
        """The group the next save coordinates over (`process_group` above)."""
        accelerated = torch.accelerator.is_available()  # pinned host memory and a copy stream: on a GPU only
        options = StagingOptions(
            use_pinned_memory=accelerated, use_shared_memory=False, use_async_staging=True,
            use_non_blocking_copy=accelerated,
        )  # fmt: skip
        self._stager = DefaultStager(options)
        self._last: AsyncSaveResponse | None = None

    def save(self, state_dict: dict[str, Any], uri: str) -> None:
        """Begin saving `state_dict` (every rank its own shards) as the checkpoint at `uri`; the previous save's
        upload waited for first (its error raised here)."""
        self.wait()
        writer = storage_writer(uri, env=self._env, concurrency=self._concurrency)
        response = async_save(
            state_dict, storage_writer=writer, process_group=self.process_group, async_stager=self._stager
        )
        if not isinstance(response, AsyncSaveResponse):  # (asynchronous staging always answers with one)
            raise TypeError(f"async_save answered {type(response).__name__}, not an AsyncSaveResponse")
        self._last = response

    def staged(self) -> None:
        """Wait until the last save's copy to host memory is done: from then on the state may change."""
        if self._last is not None:
            self._last.staging_completion.result()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the last save to commit; raise what stopped it (CheckpointConflict, a storage error), once.
        TimeoutError where it is still uploading after `timeout` seconds (it is then still the last save)."""
        if self._last is None:
            return
        done, _ = futures_wait([self._last.upload_completion], timeout)
        if not done:
            raise TimeoutError(f"the checkpoint save still uploading after {timeout} s")
        last, self._last = self._last, None
        last.upload_completion.result()

    def close(self) -> None:
        """Wait for the last save, then free the host buffer and the copying thread."""
        try:
            self.wait()
        finally:
            self._stager.close()


class _Checkpoints:
    """The checkpoints directly under `az://container/prefix`: each folder's blobs, listed once, and
    whether its metadata is written (it committed)."""

    def __init__(self, uri: str, env: Mapping[str, str] | None) -> None:
        self.name, prefix = _split(uri)
        self.container = blob_container(self.name, env)
        self.base = f"{prefix}/" if prefix else ""
        self.folders: dict[str, list[str]] = {}
        for blob in self.container.list_blobs(name_starts_with=self.base):
            folder, _, rest = str(blob.name)[len(self.base) :].partition("/")
            if rest:
                self.folders.setdefault(folder, []).append(str(blob.name))

    def committed(self) -> list[str]:
        """The committed folders, sorted."""
        return sorted(folder for folder, blobs in self.folders.items() if self._metadata(folder) in blobs)

    def uri(self, folder: str) -> str:
        return f"az://{self.name}/{self.base}{folder}"

    def _metadata(self, folder: str) -> str:
        return f"{self.base}{folder}/{METADATA}"

    def delete(self, folder: str) -> None:
        """A checkpoint's blobs, its metadata first: a reader never meets a committed one with shards missing."""
        for blob_name in sorted(self.folders.pop(folder), key=lambda blob_name: blob_name != self._metadata(folder)):
            self.container.delete_blob(blob_name)


def committed(uri: str, *, env: Mapping[str, str] | None = None) -> list[str]:
    """The committed checkpoints directly under `az://container/prefix` (their prefixes, as URIs, sorted):
    those whose metadata is written. A torn one's shards are left out."""
    checkpoints = _Checkpoints(uri, env)
    return [checkpoints.uri(folder) for folder in checkpoints.committed()]


def folders(uri: str, *, env: Mapping[str, str] | None = None) -> dict[str, bool]:
    """Every checkpoint folder directly under `az://container/prefix`, and whether it committed."""
    checkpoints = _Checkpoints(uri, env)
    done = set(checkpoints.committed())
    return {folder: folder in done for folder in sorted(checkpoints.folders)}


def prune(uri: str, *, keep: int, env: Mapping[str, str] | None = None) -> list[str]:
    """Delete, under `az://container/prefix`, every committed checkpoint but the newest `keep` and every
    torn one older than the newest committed (module docstring); the deleted checkpoints' URIs."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least the newest checkpoint stays")
    checkpoints = _Checkpoints(uri, env)
    done = checkpoints.committed()
    if not done:
        return []
    kept, newest = set(done[-keep:]), done[-1]
    going = [folder for folder in sorted(checkpoints.folders) if folder not in kept and folder < newest]
    for folder in going:
        checkpoints.delete(folder)
    return [checkpoints.uri(folder) for folder in going]
