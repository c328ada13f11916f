"""A data set under a Blob prefix (`az://container/prefix`, or a folder) copied to the node's disk,
once per node whatever its number of local ranks."""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Mapping
from pathlib import Path

from torchspot_trainer.checkpoint.storage import open_storage


def fetch_prefix(uri: str, cache: Path, env: Mapping[str, str] | None = None) -> Path:
    """Copy every object under `uri` (az://container/prefix or a folder) into `cache`, once per node.

    The local ranks of a node all call this at start-up: the first takes the cache's lock and
    copies, the others wait for the lock and then find the copy complete (a marker named after
    `uri`), so a data set is fetched once per node and no two processes write the same file.
    Objects already in the cache are not fetched again (an interrupted copy resumes); each is
    written to a temporary name and renamed, so an interrupted copy never looks complete.
    """
    cache.mkdir(parents=True, exist_ok=True)
    marker = cache / f".complete-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"
    with open(cache / ".torchspot-fetch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its holder dies
        if marker.exists():
            return cache
        storage = open_storage(uri, env, create_container=False)
        fetched = 0
        for name in storage.list():
            target = cache / name
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.partial")
            tmp.write_bytes(storage.get(name))
            tmp.replace(target)
            fetched += 1
        marker.write_text(f"{uri}\n{fetched} objects fetched\n")
    return cache
