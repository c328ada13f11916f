"""`make demo`: a small elastic job of three local nodes that loses one, then a report.

Starts a real etcd, three `torchspot-run` agents (one gloo worker each) training the
lab's toy program with checkpoints every 10 steps, SIGKILLs one node's whole process
tree mid-run, and prints what happened: when the group formed, when the node was
lost, how long the survivors took to re-form, how many steps were redone, and how
the run ended. Everything it writes stays under `runs/demo-<time>/`.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from torchspot.lab.etcd import EtcdServer
from torchspot.lab.local import (
    JobConfig,
    LocalNode,
    first_step_at,
    last_step_before,
    read_events,
    resumed_step_after,
    wait_for,
)


def _say(t0: float, message: str) -> None:
    print(f"[{time.time() - t0:6.1f}s] {message}", flush=True)


def _follow(job: JobConfig, t0: float, seen: int) -> int:
    """Print new group starts and every 5th checkpoint; return how many events were read."""
    events = read_events(job.events)
    for event in events[seen:]:
        if event["event"] == "start":
            _say(t0, f"worker group of {event['world']} started, resuming from step {event['step']}")
        elif event["event"] == "ckpt" and event["step"] % 50 == 0:
            _say(t0, f"checkpoint committed at step {event['step']}")
    return len(events)


def run_demo(root: Path, steps: int, kill_after: int) -> dict[str, Any]:
    """Run the scenario and return the measured facts."""
    t0 = time.time()
    with EtcdServer(root / "etcd-data", log_path=root / "etcd.log") as etcd:
        _say(t0, f"etcd {etcd.endpoint} up (v3 API); starting 3 nodes with --nnodes 1:3")
        job = JobConfig(
            workdir=root, backend="etcd-v3", endpoint=etcd.endpoint,
            run_id=f"demo-{uuid.uuid4().hex[:8]}", nnodes="1:3", steps=steps,
        )  # fmt: skip
        nodes = [LocalNode(f"node-{i}", job) for i in range(3)]
        seen = 0
        try:
            for node in nodes:
                node.start()
            formed = wait_for(lambda: first_step_at(read_events(job.events), 3, 0), 120, "the group of 3")
            seen = _follow(job, t0, seen)
            _say(t0, "all 3 nodes training")
            wait_for(
                lambda: last_step_before(read_events(job.events), time.time()) >= kill_after,
                120,
                "steps",
            )
            seen = _follow(job, t0, seen)

            victim = nodes[2]
            fault = time.time()
            victim.kill()
            reached = last_step_before(read_events(job.events), fault)
            _say(t0, f"EVICTED {victim.name}: SIGKILL to its agent and worker at step {reached}")
            recovered = wait_for(lambda: first_step_at(read_events(job.events), 2, fault), 120, "recovery")
            seen = _follow(job, t0, seen)
            resumed = resumed_step_after(read_events(job.events), fault) or 0
            _say(t0, f"survivors re-formed at world size 2 in {recovered['t'] - fault:.1f} s")

            while any(node.poll() is None for node in nodes[:2]):
                seen = _follow(job, t0, seen)
                time.sleep(0.5)
            seen = _follow(job, t0, seen)
            codes = [node.wait(10) for node in nodes[:2]]
        finally:
            for node in nodes:
                node.stop()
        events = read_events(job.events)
        done = next((e for e in events if e["event"] == "done"), None)
        client = etcd.client()
        leftover = client.get_prefix(f"/torchspot/rdzv/{job.run_id}/")
        client.close()
    return {
        "formed_s": formed["t"] - t0,
        "reached": reached,
        "recovery_s": recovered["t"] - fault,
        "resumed": resumed,
        "done": done,
        "codes": codes,
        "leftover_keys": len(leftover),
        "wall_s": time.time() - t0,
        "workdir": root,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the demo and print its report; exit 0 only if the job finished."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--kill-after", type=int, default=45, help="lose a node after this step")
    parser.add_argument("--out", type=Path, default=Path("runs"), help="parent folder for the run")
    args = parser.parse_args(argv)
    root = (args.out / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    root.mkdir(parents=True, exist_ok=True)

    facts = run_demo(root, args.steps, args.kill_after)
    done = facts["done"]
    print("\n=== torchspot demo report ===")
    print(f"group of 3 formed after       {facts['formed_s']:.1f} s (etcd-v3 rendezvous)")
    print(f"node lost at step             {facts['reached']} (SIGKILL of agent + worker)")
    print(f"survivors training again in   {facts['recovery_s']:.1f} s at world size 2")
    redone = facts["reached"] - facts["resumed"]
    print(f"resumed from checkpoint       step {facts['resumed']} ({redone} steps redone)")
    if done:
        ending = f"step {done['step']} at world size {done['world']}, loss {done['loss']:.4f}"
        print(f"finished                      {ending}")
    else:
        print("finished                      NO: training did not complete")
    print(f"agent exit codes              {facts['codes']}")
    print(f"rendezvous keys left in etcd  {facts['leftover_keys']} (a finished run deletes its keys)")
    print(f"total wall time               {facts['wall_s']:.1f} s")
    print(f"events, logs and checkpoints  {facts['workdir']}")
    return 0 if done and facts["codes"] == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
