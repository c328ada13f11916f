"""One rank of a `bench/dcp` trial: build this rank's part of the state, save it one way, print one JSON line.

Run by run.py, `--ranks` processes at once, with torch's env:// variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and Azurite's connection string in AZURE_STORAGE_CONNECTION_STRING.

The state: `--mib` MiB of float32 in tensors of TENSOR_ROWS x 1024 (4 MiB a row block), each a DTensor
sharded by rows over the ranks (as FSDP2 keeps parameters), except for `torch-save`, where rank 0 holds
every tensor whole (as DDP does) and the others nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import threading
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from torchspot_trainer.checkpoint.dcp import AsyncSaver, BlobWriter
from torchspot_trainer.checkpoint.storage import blob_container

COLUMNS = 1024
TENSOR_ROWS = 16384
"""Rows of one tensor (64 MiB of float32): divisible by 1, 2 and 4 ranks."""
CONTAINER = "bench"


class PeakRss:
    """This process's resident memory above its level at the start, sampled every 5 ms on a thread: the host
    memory a save holds beyond the state itself."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.base = self._process.memory_info().rss
        self.peak = self.base
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def stop(self) -> float:
        """MiB above the start's level at the peak."""
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        return (self.peak - self.base) / 2**20


def sharded_state(mib: int, rank: int, world: int) -> dict[str, Any]:
    """This rank's rows of every tensor, as DTensors over a 1-D mesh of the ranks."""
    mesh = init_device_mesh("cpu", (world,))
    rows = TENSOR_ROWS // world
    generator = torch.Generator().manual_seed(rank)
    state: dict[str, Any] = {}
    for index in range(mib // 64):
        local = torch.randn(rows, COLUMNS, generator=generator)
        state[f"layer{index}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return state


def whole_state(mib: int) -> dict[str, torch.Tensor]:
    """Every tensor whole (rank 0's state under DDP)."""
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{index}.weight": torch.randn(TENSOR_ROWS, COLUMNS, generator=generator) for index in range(mib // 64)
    }


def writer(method: str, uri: str, env: dict[str, str]) -> StorageWriter:
    """DCP's storage writer of `method` for the checkpoint at `uri` (az://bench/PREFIX): ours, or DCP's fsspec
    writer on adlfs with adlfs's defaults (sync_files off: it would sync this machine's disks, not Blob)."""
    if method == "ours":
        return BlobWriter(uri, env=env)
    return FsspecWriter(uri, sync_files=False, connection_string=env["AZURE_STORAGE_CONNECTION_STRING"])


def torch_save(state: dict[str, torch.Tensor], uri: str, env: dict[str, str]) -> int:
    """A plain script's checkpoint: torch.save into memory, then one upload by the Azure SDK (the same
    parallel block upload ours has: 8 at a time). Returns the bytes written."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    name = uri.removeprefix(f"az://{CONTAINER}/") + "/checkpoint.pt"
    data = buffer.getvalue()
    blob_container(CONTAINER, env).upload_blob(name, data, overwrite=True, max_concurrency=8)
    return len(data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True, choices=["ours", "ours-async", "adlfs", "torch-save"])
    parser.add_argument("--mib", type=int, required=True)
    parser.add_argument("--uri", required=True)
    args = parser.parse_args()
    env = dict(os.environ)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.method == "torch-save":
        state: dict[str, Any] = whole_state(args.mib) if rank == 0 else {}
    else:
        state = sharded_state(args.mib, rank, world)
    held = sum((value.to_local() if isinstance(value, DTensor) else value).nbytes for value in state.values())
    result: dict[str, Any] = {"method": args.method, "rank": rank, "world": world, "held_mib": held / 2**20}
    memory = PeakRss()  # over both saves: the host buffer `ours-async` keeps from the first counts
    saver = AsyncSaver(env=env) if args.method == "ours-async" else None
    for attempt in ("warm", "timed"):  # the first save pays the one-time costs (connections, buffers)
        uri = f"{args.uri}-{attempt}"
        dist.barrier()
        started = time.perf_counter()
        if args.method == "torch-save":
            if rank == 0:
                torch_save(state, uri, env)
        elif saver is not None:
            saver.save(state, uri)
            result["stall_s"] = time.perf_counter() - started
            saver.staged()
            result["staged_s"] = time.perf_counter() - started
            saver.wait()
        else:
            save(state, storage_writer=writer(args.method, uri, env))
        result["own_s"] = time.perf_counter() - started
        dist.barrier()  # (every rank's part written: the checkpoint committed)
        result["seconds"] = time.perf_counter() - started
    result["extra_mib"] = memory.stop()
    if saver is not None:
        saver.close()
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
