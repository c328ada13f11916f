"""Sharded checkpoints to Blob: our DCP writer against DCP through fsspec/adlfs and against torch.save from
rank 0, in the same run, on a real Azurite.

Each trial is `--ranks` gloo processes (worker.py) saving `--mib` MiB of float32 state: as DTensors sharded
over the ranks for the two DCP writers (each rank writes its own part), whole on rank 0 for `torch-save`
(a DDP script's checkpoint: rank 0 serialises everything into memory and uploads it, the SDK staging 8
blocks at a time). `ours-async` is our writer through `AsyncSaver` (DCP's `async_save`, the copy to host
memory on a thread). Each trial saves twice and times the second (the first pays the one-time costs:
connections, the host buffer). Methods are interleaved, their order turned each repetition. Per trial:
seconds to a committed checkpoint (every rank's save returned), MiB/s per writing rank (its part over
those seconds), for `ours-async` the caller's stall (until `save` returned) and when the copy was staged
(from then on the loop may update), and the host memory a rank held above its state at the peak of both
saves (sampled every 5 ms).

Azurite on this machine shares the cores with the ranks, and its own CPU bounds what a loopback upload
reaches, whatever the writer. `--pace` puts a relay between the ranks and Azurite that carries each
connection at most that many MB/s, as a network path does where one connection's throughput is bounded
(latency, window), so that the writers' difference in parallel uploads shows: an emulated link, not Azure.

Usage: python bench/dcp/run.py [--mib 1024] [--ranks 1 2 4] [--reps 3] [--pace 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.record

from bench import record
from bench.dcp.worker import CONTAINER
from torchspot_lab.azurite import Azurite
from torchspot_lab.etcd import free_port
from torchspot_trainer.checkpoint.storage import blob_container

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("worker.py")
METHODS = ("ours", "ours-async", "adlfs", "torch-save")
CHUNK = 64 << 10


class PacedRelay:
    """A TCP relay on loopback to `port` that carries each connection's upload at most `mb_per_s` MB/s (the
    replies unpaced): the emulated link of the module docstring. Runs its own event loop on a thread."""

    def __init__(self, port: int, mb_per_s: float) -> None:
        self.target, self.rate = port, mb_per_s * 1e6
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", self.port))
        ready.set()
        self._loop.run_forever()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target)
        await asyncio.gather(
            self._pipe(reader, upstream_writer, paced=True), self._pipe(upstream_reader, writer, paced=False)
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, paced: bool) -> None:
        started, sent = time.monotonic(), 0
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
                sent += len(data)
                if paced and (ahead := sent / self.rate - (time.monotonic() - started)) > 0:
                    await asyncio.sleep(ahead)
        except ConnectionError:
            pass
        finally:
            writer.close()


def trial(env: dict[str, str], method: str, ranks: int, mib: int) -> list[dict[str, Any]]:
    """One save by `ranks` processes; each rank's JSON line."""
    uri = f"az://{CONTAINER}/{method}-{ranks}-{uuid.uuid4().hex[:8]}"
    port = free_port()
    common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks),
              "PYTHONPATH": os.pathsep.join(str(ROOT / part) for part in ("trainer", "lab", "."))}  # fmt: skip
    command = [sys.executable, str(WORKER), "--method", method, "--mib", str(mib), "--uri", uri]
    processes = [
        subprocess.Popen(
            command, env={**common, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank in range(ranks)
    ]
    lines = []
    for process in processes:
        out, err = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise SystemExit(f"{method} at {ranks} ranks: exit {process.returncode}\n{err[-3000:]}")
        lines.append(json.loads(out.strip().splitlines()[-1]))
    container = blob_container(CONTAINER, env)
    for blob in container.list_blobs(name_starts_with=uri.removeprefix(f"az://{CONTAINER}/")):
        container.delete_blob(blob.name)
    return lines


def summarise(rows: list[dict[str, Any]], mib: int) -> list[str]:
    """One table line per ranks and method: medians over the repetitions."""
    out = []
    for ranks in sorted({row["ranks"] for row in rows}):
        medians: dict[str, float] = {}
        for method in METHODS:
            found = [row for row in rows if row["ranks"] == ranks and row["method"] == method]
            if not found:
                continue
            seconds = statistics.median(row["seconds"] for row in found)
            medians[method] = seconds
            writers = 1 if method == "torch-save" else ranks
            per_rank = mib / writers / seconds
            memory = max(row["extra_mib"] for row in found)
            stall = [row["stall_s"] for row in found if row.get("stall_s") is not None]
            staged = [row["staged_s"] for row in found if row.get("staged_s") is not None]
            stalled = (f", stall {statistics.median(stall):.3f} s, staged after {statistics.median(staged):.2f} s"
                       if stall else "")  # fmt: skip
            out.append(f"  {ranks} ranks {method:10}: {seconds:6.2f} s ({min(r['seconds'] for r in found):.2f}-"
                       f"{max(r['seconds'] for r in found):.2f}), {per_rank:6.1f} MiB/s per writing rank, "
                       f"host memory above the state up to {memory:.0f} MiB{stalled}")  # fmt: skip
        if "ours" in medians:
            for other in ("adlfs", "torch-save"):
                if other in medians:
                    out.append(f"  {ranks} ranks: ours {medians[other] / medians['ours']:.2f}x as fast as {other}")
            if "ours-async" in medians:
                stalls = [row["stall_s"] for row in rows if row["ranks"] == ranks and row["method"] == "ours-async"]
                out.append(f"  {ranks} ranks: the async stall is {statistics.median(stalls) / medians['ours']:.1%} "
                           "of a synchronous save")  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="the state's size (a multiple of 64)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--pace", type=float, default=0.0, help="MB/s per connection through a relay (0: none)")
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/dcp/...)")
    args = parser.parse_args()
    if args.mib % 64 or any(4 % ranks for ranks in args.ranks):
        raise SystemExit("--mib must be a multiple of 64, and --ranks among 1, 2 and 4")
    rows: list[dict[str, Any]] = []
    recording = record.Run("dcp", args.out)
    with tempfile.TemporaryDirectory(prefix="torchspot-bench-dcp-") as tmp, Azurite(Path(tmp) / "azurite") as azurite:
        env = {**os.environ, **azurite.env()}
        if args.pace:
            relay = PacedRelay(azurite.port, args.pace)
            env["AZURE_STORAGE_CONNECTION_STRING"] = azurite.connection_string.replace(
                f":{azurite.port}/", f":{relay.port}/"
            )
        for rep in range(args.reps):
            for ranks in args.ranks:
                methods = args.methods[rep % len(args.methods) :] + args.methods[: rep % len(args.methods)]
                for method in methods:
                    lines = trial(env, method, ranks, args.mib)
                    row = {
                        "method": method, "ranks": ranks, "seconds": max(line["seconds"] for line in lines),
                        "stall_s": max((line["stall_s"] for line in lines if "stall_s" in line), default=None),
                        "staged_s": max((line["staged_s"] for line in lines if "staged_s" in line), default=None),
                        "extra_mib": max(line["extra_mib"] for line in lines),
                        "held_mib": max(line["held_mib"] for line in lines),
                    }  # fmt: skip
                    rows.append(row)
                    print(f"[{rep + 1}/{args.reps}] {ranks} ranks {method:10} {row['seconds']:6.2f} s, "
                          f"+{row['extra_mib']:.0f} MiB", flush=True)  # fmt: skip
    table = summarise(rows, args.mib)
    print(f"\n{args.mib} MiB of state to Azurite" + (f" through a relay of {args.pace:g} MB/s per connection" if
          args.pace else " on loopback") + ": medians (min-max)")  # fmt: skip
    print("\n".join(table))
    recording.write(rows, summary=table)


if __name__ == "__main__":
    main()
