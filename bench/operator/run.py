"""Operator benchmark: replacement latency and scale, against the kmock API emulator.

The operator runs as its own process (`python -m torchspot_operator run --standalone
--all-namespaces`), logged in through a kubeconfig to the emulator, so its memory is
its own. In one run:

1. replacement latency: a worker pod of a running 2-worker job (a fresh one per trial) is evicted (its status set to
   Failed/Evicted with a DisruptionTarget, as an eviction leaves it) or AKS drains its
   node (the auto-drain taint before a spot preempt); the time
   until the replacement pod exists, measured by polling the API every 20 ms;
2. scale: 200 ElasticJobs exist when a fresh operator process starts (as after an
   operator restart); the time until every job has its workers and a status, and that
   operator's peak resident memory (VmHWM);
3. quiet: the same 200 jobs, every worker Running and Ready, nothing happening; the
   requests the operator makes to the API in a window (`--quiet-window`, 330 s: longer
   than kopf's 300 s watch cycle, so its watches reconnect inside it), per job per minute
   (counted by the emulator itself, so this script's own reads do not count), and the
   operator's CPU in that window (its timer ticks).

There is no stock operator to run beside it here (the pytorch/elastic controller and
Kubeflow's are Go programs that need a real API server), so the targets are absolute:
median replacement <= 1 s, 200 jobs <= 60 s, peak memory <= 400 MB, at most 1 request
per running job per minute when nothing changes.

Usage: python bench/operator/run.py [--trials 10] [--jobs 200] [--quiet-window 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.record

from bench import record
from torchspot_lab.kubeapi import KubeApi
from torchspot_operator import constants
from torchspot_operator.kube import Kube
from torchspot_operator.metrics import METRICS_PORT_ENV

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
DRAIN = {"key": "remediator.kubernetes.azure.com/unschedulable", "effect": "NoSchedule"}
"""AKS node auto-drain's taint before a spot preempt: a definite signal, acted on at once (a NotReady
node waits out its pods' grace, 300 s by default, and is measured in shared.py's storm instead)."""
NS = "default"


def job(name: str, replicas: int) -> dict[str, Any]:
    """A minimal valid ElasticJob."""
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "minReplicas": 1,
            "maxReplicas": replicas,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "trainer:bench"}]}},
        },
    }


def wait(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.02) -> float:
    """Seconds until `check()` is truthy; exits with a message naming `what` after `timeout`."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if check():
            return time.perf_counter() - started
        time.sleep(poll)
    sys.exit(f"timed out after {timeout:.0f} s waiting for {what}")


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size (VmHWM) in MiB (kB / 1024: the figures this suite reports as
    "MB" are MiB, about 5% fewer than MB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return psutil.Process(pid).memory_info().rss / 2**20


def main() -> None:
    """Run both measurements and print them against the targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="replacements measured per kind of loss")
    parser.add_argument("--jobs", type=int, default=200, help="ElasticJobs in the scale test")
    parser.add_argument(
        "--quiet-window", type=float, default=330.0,
        help="seconds the quiet jobs are watched (longer than kopf's 300 s watch cycle, so a reconnect falls in it)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/operator/...)")
    args = parser.parse_args()
    recording = record.Run("operator", args.out)

    with tempfile.TemporaryDirectory(prefix="torchspot-operator-bench-") as tmp, KubeApi(Path(tmp) / "api") as api:
        kube = Kube(server=api.url, headers={}, ssl_context=True)

        def run(coro: Any) -> Any:
            return api.run(coro, timeout=60)

        def pods(name: str | None = None) -> list[dict[str, Any]]:
            labels = {constants.LABEL_ROLE: constants.ROLE_WORKER}
            if name:
                labels[constants.LABEL_JOB] = name
            return list(run(kube.list("v1", "Pod", NS, labels)))

        def patch(kind: str, namespace: str | None, name: str, body: dict[str, Any]) -> None:
            run(kube.patch("v1", kind, namespace, name, body))

        for index in range(2):
            run(kube.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"spot-{index}"}, "spec": {},
                             "status": {"conditions": [{"type": "Ready", "status": "True"}]}}))  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(api.kubeconfig), METRICS_PORT_ENV: "0"}
        cmd = [sys.executable, "-m", "torchspot_operator", "--standalone", "--all-namespaces"]
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        with (RESULTS_DIR / "operator.log").open("w") as log:
            with subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT) as operator:
                try:
                    results = _latency(args, run, kube, pods, patch)
                finally:
                    operator.terminate()
                    operator.wait(30)
            # Scale: the jobs exist before the operator starts (as after an operator restart or
            # upgrade), so the benchmark's own 200 creates do not queue behind the operator's
            # traffic in the single-threaded emulator.
            for index in range(args.jobs):
                run(kube.create(job(f"scale-{index:03d}", 2)))
            started = time.perf_counter()
            emulator_cpu = _cpu(psutil.Process())
            with subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT) as operator:
                try:
                    wait(f"{args.jobs} jobs reconciled", _all_reconciled(args, run, kube, pods), 300, poll=2.0)
                    results["scale_s"] = time.perf_counter() - started
                    results["operator_peak_rss_mb"] = peak_rss_mb(operator.pid)
                    results["operator_cpu_s"] = _cpu(psutil.Process(operator.pid))
                    results["emulator_cpu_s"] = _cpu(psutil.Process()) - emulator_cpu
                    print(f"[scale] {args.jobs} jobs reconciled after {results['scale_s']:.1f} s", flush=True)
                    results.update(
                        _quiet(args, api, run=run, kube=kube, pods=pods, patch=patch, operator_pid=operator.pid)
                    )
                finally:
                    operator.terminate()
                    operator.wait(30)
            results["jobs"] = args.jobs
        run(kube.close())

    with recording.captured():
        pod_median = statistics.median(results["pod_loss_s"])
        node_median = statistics.median(results["node_loss_s"])
        print("\nOperator against the kmock emulator")
        print(
            f"  evicted pod -> replacement created: median {pod_median * 1000:.0f} ms "
            f"(min {min(results['pod_loss_s']) * 1000:.0f}, max {max(results['pod_loss_s']) * 1000:.0f}; target <= 1 s)"
        )
        print(
            f"  drained node -> replacement created: median {node_median * 1000:.0f} ms "
            f"(min {min(results['node_loss_s']) * 1000:.0f}, max {max(results['node_loss_s']) * 1000:.0f}; "
            "target <= 1 s)"
        )
        print(
            f"  {args.jobs} ElasticJobs reconciled (workers, etcd, status) in {results['scale_s']:.1f} s "
            "(target <= 60 s)"
        )
        print(f"  CPU during the scale test: operator {results['operator_cpu_s']:.1f} s, "
              f"emulator and this script {results['emulator_cpu_s']:.1f} s")  # fmt: skip
        print(f"  operator peak memory {results['operator_peak_rss_mb']:.0f} MiB "
              "(target <= 400 MB = 381 MiB)")  # fmt: skip
        print(
            f"  {args.jobs} running jobs, nothing changing, {args.quiet_window:.0f} s: {results['quiet_requests']} API "
            f"requests, {results['quiet_requests_per_job_minute']:.3f} per job per minute (target <= 1); operator CPU "
            f"{results['quiet_operator_cpu_percent']:.1f}% of a core"
        )
        if results["quiet_by_request"]:
            print(f"    by request: {results['quiet_by_request']}")
    trials = [{"loss": kind, "seconds": seconds} for kind in ("pod", "node") for seconds in results[f"{kind}_loss_s"]]
    recording.write(trials, figures=results)


def _latency(
    args: argparse.Namespace,
    run: Callable[[Any], Any],
    kube: Kube,
    pods: Callable[..., list[dict[str, Any]]],
    patch: Callable[[str, str | None, str, dict[str, Any]], None],
) -> dict[str, Any]:
    """Replacement latency, each trial on a fresh 2-worker job.

    A fresh job per trial: thirty evictions of one 2-worker job in a minute would exhaust its eviction
    budget (more than max(6, 2 x desired) in 10 minutes), and its replacements would then rightly wait
    the failure backoff, which is not what this measures.
    """
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}

    def live(name: str) -> dict[str, str]:
        """The job's pods that are not Failed (an evicted pod is kept for its logs), uid by name."""
        return {
            p["metadata"]["name"]: p["metadata"]["uid"]
            for p in pods(name)
            if p.get("status", {}).get("phase") != "Failed" and not p["metadata"].get("deletionTimestamp")
        }

    def started_job(name: str, node: str) -> dict[str, str]:
        """A new job whose two workers run on `node`; their uids by name."""
        run(kube.create(job(name, 2)))
        wait(f"{name}'s workers", lambda: len(live(name)) == 2, 60)
        for pod in live(name):
            patch("Pod", NS, pod, {"spec": {"nodeName": node}, "status": ready})
        return live(name)

    def new_pods(name: str, before: dict[str, str]) -> int:
        """Replacements are told apart by uid: the emulator deletes at once, so a replacement may
        reuse a freed name (a real API server keeps it while terminating)."""
        return len(set(live(name).values()) - set(before.values()))

    pod_loss: list[float] = []
    for trial in range(args.trials):
        name = f"latency-pod-{trial}"
        before = started_job(name, "spot-0")
        victim = sorted(before)[0]
        started = time.perf_counter()
        disrupted = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
        patch("Pod", NS, victim, {"status": {"phase": "Failed", "reason": "Evicted", "conditions": [disrupted]}})
        wait("a replacement", lambda n=name, b=before: new_pods(n, b) == 1, 30)  # type: ignore[misc]
        pod_loss.append(time.perf_counter() - started)
        print(f"[pod {trial + 1}/{args.trials}] replacement after {pod_loss[-1] * 1000:.0f} ms", flush=True)
        run(kube.delete(constants.API_VERSION, constants.PLURAL, NS, name))

    node_loss: list[float] = []
    for trial in range(args.trials):
        node = f"spot-{trial % 2}"
        other = f"spot-{(trial + 1) % 2}"
        patch("Node", None, other, {"spec": {"taints": []}})
        name = f"latency-node-{trial}"
        before = started_job(name, node)
        started = time.perf_counter()
        patch("Node", None, node, {"spec": {"taints": [DRAIN]}})
        wait("replacements", lambda n=name, b=before: new_pods(n, b) == 2, 30)  # type: ignore[misc]
        node_loss.append(time.perf_counter() - started)
        print(f"[node {trial + 1}/{args.trials}] replacements after {node_loss[-1] * 1000:.0f} ms", flush=True)
        run(kube.delete(constants.API_VERSION, constants.PLURAL, NS, name))
    return {"pod_loss_s": pod_loss, "node_loss_s": node_loss}


def _quiet(
    args: argparse.Namespace,
    api: KubeApi,
    *,
    run: Callable[[Any], Any],
    kube: Kube,
    pods: Callable[..., list[dict[str, Any]]],
    patch: Callable[[str, str | None, str, dict[str, Any]], None],
    operator_pid: int,
) -> dict[str, Any]:
    """Requests and CPU of the operator while every scale job trains and nothing changes."""
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    for index in range(2):  # the latency test left one drained
        patch("Node", None, f"spot-{index}", {"spec": {"taints": []}})
    shown = [time.perf_counter()]

    def all_running() -> bool:
        """Start whichever scale pods are not running yet (the kubelet's part), then look at the jobs."""
        for index, pod in enumerate(pods()):
            if pod["metadata"]["labels"].get(constants.LABEL_JOB, "").startswith("scale-") and (
                pod.get("status", {}).get("phase") != "Running"
            ):
                patch("Pod", NS, pod["metadata"]["name"], {"spec": {"nodeName": f"spot-{index % 2}"}, "status": ready})
        jobs = run(kube.list(constants.API_VERSION, constants.PLURAL, NS))
        phases = [(j.get("status") or {}).get("phase") for j in jobs if j["metadata"]["name"].startswith("scale-")]
        if time.perf_counter() - shown[0] > 5:
            shown[0] = time.perf_counter()
            print(
                f"  ... {phases.count('Running')}/{args.jobs} jobs Running ({sorted(set(map(str, phases)))})",
                flush=True,
            )
        return len(phases) == args.jobs and all(phase == "Running" for phase in phases)

    wait("every scale job Running", all_running, 300, poll=2.0)
    assert api.emulator is not None
    counts = api.emulator.counts
    last, changed = [dict(counts)], [time.perf_counter()]

    def quiet_for_5_s() -> bool:
        if dict(counts) != last[0]:
            last[0], changed[0] = dict(counts), time.perf_counter()
        return time.perf_counter() - changed[0] >= 5

    wait("the API to go quiet", quiet_for_5_s, 120, poll=0.5)
    before, cpu = dict(counts), _cpu(psutil.Process(operator_pid))
    print(f"[quiet] {args.jobs} jobs running; watching the API for {args.quiet_window:.0f} s", flush=True)
    time.sleep(args.quiet_window)  # the measurement itself: requests made while nothing happens
    spent = _cpu(psutil.Process(operator_pid)) - cpu
    delta = {f"{m} {r}": n - before.get((m, r), 0) for (m, r), n in counts.items() if n != before.get((m, r), 0)}
    total = sum(delta.values())
    return {
        "quiet_requests": total,
        "quiet_requests_per_job_minute": total / args.jobs / (args.quiet_window / 60),
        "quiet_by_request": delta,
        "quiet_operator_cpu_percent": 100 * spent / args.quiet_window,
    }


def _all_reconciled(
    args: argparse.Namespace, run: Callable[[Any], Any], kube: Kube, pods: Callable[..., list[dict[str, Any]]]
) -> Callable[[], bool]:
    """A check: every scale-* job has a status and its two workers (with progress every 5 s)."""
    shown = [time.perf_counter()]

    def check() -> bool:
        jobs = run(kube.list(constants.API_VERSION, constants.PLURAL, NS))
        with_status = sum(
            1 for j in jobs if (j.get("status") or {}).get("phase") and j["metadata"]["name"] != "latency"
        )
        workers = sum(1 for p in pods() if p["metadata"]["labels"].get(constants.LABEL_JOB, "").startswith("scale-"))
        if time.perf_counter() - shown[0] > 5:
            shown[0] = time.perf_counter()
            print(f"  ... {with_status}/{args.jobs} jobs with a status, {workers}/{2 * args.jobs} workers", flush=True)
        return bool(with_status == args.jobs and workers == 2 * args.jobs)

    return check


if __name__ == "__main__":
    main()
