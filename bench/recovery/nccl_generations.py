"""NCCL generations on one GPU: what re-forming a communicator in place costs on a GPU, against what a
restarted worker pays again there, in the same run (issue 28, item 4; README, "Recovery paths").

The trainer's in-place path is built on gloo; on GPUs its design (recovery/live.py) makes each
generation's NCCL communicator non-blocking with eager init, aborts the old one after our deadline,
and probes the device before it goes on. This measures those steps with real NCCL on a real device:

- `solo`: one rank: its first communicator, an abort of an idle one, the probe, the next one;
- `kill` and `freeze`: three ranks run small all-reduces in a loop; the highest is SIGKILLed or
  SIGSTOPped at a random point (inside a collective or between two); the survivors see an all-reduce
  miss our deadline (`--deadline`), abort the communicator on a thread of their own (never longer
  than `ABORT_SECONDS`), probe the device, and build the next generation's communicator on the round's
  store, whose first all-reduce must sum to the survivors' number. After a freeze the frozen rank is
  thawed once the survivors have moved on, and what its pending all-reduce then did is reported.

Beside it, what a restarted worker pays again before its first collective: the interpreter's
import of torch, the CUDA context, the first communicator; and rank 0 measures the model's warm-up
that in place keeps (ResNet-50 built on the device, its first step under cudnn.benchmark against a
steady one).

Three ranks share the one GPU. NCCL refuses two ranks of a communicator on one device ("Duplicate
GPU detected") unless they look like different hosts, so each rank gets its own NCCL_HOSTID and the
ranks talk over NCCL's socket transport on the loopback: a collective's speed here is the socket's,
not a GPU node's NVLink or InfiniBand, and is not reported as one. The set-up, abort, probe and warm-up
times are the device's, the driver's and NCCL's own.

Needs a CUDA build of torch and one GPU (CI has none; this runs on a lent GPU machine).
Usage: python bench/recovery/nccl_generations.py [--scenarios solo kill freeze] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORLD = 3
SMALL = 1 << 18
"""Elements of the all-reduce the ranks loop on (1 MiB of float32): a real transfer, short on a socket."""
LOOP_DEADLINE = 1.0
"""Our deadline on one all-reduce in the loop: a missed one is the survivors' cue (in the product the
agent's liveness tells them first, in about a second)."""
FIRST_SECONDS = 60.0
"""The most the first all-reduce of a generation (which waits for its communicator) may take."""
ABORT_SECONDS = 10.0
"""The most an abort may take before the rank reports it stuck (recovery/group.py's value)."""
RUN_SECONDS = 100.0
"""The most one scenario may take, its ranks' start included."""


def _now() -> float:
    return time.time()


def rank_main(rank: int, world: int, port: int, scenario: str, deadline: float) -> None:
    """One rank: its marks (wall-clock seconds) and outcomes go to the store as JSON under `result/<rank>`."""
    marks: dict[str, float] = {"start": float(os.environ["TORCHSPOT_PROBE_T0"])}
    facts: dict[str, Any] = {}
    import torch  # noqa: PLC0415 - here, so its import is timed as a restarted worker pays it
    import torch.distributed as dist  # noqa: PLC0415
    from torch._C._distributed_c10d import PrefixStore, TCPStore  # noqa: PLC0415 - what dist re-exports

    marks["imported"] = _now()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.ones(1, device=device)
    torch.cuda.synchronize(device)
    marks["cuda"] = _now()
    from torchspot_trainer.recovery.planes import (  # noqa: PLC0415 - after torch, as above
        NcclPlane,
        Replace,
        generation_options,
        nccl_version,
        replacement,
    )

    store = TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timedelta(seconds=120))
    version = nccl_version()
    assert version is not None  # a CUDA build of torch (the module docstring)
    plane = NcclPlane(device, version)  # the trainer's way to read a communicator's error and abort it
    facts["nccl"] = ".".join(str(part) for part in version)
    facts["torch"] = torch.__version__
    facts["gpu"] = torch.cuda.get_device_name(device)

    def communicator(generation: int, generation_rank: int, size: int) -> Any:
        options = generation_options(timedelta(seconds=60))
        prefix = PrefixStore(f"generation/{generation}/", store)
        backend = dist.ProcessGroupNCCL(prefix, generation_rank, size, options)
        backend.eager_connect_single_device(device)  # eager init, non-blocking: returns at once
        return backend

    def all_reduce(backend: Any, tensor: torch.Tensor, seconds: float) -> bool:
        """Whether an all-reduce completed, without an error, within `seconds`, polled (an NCCL call
        returns at once)."""
        try:
            work = backend.allreduce([tensor])
        except RuntimeError:  # a communicator already known broken
            return False
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if work.is_completed():
                # Completed, or failed: with NCCL's error handling off, a work that NCCL failed
                # (ncclRemoteError) is "completed", its wait() does not raise and WorkNCCL has no
                # is_success: the communicator's error state tells (torch 2.8+: get_error).
                if not plane.failed(backend):
                    return True
                facts["failure"] = "error reported"
                return False
            time.sleep(0.0005)
        facts["failure"] = "deadline missed"
        return False

    def abort(backend: Any) -> bool:
        """The communicator's abort on a thread of its own: whether it returned within ABORT_SECONDS."""
        thread = threading.Thread(target=plane.abort, args=(backend,), name="nccl-abort", daemon=True)
        thread.start()
        thread.join(ABORT_SECONDS)
        return not thread.is_alive()

    first = communicator(0, rank, world)
    marks["communicator_made"] = _now()
    ones = torch.ones(SMALL, device=device)
    facts["first_ok"] = all_reduce(first, ones, FIRST_SECONDS) and float(ones[0].item()) == world
    marks["first_collective"] = _now()
    if scenario == "solo":
        again = torch.ones(SMALL, device=device)
        facts["second_ok"] = all_reduce(first, again, FIRST_SECONDS)
        marks["detected"] = _now()
        facts["abort_returned"] = abort(first)
        marks["aborted"] = _now()
        facts["device_healthy"] = plane.healthy()
        marks["probed"] = _now()
        nxt = communicator(1, rank, world)
        check = torch.ones(SMALL, device=device)
        facts["next_ok"] = all_reduce(nxt, check, FIRST_SECONDS) and float(check[0].item()) == world
        marks["regrouped"] = _now()
        # The same again with the abort overlapped: the old communicator aborted on its thread while
        # the next one forms (nothing orders the two).
        started = _now()
        aborting = threading.Thread(target=abort, args=(nxt,), daemon=True)
        aborting.start()
        overlapped = communicator(2, rank, world)
        check = torch.ones(SMALL, device=device)
        facts["overlapped_ok"] = all_reduce(overlapped, check, FIRST_SECONDS) and float(check[0].item()) == world
        facts["overlapped_next_ms"] = (_now() - started) * 1000
        aborting.join(ABORT_SECONDS)
        facts["overlapped_abort_ms"] = (_now() - started) * 1000
        abort(overlapped)
    else:
        store.add("ready", 1)
        loops = 0
        buffer = torch.ones(SMALL, device=device)
        while True:  # the training loop's collectives, until one misses the deadline
            buffer.fill_(1.0)
            if not all_reduce(first, buffer, deadline):
                break
            loops += 1
        marks["detected"] = _now()
        facts["loops"] = loops
        victim = rank == world - 1
        facts["abort_returned"] = abort(first)
        marks["aborted"] = _now()
        facts["device_healthy"] = plane.healthy()
        marks["probed"] = _now()
        if victim:  # thawed after a freeze: it leaves, as its agent would make it
            facts["thawed"] = True
        else:
            facts["replacement"] = replacement(version, loss_only=True).value
            facts["replacement_used"] = Replace.NEW.value
            nxt = communicator(1, rank, world - 1)
            check = torch.ones(SMALL, device=device)
            facts["next_ok"] = all_reduce(nxt, check, FIRST_SECONDS) and float(check[0].item()) == world - 1
            marks["regrouped"] = _now()
            store.add("regrouped", 1)
            if rank == 0:
                facts.update(warm_up(torch, device))
            abort(nxt)
    store.set(f"result/{rank}", json.dumps({"marks": marks, "facts": facts}))


def warm_up(torch: Any, device: Any) -> dict[str, float]:
    """What a restarted worker pays again for its model and that in place keeps: ResNet-50 built and
    moved to the device, its first training step under cudnn.benchmark (the autotuning), a steady step."""
    import torchvision  # noqa: PLC0415 - on the GPU machine; not a dependency of the project

    torch.backends.cudnn.benchmark = True
    started = time.perf_counter()
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    torch.cuda.synchronize(device)
    built = time.perf_counter()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(128, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (128,), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize(device)
    first = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    warm = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize(device)
    steady = (time.perf_counter() - warm) / 10
    return {"model_to_device_s": built - started, "first_step_s": first - built, "steady_step_s": steady}


def run_scenario(scenario: str, deadline: float) -> dict[str, Any]:
    """One scenario's ranks, started together; the fault applied by this process, which holds the store."""
    from torch._C._distributed_c10d import TCPStore  # noqa: PLC0415 - the rank processes time their own import

    world = 1 if scenario == "solo" else WORLD
    store = TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=120))
    port = store.port
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "trainer"), os.environ.get("PYTHONPATH", "")]),
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # what the launcher sets (nccl.WORKER_NCCL_DEFAULTS)
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    }
    processes = []
    for rank in range(world):
        env = {**environment, "NCCL_HOSTID": f"torchspot-probe-{rank}", "TORCHSPOT_PROBE_T0": repr(_now())}
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(rank),
                    "--world",
                    str(world),
                    "--port",
                    str(port),
                    "--scenario",
                    scenario,
                    "--deadline",
                    str(deadline),
                ],
                env=env,
            )
        )
    fault_at = None
    end = time.monotonic() + RUN_SECONDS
    try:
        if scenario != "solo":
            while store.add("ready", 0) < world:
                if time.monotonic() > end or any(p.poll() is not None for p in processes):
                    raise RuntimeError(f"{scenario}: the ranks did not all reach the loop")
                time.sleep(0.01)
            time.sleep(0.3 + random.random() * 0.2)  # a few loops in: inside a collective or between two
            victim = processes[-1]
            fault_at = _now()
            victim.send_signal(signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
            while store.add("regrouped", 0) < world - 1:
                if time.monotonic() > end:
                    raise RuntimeError(f"{scenario}: the survivors did not regroup")
                time.sleep(0.01)
            if scenario == "freeze":
                victim.send_signal(signal.SIGCONT)
        for process in processes:
            process.wait(timeout=max(end - time.monotonic(), 1.0))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    results: dict[str, Any] = {"scenario": scenario, "fault_at": fault_at, "ranks": {}}
    for rank in range(world):
        if store.check([f"result/{rank}"]):
            results["ranks"][rank] = json.loads(store.get(f"result/{rank}"))
    return results


def summary(results: dict[str, Any]) -> list[str]:
    """Readable lines: per rank, a restart's costs and the in-place steps, in milliseconds."""
    lines = [f"scenario {results['scenario']}"]
    fault_at = results["fault_at"]
    for rank, result in sorted(results["ranks"].items()):
        m, f = result["marks"], result["facts"]

        def ms(a: str, b: str, marks: dict[str, float] = m) -> str:
            return f"{(marks[b] - marks[a]) * 1000:.0f}" if a in marks and b in marks else "-"

        restart = (
            f"import torch {ms('start', 'imported')} ms, CUDA context {ms('imported', 'cuda')} ms, "
            f"first communicator to its first all-reduce {ms('cuda', 'first_collective')} ms "
            f"(start to first all-reduce {ms('start', 'first_collective')} ms)"
        )
        detect = f"{(m['detected'] - fault_at) * 1000:.0f}" if fault_at and "detected" in m else "-"
        in_place = (
            f"fault to failure seen {detect} ms, abort {ms('detected', 'aborted')} ms "
            f"(returned: {f.get('abort_returned')}), probe {ms('aborted', 'probed')} ms "
            f"(healthy: {f.get('device_healthy')}), next communicator to its first all-reduce "
            f"{ms('probed', 'regrouped')} ms (sum right: {f.get('next_ok')}); after the deadline "
            f"{ms('detected', 'regrouped')} ms"
        )
        lines.append(f"  rank {rank}: restart pays {restart}")
        lines.append(f"  rank {rank}: in place {in_place}")
        if "first_step_s" in f:
            lines.append(
                f"  rank {rank}: ResNet-50 (batch 128, bf16) to the device {f['model_to_device_s'] * 1000:.0f} ms, "
                f"first step {f['first_step_s'] * 1000:.0f} ms, steady step {f['steady_step_s'] * 1000:.0f} ms"
            )
        extras = {
            k: v
            for k, v in f.items()
            if k
            in (
                "nccl",
                "torch",
                "gpu",
                "loops",
                "thawed",
                "replacement",
                "failure",
                "overlapped_next_ms",
                "overlapped_abort_ms",
            )
        }
        lines.append(f"  rank {rank}: {extras}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenarios", nargs="+", default=["solo", "kill", "freeze"], choices=["solo", "kill", "freeze"]
    )
    parser.add_argument("--deadline", type=float, default=LOOP_DEADLINE)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args.scenario, args.deadline)
        return
    everything = []
    for scenario in args.scenarios:
        print(f"running {scenario} ...", flush=True)
        try:
            results = run_scenario(scenario, args.deadline)
        except RuntimeError as exc:
            results = {"scenario": scenario, "fault_at": None, "ranks": {}, "error": str(exc)}
            print(f"  {exc}", flush=True)
        everything.append(results)
        print("\n".join(summary(results)), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
