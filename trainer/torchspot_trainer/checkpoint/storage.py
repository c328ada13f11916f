"""Checkpoint storage: a local folder or an Azure Blob container, behind one Protocol.

The checkpoint manager needs whole-object put/get, a listing, a prefix delete, and two
conditional writes (create-only, and replace-if-unchanged: what keeps two writers of one
prefix from undoing each other), nothing more, so both backends stay small and a test can
reason about every call.
Names are `/`-separated strings relative to the checkpoint root (a Blob name is not
a path, and `Path` would mangle it).

URIs:
- `file:///abs/path` or a plain path: a local (or mounted) folder;
- `az://container/prefix`: Azure Blob. The account comes from the environment:
  `AZURE_STORAGE_CONNECTION_STRING` (a connection string, e.g. from a Kubernetes
  Secret), or `AZURE_STORAGE_ACCOUNT_URL` with `AZURE_STORAGE_SAS_TOKEN`, or
  `AZURE_STORAGE_ACCOUNT_URL` alone with `DefaultAzureCredential` (workload identity).
  `AZURE_STORAGE_ACCOUNT` (a name) may stand in for the URL. Secrets are never logged:
  `describe()` shows only the account URL and the container.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse


class ObjectNotFoundError(KeyError):
    """The named object does not exist."""


class StorageError(Exception):
    """The storage could not be reached or refused the request (retry may help)."""


class CheckpointStorage(Protocol):
    """Whole-object storage under one root."""

    def describe(self) -> str:
        """Where the objects live, for logs and status (never includes a secret)."""
        ...

    def put(self, name: str, data: bytes) -> None:
        """Write an object; a reader sees either the old object or the whole new one."""
        ...

    def get(self, name: str) -> bytes:
        """Read an object; raise ObjectNotFoundError if absent."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Names of all objects under `prefix`, sorted."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under `prefix`."""
        ...

    def put_new(self, name: str, data: bytes) -> bool:
        """Write an object only where none of that name exists, in one step; whether it wrote it."""
        ...

    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """An object and its version (changed by every write of it), or None if absent."""
        ...

    def put_if(self, name: str, data: bytes, version: str | None) -> bool:
        """Write an object only if it is still at `version` (None: still absent), in one step; whether
        it wrote it."""
        ...


class LocalStorage:
    """A folder. Each put writes a temporary file and renames it over the target."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def describe(self) -> str:
        """See CheckpointStorage."""
        return f"file://{self.root}"

    def put(self, name: str, data: bytes) -> None:
        """See CheckpointStorage."""
        tmp = self._written_aside(name, data)
        try:
            os.replace(tmp, self.root / name)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"{self.describe()}: cannot write {name}: {exc}") from exc

    def get(self, name: str) -> bytes:
        """See CheckpointStorage."""
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFoundError(name) from None
        except OSError as exc:
            raise StorageError(f"{self.describe()}: cannot read {name}: {exc}") from exc

    def list(self, prefix: str = "") -> list[str]:
        """See CheckpointStorage."""
        if not self.root.exists():
            return []
        names = (
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )
        return sorted(n for n in names if n.startswith(prefix))

    def delete_prefix(self, prefix: str) -> None:
        """See CheckpointStorage."""
        for name in self.list(prefix):
            (self.root / name).unlink(missing_ok=True)
        folder = self.root / prefix.rstrip("/")
        if prefix and folder.is_dir():
            for sub in sorted(folder.rglob("*"), reverse=True):
                if sub.is_dir():
                    sub.rmdir()
            if not any(folder.iterdir()):
                folder.rmdir()

    def put_new(self, name: str, data: bytes) -> bool:
        """See CheckpointStorage: the whole file is written aside, then linked in, which fails where the
        name exists."""
        target = self.root / name
        tmp = self._written_aside(name, data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        except OSError as exc:
            raise StorageError(f"{self.describe()}: cannot write {name}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """See CheckpointStorage: the version is the file's inode and modification time (a write
        replaces the file)."""
        try:
            with (self.root / name).open("rb") as source:
                stat = os.fstat(source.fileno())
                return source.read(), f"{stat.st_ino}-{stat.st_mtime_ns}"
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"{self.describe()}: cannot read {name}: {exc}") from exc

    def put_if(self, name: str, data: bytes, version: str | None) -> bool:
        """See CheckpointStorage: the version is compared and the file replaced under an exclusive lock
        on a file beside it, which every conditional writer of the folder takes."""
        target = self.root / name
        tmp = self._written_aside(name, data)
        try:
            with (target.parent / f".{target.name}.lock").open("a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                current = self.read_versioned(name)
                if (None if current is None else current[1]) != version:
                    return False
                os.replace(tmp, target)
                return True
        except OSError as exc:
            raise StorageError(f"{self.describe()}: cannot write {name}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)

    def _written_aside(self, name: str, data: bytes) -> Path:
        """`data` in a new file beside `name`'s, synced: a hidden name that listings leave out."""
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            with tmp.open("wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"{self.describe()}: cannot write {name}: {exc}") from exc
        return tmp


class BlobStorage:
    """A prefix in an Azure Blob container (azure-storage-blob).

    :param container: an `azure.storage.blob.ContainerClient`.
    :param prefix: the "folder" inside the container, without a leading slash.
    """

    def __init__(self, container: Any, prefix: str) -> None:
        self._container = container
        self._prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    def describe(self) -> str:
        """See CheckpointStorage (the account URL and container, no credential)."""
        # With a SAS credential the client's URL carries the token as its query string.
        base = str(self._container.url).split("?", 1)[0]
        return f"{base}/{self._prefix}"

    def _errors(self) -> tuple[type[BaseException], ...]:
        from azure.core.exceptions import AzureError  # noqa: PLC0415 - optional dependency

        return (AzureError,)

    def put(self, name: str, data: bytes) -> None:
        """See CheckpointStorage. A blob upload commits all of its blocks at once."""
        try:
            self._container.upload_blob(self._prefix + name, data, overwrite=True)
        except self._errors() as exc:
            raise StorageError(f"{self.describe()}: cannot write {name}: {type(exc).__name__}") from exc

    def get(self, name: str) -> bytes:
        """See CheckpointStorage."""
        from azure.core.exceptions import ResourceNotFoundError  # noqa: PLC0415

        try:
            data: bytes = self._container.download_blob(self._prefix + name).readall()
        except ResourceNotFoundError:
            raise ObjectNotFoundError(name) from None
        except self._errors() as exc:
            raise StorageError(f"{self.describe()}: cannot read {name}: {type(exc).__name__}") from exc
        return data

    def list(self, prefix: str = "") -> list[str]:
        """See CheckpointStorage."""
        try:
            blobs = self._container.list_blobs(name_starts_with=self._prefix + prefix)
            return sorted(b.name[len(self._prefix) :] for b in blobs)
        except self._errors() as exc:
            raise StorageError(f"{self.describe()}: cannot list: {type(exc).__name__}") from exc

    def delete_prefix(self, prefix: str) -> None:
        """See CheckpointStorage."""
        for name in self.list(prefix):
            try:
                self._container.delete_blob(self._prefix + name)
            except self._errors() as exc:
                raise StorageError(f"{self.describe()}: cannot delete {name}: {type(exc).__name__}") from exc

    def put_new(self, name: str, data: bytes) -> bool:
        """See CheckpointStorage: an upload that refuses to overwrite (If-None-Match: *)."""
        return self.put_if(name, data, None)

    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """See CheckpointStorage: the version is the blob's ETag."""
        from azure.core.exceptions import ResourceNotFoundError  # noqa: PLC0415

        try:
            download = self._container.download_blob(self._prefix + name)
            return download.readall(), str(download.properties.etag)
        except ResourceNotFoundError:
            return None
        except self._errors() as exc:
            raise StorageError(f"{self.describe()}: cannot read {name}: {type(exc).__name__}") from exc

    def put_if(self, name: str, data: bytes, version: str | None) -> bool:
        """See CheckpointStorage: an upload conditional on the ETag (If-Match), or on there being no blob
        (If-None-Match: *)."""
        from azure.core import MatchConditions  # noqa: PLC0415
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError  # noqa: PLC0415

        condition: dict[str, Any] = (
            {"overwrite": False}
            if version is None
            else {"etag": version, "match_condition": MatchConditions.IfNotModified}
        )
        try:
            self._container.upload_blob(self._prefix + name, data, **condition)
        except (ResourceExistsError, ResourceModifiedError):
            return False
        except self._errors() as exc:
            raise StorageError(f"{self.describe()}: cannot write {name}: {type(exc).__name__}") from exc
        return True


SDK_RETRY_BACKOFF = 0.5
"""Base seconds of the Blob SDK's own retry of a failed request (its policy adds 2**n and
+-0.5 s of jitter: about 2.5 s before the first retry). The SDK's default waits
15 +- 3 s, which hid under the checkpoint writer's backoff and made one failed save
of a small state take 35 s during an outage (measured against a stopped Azurite)."""


def _blob_container(container: str, env: Mapping[str, str], *, retries: int, timeout: float) -> Any:
    from azure.storage.blob import BlobServiceClient, ExponentialRetry  # noqa: PLC0415 - optional dependency

    options: dict[str, Any] = {
        "retry_policy": ExponentialRetry(
            initial_backoff=SDK_RETRY_BACKOFF,  # type: ignore[arg-type]  # annotated int, used as float
            increment_base=2,
            retry_total=retries,
            random_jitter_range=SDK_RETRY_BACKOFF,  # type: ignore[arg-type]
        ),
        "connection_timeout": timeout,
        "read_timeout": timeout,
    }
    if conn := env.get("AZURE_STORAGE_CONNECTION_STRING"):
        service = BlobServiceClient.from_connection_string(conn, **options)
    else:
        url = env.get("AZURE_STORAGE_ACCOUNT_URL") or (
            f"https://{env['AZURE_STORAGE_ACCOUNT']}.blob.core.windows.net"
            if env.get("AZURE_STORAGE_ACCOUNT")
            else None
        )
        if url is None:
            raise ValueError(
                "--checkpoint-uri az://...: set AZURE_STORAGE_CONNECTION_STRING, or "
                "AZURE_STORAGE_ACCOUNT_URL (or AZURE_STORAGE_ACCOUNT) with a SAS token "
                "or workload identity"
            )
        credential: Any
        if sas := env.get("AZURE_STORAGE_SAS_TOKEN"):
            credential = sas
        else:
            from azure.identity import DefaultAzureCredential  # noqa: PLC0415

            credential = DefaultAzureCredential()
        service = BlobServiceClient(url, credential=credential, **options)
    return service.get_container_client(container)


def blob_container(
    name: str, env: Mapping[str, str] | None = None, *, retries: int = 3, timeout: float = 30.0, create: bool = True
) -> Any:
    """The client of the Blob container `name`, the account and credentials from `env` (module docstring;
    default os.environ), the container made where it is missing (`create`)."""
    container = _blob_container(name, os.environ if env is None else env, retries=retries, timeout=timeout)
    if create:
        from azure.core.exceptions import ResourceExistsError  # noqa: PLC0415

        with contextlib.suppress(ResourceExistsError):
            container.create_container()
    return container


def quiet_sdk_logs() -> None:
    """Keep the Azure SDK's per-request INFO logs (every header of every block upload) out of our logs."""
    logging.getLogger("azure").setLevel(logging.WARNING)


def local_path(uri: str) -> Path | None:
    """The folder a `--checkpoint-uri` names (a path, or file://), or None for Blob (az://CONTAINER/PREFIX).
    Pure. ValueError for anything else, naming it."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme == "file" else uri
        if not path:
            raise ValueError(f"--checkpoint-uri {uri!r}: no path")
        return Path(path)
    if parsed.scheme == "az":
        if not parsed.netloc:
            raise ValueError(f"--checkpoint-uri {uri!r}: expected az://CONTAINER/PREFIX")
        return None
    raise ValueError(f"--checkpoint-uri {uri!r}: unknown scheme {parsed.scheme!r} (use a path, file:// or az://)")


def open_storage(
    uri: str,
    env: Mapping[str, str] | None = None,
    *,
    retries: int = 1,
    timeout: float = 10.0,
    create_container: bool = True,
) -> CheckpointStorage:
    """Open the storage a `--checkpoint-uri` names.

    :param retries: the Azure SDK's own retries per request; the checkpoint manager
        retries whole saves with its own backoff, so this stays small.
    :param timeout: seconds to connect or read before a request counts as failed.
    :param create_container: create the Blob container if it does not exist.
    """
    env = os.environ if env is None else env
    path = local_path(uri)
    if path is not None:
        return LocalStorage(path)
    parsed = urlparse(uri)
    container = blob_container(parsed.netloc, env, retries=retries, timeout=timeout, create=create_container)
    return BlobStorage(container, parsed.path)
