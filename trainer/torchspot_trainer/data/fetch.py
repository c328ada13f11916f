"""A data set under a Blob prefix (`az://container/prefix`, or a folder) copied to the node's disk,
once per node whatever its number of local ranks."""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from torchspot_trainer.checkpoint.storage import CheckpointStorage, open_storage
from torchspot_trainer.data.prepare import MANIFEST, unpack

FETCH_THREADS = 16
"""Objects downloaded at once. One GET at a time spends most of each in round trips (a data set
of small files is latency-bound): 16 in flight keep a node's network busy without crowding the
storage account's per-client limits."""
PROGRESS_EVERY = 1000
"""Objects between two progress reports of a copy."""
UNPACKED = ".unpacked"
"""Folder of the cache whose empty files mark the shards already unpacked (an interrupted copy
resumes from the first shard without one; a shard's images are rewritten whole)."""


def fetch_prefix(
    uri: str,
    cache: Path,
    env: Mapping[str, str] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Copy every object under `uri` (az://container/prefix or a folder) into `cache`, once per node.

    The local ranks of a node all call this at start-up (and the node's agent before it joins the
    rendezvous: `data/stage.py`): the first takes the cache's lock and copies, the others wait for
    the lock and then find the copy complete (a marker named after `uri`), so a data set is fetched
    once per node and no two processes write the same file. Objects already in the cache are not
    fetched again (an interrupted copy resumes); each is written to a temporary name and renamed,
    so an interrupted copy never looks complete. `FETCH_THREADS` objects are fetched at once;
    `progress(done, total)` is called every `PROGRESS_EVERY` objects and at the end. A prepared
    data set (`prepare.py`'s manifest at the prefix's root) has its shards unpacked into the
    folder layout the trainer reads, each marked done once unpacked.
    """
    cache.mkdir(parents=True, exist_ok=True)
    marker = cache / f".complete-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"
    with open(cache / ".torchspot-fetch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its holder dies
        if marker.exists():
            return cache
        storage = open_storage(uri, env, create_container=False)
        names = storage.list()
        shards = MANIFEST in names  # a prepared data set (prepare.py): its shards are unpacked
        missing = [name for name in names if not _done(cache, name, shards).exists()]
        fetch = partial(_fetch, storage, cache=cache, shards=shards)
        with ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="fetch") as pool:
            for done, _ in enumerate(pool.map(fetch, missing), start=1):
                if progress is not None and (done % PROGRESS_EVERY == 0 or done == len(missing)):
                    progress(done, len(missing))
        marker.write_text(f"{uri}\n{len(missing)} objects fetched\n")
    return cache


def _done(cache: Path, name: str, shards: bool) -> Path:
    """What exists once object `name` is in the cache: the file, or a shard's unpacked marker."""
    if shards and name.endswith(".tar"):
        return cache / UNPACKED / name
    return cache / name


def _fetch(storage: CheckpointStorage, name: str, *, cache: Path, shards: bool) -> None:
    body = storage.get(name)
    done = _done(cache, name, shards)
    done.parent.mkdir(parents=True, exist_ok=True)
    if done != cache / name:  # a shard: its images into its split's folder, then the marker
        unpack(body, (cache / name).parent)
        done.touch()
        return
    tmp = done.with_name(f".{done.name}.partial")
    tmp.write_bytes(body)
    tmp.replace(done)
