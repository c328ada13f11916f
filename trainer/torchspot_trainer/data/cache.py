"""Where a node keeps its data: the data cache (an az:// data set's copy and the image folders' file
indexes, kept across restarts), and a data set as a local path."""

from __future__ import annotations

import tempfile
from pathlib import Path


def data_cache(folder: str) -> Path:
    """The node's data folder (`--data-cache`, else one under the system's temporary folder): the pod's, or
    the node's where it is a hostPath."""
    return Path(folder) if folder else Path(tempfile.gettempdir()) / "torchspot-data"


def index_cache(folder: str) -> Path:
    """Where the node keeps its image folders' file indexes (datasets.node_index): in the data cache."""
    return data_cache(folder) / "index"


def ensure_local_data(data: str, folder: str) -> Path:
    """The data set `data` as a local path, an az:// prefix copied to the data cache `folder` first (the
    copy's module, and the Blob SDK it loads, only then)."""
    if data.startswith("az://"):
        from torchspot_trainer.data.fetch import fetch_prefix  # noqa: PLC0415

        return fetch_prefix(data, data_cache(folder))
    return Path(data.removeprefix("file://"))
