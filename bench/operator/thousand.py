"""A thousand jobs on a thousand nodes: the operator's memory, quiet cost, replacement latency under load
and a takeover, against the kmock emulator with AKS-sized objects.

The world is made before the operator starts, as it stands when an operator restarts or a standby takes
over: `--nodes` AKS GPU spot nodes (bench/operator/fixtures/aks-node.json, about 76 KiB held each) and
`--jobs` running ElasticJobs of `--workers` workers each, with their managed etcd objects and worker
pods as the operator builds them, each pod carrying what a kubelet and the API server add to a real one
(the fixture's container statuses of a trainer and a sidecar, conditions, managedFields). Then:

1. start: an operator process starts and reads it all; the time until it has reconciled every job
   (the sum of its `torchspot_jobs` gauge), the peak request rate it sent the API (sampled each second
   from the emulator's own counts), and its peak memory (VmHWM) once settled;
2. quiet: `--quiet-window` seconds of nothing; requests per job per minute;
3. latency under load (and the peak memory once more after it): `--trials` rounds, each evicting one
   worker of `--busy` jobs at once (a DisruptionTarget, as an eviction leaves it) and then one of a
   probe job; the time from the probe's eviction until its replacement pod exists (p50, p99 over the
   rounds: the issue's measure), and the same for the `--busy` others (the burst); the replacements
   are then started, as a kubelet would;
4. takeover: the operator is stopped and a fresh one started (what a standby does when it resumes:
   kopf lists everything afresh); the time until it has reconciled every job, its peak request rate
   and its peak memory.

Targets (issue 26): peak memory <= 200 MiB, <= 1 request per quiet job per minute, p99 replacement
< 1 s while other jobs reconcile; the request rate is bounded by the client's token bucket
(`kube.API_QPS`), plus kopf's own watch requests. No stock operator runs here (the Go controllers need
a real API server), so the targets are absolute.

Usage: python bench/operator/thousand.py [--jobs 1000] [--workers 8] [--nodes 1000] [--busy 100]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.operator

from bench import record
from bench.operator.run import RESULTS_DIR, peak_rss_mb, wait
from bench.operator.run import job as minimal_job
from torchspot_lab.etcd import free_port
from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.scrape import metric_sum
from torchspot_operator import builders, constants
from torchspot_operator.builders import JobRef
from torchspot_operator.kube import Kube, TokenBucket
from torchspot_operator.metrics import METRICS_PORT_ENV
from torchspot_operator.spec import parse_spec

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NS = "default"
BATCH = 200
"""Creates and patches sent at once while the world is made."""


def _job(name: str, workers: int) -> dict[str, Any]:
    """run.py's minimal job, at 8 processes per node (an 8-GPU node's worker)."""
    body = minimal_job(name, workers)
    body["spec"]["nprocPerNode"] = 8
    return body


def _node(index: int, fixture: dict[str, Any]) -> dict[str, Any]:
    node = copy.deepcopy(fixture)
    name = f"aks-gpuspot-12345678-vmss{index:06x}"
    node["metadata"] = {**node["metadata"], "name": name}
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        node["metadata"].pop(key, None)
    node["metadata"]["labels"] = {**node["metadata"]["labels"], "kubernetes.io/hostname": name}
    return node


def _running(pod: dict[str, Any], node: str, fixture: dict[str, Any]) -> dict[str, Any]:
    """What the scheduler, kubelet and API server add to a pod: its node, a running status with a
    trainer's and a sidecar's container statuses, conditions, managedFields, the fixture's annotations but
    its worker index (every pod would otherwise claim the fixture's, and the operator keeps one pod an
    index: the others would go as surplus)."""
    status = copy.deepcopy(fixture["status"])
    status["containerStatuses"][0]["name"] = "trainer"
    annotations = {
        key: value for key, value in fixture["metadata"]["annotations"].items() if key != constants.ANNOTATION_INDEX
    }
    meta = {
        "managedFields": fixture["metadata"]["managedFields"],
        "annotations": annotations,
    }  # (the pod's index stays)
    return {"metadata": meta, "spec": {"nodeName": node}, "status": status}


class World:
    """The emulated cluster and the benchmark's own client to it (not rate-limited: it plays the cluster)."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self.kube = Kube(server=api.url, headers={}, ssl_context=True, limiter=TokenBucket(1e9, 10**9))

    def run(self, coro: Any) -> Any:
        return self.api.run(coro, timeout=900)

    def many(self, calls: Iterable[Callable[[], Any]]) -> list[Any]:
        """Send calls `BATCH` at a time; their answers in order."""
        pending, done = list(calls), []
        for start in range(0, len(pending), BATCH):
            batch = pending[start : start + BATCH]

            async def together(chunk: list[Callable[[], Any]] = batch) -> list[Any]:
                return list(await asyncio.gather(*(call() for call in chunk)))

            done += self.run(together())
        return done

    def pods_of(self, jobs: set[str]) -> dict[str, dict[str, str]]:
        """The live (not failed) worker pods of `jobs`, name by uid, read in the emulator's own loop (one
        pass over its objects, where a list through the API would serialize thousands of pods)."""
        emulator = self.api.emulator
        assert emulator is not None

        async def read() -> dict[str, dict[str, str]]:
            found: dict[str, dict[str, str]] = {job: {} for job in jobs}
            for (resource, _, _), obj in list(emulator._objects.items()):  # no copies: this runs in its loop
                if resource.plural != "pods" or obj.deleted:
                    continue
                pod = obj.raw
                job = (pod["metadata"].get("labels") or {}).get(constants.LABEL_JOB)
                if job in found and pod.get("status", {}).get("phase") != "Failed":
                    found[job][pod["metadata"]["uid"]] = pod["metadata"]["name"]
            return found

        result: dict[str, dict[str, str]] = self.run(read())
        return result


def _make(world: World, args: argparse.Namespace) -> dict[str, list[str]]:
    """Nodes, jobs, their etcd objects and running workers; the worker names by job."""
    node_fixture = json.loads((FIXTURES / "aks-node.json").read_text())
    pod_fixture = json.loads((FIXTURES / "aks-worker-pod.json").read_text())
    kube = world.kube
    nodes = [_node(n, node_fixture) for n in range(args.nodes)]
    world.many([partial(kube.create, body) for body in nodes])
    names = [f"job-{n:04d}" for n in range(args.jobs)]
    made = world.many([partial(kube.create, _job(name, args.workers)) for name in names])
    objects, workers, placed = [], {}, []
    for index, body in enumerate(made):
        ref = JobRef(body["metadata"]["name"], NS, body["metadata"]["uid"])
        spec = parse_spec(body["spec"])
        for obj in builders.etcd_objects(ref, spec):
            if obj["kind"] == "Deployment":
                obj["status"] = {"availableReplicas": 1, "readyReplicas": 1, "replicas": 1}
            objects.append(obj)
        pods = [builders.worker_pod(ref, spec, i) for i in range(args.workers)]
        objects += pods
        workers[ref.name] = [p["metadata"]["name"] for p in pods]
        for i, pod in enumerate(pods):
            node = nodes[(index * args.workers + i) % len(nodes)]["metadata"]["name"]
            placed.append((pod["metadata"]["name"], _running(pod, node, pod_fixture)))
    print(f"[make] {len(nodes)} nodes, {len(names)} jobs, {len(objects)} etcd objects and pods", flush=True)
    world.many([partial(kube.create, obj) for obj in objects])
    world.many([partial(kube.patch, "v1", "Pod", NS, name, patch) for name, patch in placed])
    return workers


class RateSampler:
    """The emulator's served requests per second, sampled each second in a thread; its peak."""

    def __init__(self, world: World) -> None:
        assert world.api.emulator is not None
        self.counts = world.api.emulator.counts
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        last = sum(self.counts.values())
        while not self._stop.wait(1.0):
            now = sum(self.counts.values())
            self.peak, last = max(self.peak, now - last), now

    def __enter__(self) -> RateSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _start(
    world: World, args: argparse.Namespace, log: Any, label: str
) -> tuple[subprocess.Popen[bytes], dict[str, float]]:
    """An operator process; the seconds until it has reconciled every job, its peak request rate."""
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(world.api.kubeconfig), METRICS_PORT_ENV: str(port)}
    cmd = [sys.executable, "-m", "torchspot_operator", "--standalone", "--all-namespaces"]
    started = time.perf_counter()
    with RateSampler(world) as rates:
        operator = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait(f"{label}: every job reconciled", lambda: metric_sum(port, "torchspot_jobs") >= args.jobs, 900, poll=1.0)
        took = time.perf_counter() - started
    print(f"[{label}] every job reconciled after {took:.1f} s; peak {rates.peak} requests/s", flush=True)
    return operator, {"seconds": took, "peak_requests_per_s": rates.peak}


def _until_quiet(world: World, seconds: float) -> None:
    """Wait until the API has served no request for `seconds` (the operator has done what it had to)."""
    assert world.api.emulator is not None
    counts = world.api.emulator.counts
    settled = [sum(counts.values()), time.perf_counter()]

    def still() -> bool:
        now = sum(counts.values())
        if now != settled[0]:
            settled[0], settled[1] = now, time.perf_counter()
        return time.perf_counter() - settled[1] >= seconds

    wait("the API to go quiet", still, 600, poll=0.5)


def _quiet(world: World, args: argparse.Namespace) -> float:
    assert world.api.emulator is not None
    counts = world.api.emulator.counts
    _until_quiet(world, 5)
    before = sum(counts.values())
    print(f"[quiet] watching the API for {args.quiet_window:.0f} s", flush=True)
    time.sleep(args.quiet_window)  # the measurement: requests while nothing happens
    return float((sum(counts.values()) - before) / args.jobs / (args.quiet_window / 60))


def _latency(world: World, args: argparse.Namespace, workers: dict[str, list[str]]) -> tuple[list[float], list[float]]:
    """Seconds from an eviction to its replacement: of one worker of a probe job evicted while `--busy`
    other jobs, each evicted just before, are reconciling (the issue's measure), and of those `--busy`
    replacements themselves; `--trials` rounds, each with its own probe job."""
    emulator = world.api.emulator
    assert emulator is not None
    jobs = sorted(workers)
    probes, others = jobs[: args.trials], jobs[args.trials :]
    pod_fixture = json.loads((FIXTURES / "aks-worker-pod.json").read_text())
    disrupted = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    evicted = {"status": {"phase": "Failed", "reason": "Evicted", "conditions": [disrupted]}}
    samples: list[float] = []
    probed: list[float] = []
    for trial, probe in enumerate(probes):
        # Other jobs each round (in turn through them all): one job evicted round after round would run
        # into its eviction budget (the operator backs it off by design), which is not latency.
        start = (trial * args.busy) % len(others)
        busy = (others + others)[start : start + args.busy]
        # Each round is one wave of evictions, as a spot reclaim is: the last round's status writes are
        # done and the client's token bucket has refilled (back to back, the rounds measure its rate).
        _until_quiet(world, 3)
        watched = {*busy, probe}
        before = world.pods_of(watched)
        victims = [sorted(before[job].values())[0] for job in busy]
        seen = len(emulator.arrived)
        started = time.perf_counter()
        world.many([partial(world.kube.patch, "v1", "Pod", NS, name, evicted) for name in victims])
        world.run(world.kube.patch("v1", "Pod", NS, sorted(before[probe].values())[0], evicted))
        probe_started = time.perf_counter()  # the load is in flight: 100 reconciles queued or running
        replaced: dict[str, float] = {}
        fresh: list[str] = []
        deadline = started + 60
        while len(replaced) < len(watched) and time.perf_counter() < deadline:
            # The creates the emulator accepted since the round began, timed at their arrival: read from
            # its append-only log, so polling costs the emulator's loop nothing.
            new = emulator.arrived[seen:]
            seen += len(new)
            for made in new:
                job = made.labels.get(constants.LABEL_JOB, "")
                if made.plural == "pods" and job in watched and job not in replaced:
                    replaced[job] = made.at - (probe_started if job == probe else started)
                    fresh.append(made.name)
            time.sleep(0.02)
        if len(replaced) < len(watched):
            sys.exit(f"trial {trial + 1}: {len(watched) - len(replaced)} evictions not replaced within 60 s")
        probed.append(replaced.pop(probe))
        samples += replaced.values()
        # The kubelet's part: the replacements run (on some node; which one does not matter here).
        running = _running({}, "aks-gpuspot-12345678-vmss000000", pod_fixture)
        world.many([partial(world.kube.patch, "v1", "Pod", NS, name, running) for name in fresh])
        print(
            f"[latency {trial + 1}/{args.trials}] probe replaced after {probed[-1] * 1000:.0f} ms; the {len(busy)} "
            f"evicted at once: median {statistics.median(replaced.values()) * 1000:.0f} ms, "
            f"max {max(replaced.values()) * 1000:.0f} ms",
            flush=True,
        )
    return probed, samples


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8, help="worker pods per job")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--busy", type=int, default=100, help="jobs evicted at once in each latency trial")
    parser.add_argument("--trials", type=int, default=20, help="latency rounds, each with its own probe job")
    parser.add_argument("--quiet-window", type=float, default=330.0, help="longer than kopf's 300 s watch cycle")
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/thousand/...)")
    args = parser.parse_args()
    recording = record.Run("thousand", args.out)

    results: dict[str, Any] = {"jobs": args.jobs, "workers": args.workers, "nodes": args.nodes}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="torchspot-thousand-") as tmp, KubeApi(Path(tmp) / "api") as api:
        world = World(api)
        made = time.perf_counter()
        workers = _make(world, args)
        print(f"[make] done in {time.perf_counter() - made:.0f} s", flush=True)
        with (RESULTS_DIR / "thousand.log").open("w") as log:
            operator, start = _start(world, args, log, "start")
            try:
                results["start"] = start
                results["quiet_requests_per_job_minute"] = _quiet(world, args)
                results["start"]["peak_rss_mb"] = peak_rss_mb(operator.pid)
                probed, samples = _latency(world, args, workers)
                results["replacement_s"] = {
                    "p50": statistics.median(probed), "p99": _percentile(probed, 0.99), "n": len(probed),
                }  # fmt: skip
                results["burst_replacement_s"] = {
                    "p50": statistics.median(samples), "p99": _percentile(samples, 0.99), "n": len(samples),
                }  # fmt: skip
                results["rounds_peak_rss_mb"] = peak_rss_mb(operator.pid)  # the whole run's, rounds included
            finally:
                operator.terminate()
                operator.wait(60)
            standby, takeover = _start(world, args, log, "takeover")
            try:
                time.sleep(10)  # settled: its first timer rounds
                takeover["peak_rss_mb"] = peak_rss_mb(standby.pid)
                results["takeover"] = takeover
            finally:
                standby.terminate()
                standby.wait(60)
        world.run(world.kube.close())

    with recording.captured():
        start, takeover, replaced = results["start"], results["takeover"], results["replacement_s"]
        burst = results["burst_replacement_s"]
        print(f"\n{args.jobs} jobs x {args.workers} workers on {args.nodes} nodes, AKS-sized objects (kmock emulator)")
        print(f"  start: every job reconciled in {start['seconds']:.1f} s, "
              f"peak {start['peak_requests_per_s']} requests/s, "
              f"operator peak memory {start['peak_rss_mb']:.0f} MiB (target <= 200 MiB), "
              f"{results['rounds_peak_rss_mb']:.0f} MiB after the latency rounds")  # fmt: skip
        print(f"  quiet: {results['quiet_requests_per_job_minute']:.3f} requests per job per minute (target <= 1)")
        print(f"  an eviction while {args.busy} other jobs reconcile theirs: "
              f"replacement p50 {replaced['p50'] * 1000:.0f} ms, p99 {replaced['p99'] * 1000:.0f} ms "
              f"over {replaced['n']} (target p99 < 1 s)")  # fmt: skip
        print(f"  the {args.busy} evicted at once: p50 {burst['p50'] * 1000:.0f} ms, p99 {burst['p99'] * 1000:.0f} ms "
              f"over {burst['n']}")  # fmt: skip
        print(f"  takeover: every job reconciled in {takeover['seconds']:.1f} s, peak {takeover['peak_requests_per_s']}"
              f" requests/s, peak memory {takeover['peak_rss_mb']:.0f} MiB")  # fmt: skip
    recording.write([], figures=results)


if __name__ == "__main__":
    main()
