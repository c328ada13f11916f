"""Operator benchmark on a busy shared cluster's hot paths, against the kmock API emulator.

The operator runs as its own process, logged in through a kubeconfig to the emulator. Two scenes:

1. **quota**: a job wanting `--workers` (64) GPU workers in a namespace whose ResourceQuota allows
   no `nvidia.com/gpu`. After `--settle` seconds (the backoff growing), the operator's requests and
   the Events it posts are counted for `--window` seconds and given per minute. Target once backed
   off: at most 10 requests and 1 Event a minute. The hot loop this replaces (one POST and one
   Event per missing pod per 5 s tick) would make `12 * workers` of each a minute; printed beside.
2. **storm**: `--jobs` (50) running jobs of two workers on `--nodes` (20) nodes; the node controller
   marks every node Unknown for `--storm` seconds (120), then Ready again. The operator runs with a
   NotReady grace of 10 s (`TORCHSPOT_NODE_GRACE_SECONDS`, so the grace ends inside the storm and the
   full-disruption guard is what holds). Target: no worker deleted. The old rule (any NotReady node's
   workers deleted at once) would delete all `2 * jobs`.

Usage: python bench/operator/shared.py [--workers 64] [--settle 160] [--window 240]
                                        [--jobs 50] [--nodes 20] [--storm 120]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.operator

from bench import record
from bench.operator.run import NS, RESULTS_DIR, job, wait
from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.sandbox import shipped_crd
from torchspot_operator import constants
from torchspot_operator.kube import Kube
from torchspot_operator.metrics import METRICS_PORT_ENV


def operator(api: KubeApi, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """The operator as its own process against the emulator."""
    full = {**os.environ, "KUBECONFIG": str(api.kubeconfig), METRICS_PORT_ENV: "0", **env}
    cmd = [sys.executable, "-m", "torchspot_operator", "--standalone", "--all-namespaces"]
    return subprocess.Popen(cmd, env=full, stdout=log.open("w"), stderr=subprocess.STDOUT)


def quota(args: argparse.Namespace, folder: Path) -> dict[str, float]:
    with KubeApi(folder / "quota") as api:
        kube = Kube(server=api.url, headers={}, ssl_context=True)
        assert api.emulator is not None
        counts = api.emulator.counts
        api.run(kube.create(shipped_crd()))
        api.run(kube.create({
            "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus", "namespace": NS},
            "spec": {"hard": {"requests.nvidia.com/gpu": "0"}},
        }))  # fmt: skip
        proc = operator(api, RESULTS_DIR / "operator-quota.log")
        try:
            api.run(kube.create(job("quota", args.workers)))
            print(
                f"[quota] a job of {args.workers} GPU workers, no GPU quota; settling {args.settle:.0f} s", flush=True
            )
            time.sleep(args.settle)  # the backoff grows meanwhile: the measurement is what comes after
            before = dict(counts)
            time.sleep(args.window)
            after = dict(counts)
        finally:
            proc.terminate()
            proc.wait(30)
        api.run(kube.close())
    delta = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    minutes = args.window / 60
    events = sum(n for (method, resource), n in delta.items() if method == "POST" and resource.endswith("events"))
    requests = sum(delta.values()) - events
    posts = delta.get(("POST", "v1/pods"), 0)
    print(f"  quota window, by request: {dict(sorted((f'{m} {r}', n) for (m, r), n in delta.items()))}", flush=True)
    return {
        "requests_per_minute": requests / minutes,
        "pod_posts_per_minute": posts / minutes,
        "events_per_minute": events / minutes,
        "hot_loop_posts_per_minute": 12.0 * args.workers,
    }


def storm(args: argparse.Namespace, folder: Path) -> dict[str, float]:
    with KubeApi(folder / "storm") as api:
        kube = Kube(server=api.url, headers={}, ssl_context=True)
        emulator = api.emulator
        assert emulator is not None
        api.run(kube.create(shipped_crd()))
        for index in range(args.nodes):
            api.run(kube.create({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": f"spot-{index}", "labels": {constants.SPOT_LABEL: constants.SPOT_VALUE}},
                "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }))  # fmt: skip
        proc = operator(api, RESULTS_DIR / "operator-storm.log", **{constants.NODE_GRACE_ENV: "10"})
        try:
            for index in range(args.jobs):
                api.run(kube.create(job(f"storm-{index}", 2)))
            labels = {constants.LABEL_ROLE: constants.ROLE_WORKER}

            def all_running() -> bool:
                ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
                pods = api.run(kube.list("v1", "Pod", NS, labels))
                for index, pod in enumerate(pods):
                    if pod.get("status", {}).get("phase") != "Running":
                        spec = {"nodeName": f"spot-{index % args.nodes}"}
                        api.run(kube.patch("v1", "Pod", NS, pod["metadata"]["name"], {"spec": spec, "status": ready}))
                jobs = api.run(kube.list(constants.API_VERSION, constants.PLURAL, NS))
                return len(pods) == 2 * args.jobs and all(
                    (j.get("status") or {}).get("phase") == "Running" for j in jobs
                )

            wait("every storm job Running", all_running, 300, poll=2.0)
            deletes = emulator.counts[("DELETE", "v1/pods")]
            print(f"[storm] {args.jobs} jobs running; every node Unknown for {args.storm:.0f} s", flush=True)
            api.run(emulator.nodes_unknown())
            time.sleep(args.storm)
            deleted = emulator.counts[("DELETE", "v1/pods")] - deletes
            api.run(emulator.nodes_ready())
        finally:
            proc.terminate()
            proc.wait(30)
        api.run(kube.close())
    return {"workers_deleted": float(deleted), "old_rule_would_delete": 2.0 * args.jobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--settle", type=float, default=160.0, help="seconds before the quota window")
    parser.add_argument("--window", type=float, default=240.0, help="seconds the quota scene is measured")
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--storm", type=float, default=120.0, help="seconds every node stays Unknown")
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/shared/...)")
    args = parser.parse_args()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    recording = record.Run("shared", args.out)
    with tempfile.TemporaryDirectory(prefix="torchspot-shared-bench-") as tmp, recording.captured():
        found = quota(args, Path(tmp))
        print(
            f"quota: {found['requests_per_minute']:.1f} requests/min (target <= 10), "
            f"{found['pod_posts_per_minute']:.1f} pod POSTs/min, {found['events_per_minute']:.1f} Events/min "
            f"(target <= 1); the hot loop: {found['hot_loop_posts_per_minute']:.0f} POSTs and as many Events/min "
            f"(ratio {found['hot_loop_posts_per_minute'] / max(found['pod_posts_per_minute'], 0.01):.0f}x)",
            flush=True,
        )
        hit = storm(args, Path(tmp))
        print(
            f"storm: {hit['workers_deleted']:.0f} workers deleted while every node was Unknown for "
            f"{args.storm:.0f} s (target 0; the old rule: {hit['old_rule_would_delete']:.0f})",
            flush=True,
        )
    recording.write([found, hit], figures={"quota": found, "storm": hit})


if __name__ == "__main__":
    main()
