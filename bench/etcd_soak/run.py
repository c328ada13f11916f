"""A day of one job's rendezvous traffic against two real etcds: the managed etcd's flags and etcd's defaults.

What a job writes: every agent rewrites the rendezvous state (torch's pickled
`_RendezvousState`, here a real one with the job's participants and heartbeats) once per
heartbeat interval, and each membership change (an eviction, a replacement joining)
rewrites it with a different set of nodes. A day of an 8-node job at a 1 s heartbeat is
8 x 86,400 = 691,200 writes; they are issued as fast as the two etcds take them (side by
side, the same writes to both), so a day takes minutes here. etcd's auto-compaction runs
on its own wall clock, which a compressed day outruns, so the benchmark compacts the
managed-flags etcd on the day's simulated clock exactly as `--auto-compaction-mode=periodic
--auto-compaction-retention=5m` would (every 5 simulated minutes, keeping the last 5
minutes of history); etcd's defaults never compact. Snapshots and WAL purges count
writes (`--snapshot-count`, `--max-wals`), so they are measured as they are.

Each etcd's data directory is what lives in the pod's memory volume (an emptyDir with
`medium: Memory` counts against the container's memory limit), so the figures are the
data directory's size (backend and WAL), the backend's size and the server's resident
memory, sampled through the run. Usage:

    python bench/etcd_soak/run.py [--nodes 8] [--hours 24] [--heartbeat 1] [--churn-minutes 10]
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import pickle
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from torchspot_lab.etcd import EtcdServer  # noqa: E402
from torchspot_operator.builders import ETCD_SIZING  # noqa: E402
from torchspot_trainer.rendezvous.etcd_client import EtcdClient  # noqa: E402


def state_payload(nodes: int, round_: int, now: float) -> bytes:
    """torch's rendezvous state for `nodes` participants, pickled and base64'd as its etcd backends store it."""
    state = _RendezvousState()
    state.round = round_
    state.complete = True
    state.deadline = None
    for rank in range(nodes):
        node = _NodeDesc(f"10.0.{rank // 250}.{rank % 250}-worker-{rank}.default.pod", 1000 + rank, 0)
        state.participants[node] = rank
        state.last_heartbeats[node] = datetime.fromtimestamp(now)
    return base64.b64encode(pickle.dumps(state))


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Soaked:
    """One etcd under the workload, and its samples."""

    def __init__(self, name: str, folder: Path, flags: tuple[str, ...]) -> None:
        self.name = name
        self.server = EtcdServer(folder / name / "data", log_path=folder / name / "etcd.log", extra_flags=flags)
        self.server.start()
        self.client: EtcdClient = self.server.client()
        self.process = psutil.Process(self.server.pid)
        self.samples: list[dict[str, float]] = []

    def metrics(self) -> dict[str, float]:
        """etcd's own gauges, from its /metrics."""
        return self.server.gauges(("etcd_mvcc_db_total_size_in_bytes", "etcd_mvcc_db_total_size_in_use_in_bytes"))

    def sample(self, written: int) -> None:
        status = self.metrics()
        self.samples.append({
            "writes": written,
            "data_dir_mib": folder_bytes(self.server.data_dir) / 2**20,
            "wal_mib": folder_bytes(self.server.data_dir / "member" / "wal") / 2**20,
            "db_mib": status["etcd_mvcc_db_total_size_in_bytes"] / 2**20,
            "db_in_use_mib": status["etcd_mvcc_db_total_size_in_use_in_bytes"] / 2**20,
            "rss_mib": self.process.memory_info().rss / 2**20,
        })  # fmt: skip

    def peak(self, key: str) -> float:
        return max(s[key] for s in self.samples)

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--heartbeat", type=float, default=1.0, help="seconds between an agent's state writes")
    parser.add_argument("--churn-minutes", type=float, default=10.0, help="minutes between membership changes")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/etcd_soak/...)")
    args = parser.parse_args(argv)
    recording = record.Run("etcd_soak", args.out)
    writes = int(args.nodes * args.hours * 3600 / args.heartbeat)
    churn_every = max(1, int(args.nodes * args.churn_minutes * 60 / args.heartbeat))
    print(f"{writes:,} state writes ({args.nodes} agents, {args.hours:g} h at one per {args.heartbeat:g} s), "
          f"a membership change every {churn_every:,} writes")  # fmt: skip
    memory = Path("/dev/shm")  # the pod keeps its data in a memory-backed emptyDir: so do we, where we can
    with tempfile.TemporaryDirectory(prefix="etcd-soak-", dir=memory if memory.is_dir() else None) as tmp:
        runs = [Soaked("torchspot", Path(tmp), ETCD_SIZING), Soaked("defaults", Path(tmp), ())]
        key = "/torchspot/rdzv/soak/state"
        round_, members, started = 0, args.nodes, time.monotonic()
        payload = state_payload(members, round_, time.time())
        print(f"state: {len(payload):,} bytes for {members} nodes")
        every = max(1, writes // args.samples)
        pool = concurrent.futures.ThreadPoolExecutor(len(runs))
        five_minutes = max(1, int(args.nodes * 300 / args.heartbeat))  # writes in 5 simulated minutes
        marks: list[int] = []  # our etcd's revision at each 5-minute mark
        try:
            for written in range(1, writes + 1):
                if written % churn_every == 0:  # an eviction, then the replacement: the state changes size
                    round_ += 1
                    members = args.nodes - 1 if members == args.nodes else args.nodes
                    payload = state_payload(members, round_, time.time())
                both = [pool.submit(run.client.put, key, payload, lease=None) for run in runs]
                for done in both:
                    done.result()
                if written % five_minutes == 0:  # the periodic compactor, on the simulated clock
                    found = runs[0].client.get(key)
                    assert found is not None
                    if marks:
                        runs[0].client.compact(marks[-1])
                    marks.append(found.mod_revision)
                if written % every == 0 or written == writes:
                    for run in runs:
                        run.sample(written)
                    ours, theirs = (run.samples[-1]["data_dir_mib"] for run in runs)
                    rate = written / (time.monotonic() - started)
                    print(f"  {written / writes:6.1%}  {rate:7.0f} writes/s  data dir: torchspot {ours:.1f} MiB,"
                          f" defaults {theirs:.1f} MiB", flush=True)  # fmt: skip
            with recording.captured():
                result = report(runs, args, writes)
        finally:
            pool.shutdown()
            for run in runs:
                run.close()
    samples = [{"etcd": run.name, **sample} for run in runs for sample in run.samples]
    recording.write(samples, figures=result)
    return 0


def report(runs: list[Soaked], args: argparse.Namespace, writes: int) -> dict[str, Any]:
    ours, stock = runs
    print(f"\nafter {writes:,} writes (peak over the run):")
    print(f"{'':22}{'torchspot':>12}{'defaults':>12}{'ratio':>8}")
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "writes": writes}
    result["flags"] = ETCD_SIZING
    for key, label in [("data_dir_mib", "data dir MiB"), ("wal_mib", "WAL MiB"), ("db_mib", "backend MiB"),
                       ("db_in_use_mib", "backend in use MiB"), ("rss_mib", "resident MiB")]:  # fmt: skip
        a, b = ours.peak(key), stock.peak(key)
        result[key] = {"torchspot": round(a, 2), "defaults": round(b, 2)}
        print(f"{label:22}{a:12.1f}{b:12.1f}{a / b if b else float('nan'):8.2f}")
    final = {run.name: run.samples[-1] for run in runs}
    result["final"] = final
    result["samples"] = {run.name: run.samples for run in runs}
    return result


if __name__ == "__main__":
    raise SystemExit(main())
