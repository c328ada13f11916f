"""Simulated nodes on one machine: each is a launcher agent and its workers.

A node's faults are applied to its whole process tree, as a real node loss would:
`kill()` SIGKILLs the agent and every worker at once (a pod or VM that vanishes);
`freeze()` SIGSTOPs them (a hung VM or a network partition: sockets stay open);
`thaw()` resumes them. torch starts each worker in a session of its own, so we walk
the tree (psutil) instead of signalling a process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from torchspot_trainer import SNAPSHOT_DIR_ENV

TOY_MODULE = "torchspot_lab.toy_train"
LAUNCHERS = {
    "torchspot": [sys.executable, "-m", "torchspot_trainer.launch"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def signal_tree(pid: int, sig: signal.Signals) -> int:
    """Send `sig` to a process and all its descendants; return how many got it."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    sent = 0
    for proc in procs:
        try:
            proc.send_signal(sig)
            sent += 1
        except psutil.NoSuchProcess:
            continue
    return sent


def kill_tree(pid: int) -> int:
    """SIGKILL a process and all its descendants; return how many got it.

    A frozen (SIGSTOPped) tree dies as it is: SIGKILL ends a stopped process without letting it run,
    as a hung VM whose pod is deleted runs nothing more. The sandbox used to continue it first, and
    between the SIGCONT and the SIGKILL a frozen node's agent ran on what it knew before the freeze:
    it logged that its round had ended and began to re-form, and the survivors re-formed once more,
    seconds after the freeze (a frozen node could be taken out of the rendezvous a second time)."""
    return signal_tree(pid, signal.SIGKILL)


def node_tmp() -> Path:
    """A simulated node's own temporary folder (its TMPDIR), which its owner removes once the node's
    processes ended. A pod's /tmp goes with the pod; this machine's did not: after a few days of suites
    and benchmarks it held 2,800 agent folders (`torchspot-agent-*`), 2,600 of torch's agent logs
    (`torchelastic_*`) and 1,570 of multiprocessing's (`pymp-*`), the leftovers of nodes killed by
    design. Short and under this machine's /tmp, not in the job's folder: multiprocessing's fork server
    listens on a UNIX socket under TMPDIR, whose path must fit in 108 bytes."""
    return Path(tempfile.mkdtemp(prefix="torchspot-node-"))


NODE_ADDR = "127.0.0.1"
"""A local node's `--local-addr` unless its job names another."""
SHARED_CORES_ENV = {"OMP_NUM_THREADS": "1"}
"""For every node simulated on this machine (a LocalNode, a sandbox pod): the nodes share its cores, so
one torch thread each instead of one per core in every node, whose threads would spin against each
other's. Three ResNet workers on 2 cores train twice as fast so; the recovery bench's trainer step at
2 nodes took 11 ms instead of 61 (TorchFT's replicas there always had one thread). The caller's
environment or the job's may set another count."""


@dataclass
class JobConfig:
    """What every node of one local job shares.

    :param workdir: folder for checkpoints, the event file and logs.
    :param backend: `--rdzv-backend` (etcd-v3, etcd-v2, c10d).
    :param endpoint: `--rdzv-endpoint`.
    :param run_id: `--rdzv-id`.
    :param nnodes: `--nnodes` (MIN:MAX).
    :param launcher: "torchspot" (our launcher) or "torchrun" (stock).
    :param nproc_per_node: workers per node (`--nproc-per-node`: the GPUs of a node).
    """

    workdir: Path
    backend: str
    endpoint: str
    run_id: str
    nnodes: str
    launcher: str = "torchspot"
    nproc_per_node: int = 1
    rdzv_conf: str = ""
    max_restarts: int = 100
    steps: int = 200
    ckpt_every: int = 10
    step_time: float = 0.05
    monitor_interval: float = 0.2
    extra_env: dict[str, str] = field(default_factory=dict)
    program: list[str] = field(default_factory=list)
    """The worker program and its arguments (default: the toy program with the fields above)."""
    toy_args: list[str] = field(default_factory=list)
    """More of the toy program's flags (`--in-place`, `--stop-file`...)."""
    local_addrs: dict[str, str] = field(default_factory=dict)
    """`--local-addr` of the nodes named here (any other: `node_addr`). torch ranks a round's nodes by
    address first, then agent pid: addresses of the loopback net (127.0.0.0/8) fix who is rank 0."""
    node_addr: str = NODE_ADDR
    """`--local-addr` of a node not in `local_addrs` (a copy of the job with another one, through
    `dataclasses.replace`, ranks the nodes started with it where their names are not known ahead)."""

    @property
    def events(self) -> Path:
        """The JSON-lines event file rank 0 appends to."""
        return self.workdir / "events.jsonl"

    @property
    def stop_file(self) -> Path:
        """The toy program stops at the step this file names once it exists (`stop_after`)."""
        return self.workdir / "stop"

    @property
    def ckpt_dir(self) -> Path:
        """Where the toy program keeps its checkpoints."""
        return self.workdir / "ckpt"

    def command(self, local_addr: str = NODE_ADDR) -> list[str]:
        """The launcher command line for one node (pure)."""
        cmd = [
            *LAUNCHERS[self.launcher],
            "--nnodes", self.nnodes,
            "--nproc-per-node", str(self.nproc_per_node),
            "--rdzv-backend", self.backend,
            "--rdzv-endpoint", self.endpoint,
            "--rdzv-id", self.run_id,
            "--max-restarts", str(self.max_restarts),
            "--monitor-interval", str(self.monitor_interval),
            "--local-addr", local_addr,
        ]  # fmt: skip
        if self.rdzv_conf:
            cmd += ["--rdzv-conf", self.rdzv_conf]
        if self.program:
            return [*cmd, *self.program]
        return [
            *cmd,
            "-m", TOY_MODULE,
            "--steps", str(self.steps),
            "--ckpt-dir", str(self.ckpt_dir),
            "--ckpt-every", str(self.ckpt_every),
            "--step-time", str(self.step_time),
            "--events", str(self.events),
            "--stop-file", str(self.stop_file),
            *self.toy_args,
        ]  # fmt: skip


class LocalNode:
    """One simulated node: an agent process tree with its own log file."""

    def __init__(self, name: str, job: JobConfig) -> None:
        self.name = name
        self.job = job
        self.log_path = job.workdir / f"node-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp: Path | None = None
        """The node's TMPDIR (`node_tmp`), removed once its processes ended."""

    def start(self) -> None:
        """Start the agent (which starts its workers)."""
        self.job.workdir.mkdir(parents=True, exist_ok=True)
        self._remove_tmp()  # a node started again gets a fresh one
        self.tmp = node_tmp()
        env = {
            **SHARED_CORES_ENV,
            **os.environ,
            "TORCHSPOT_NODE": self.name,
            "NODE_NAME": self.name,  # as the operator sets it in a pod (the downward API)
            "PYTHONUNBUFFERED": "1",
            # A node's snapshot is its machine's; in the job's folder a killed node's file goes with the job
            # rather than piling up in this machine's /tmp (the kubelet's pods do the same).
            SNAPSHOT_DIR_ENV: str(self.job.workdir / "snapshots"),
            "TMPDIR": str(self.tmp),
            **self.job.extra_env,
        }
        command = self.job.command(self.job.local_addrs.get(self.name, self.job.node_addr))
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def pid(self) -> int:
        """The agent's process id."""
        if self.proc is None:
            raise RuntimeError(f"node {self.name} was never started")
        return self.proc.pid

    def kill(self) -> None:
        """Hard loss: SIGKILL the whole tree at once."""
        kill_tree(self.pid)
        self.wait(10)
        self._remove_tmp()

    def terminate(self, grace: float) -> None:
        """Eviction with notice: SIGTERM to the agent (as the kubelet sends it), then
        SIGKILL to whatever of the tree is left after `grace` seconds."""
        os.kill(self.pid, signal.SIGTERM)
        try:
            self.wait(grace)
        except subprocess.TimeoutExpired:
            kill_tree(self.pid)
            self.wait(10)
        self._remove_tmp()

    def freeze(self) -> None:
        """Freeze: SIGSTOP the whole tree; its sockets stay open."""
        signal_tree(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Resume a frozen node."""
        signal_tree(self.pid, signal.SIGCONT)

    def poll(self) -> int | None:
        """The agent's exit code, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float) -> int:
        """Wait for the agent to exit and return its exit code."""
        if self.proc is None:
            raise RuntimeError(f"node {self.name} was never started")
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """Clean-up: kill whatever is left of the tree (a frozen one as it is: `kill_tree`)."""
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.pid)
            self.proc.wait(timeout=10)
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def log_tail(self, lines: int = 40) -> str:
        """The end of the node's log, for failure messages."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


NodeFactory = Callable[[JobConfig, int], list[LocalNode]]
"""Starts `n` more nodes of a job and returns them (the tests' `nodes` fixture)."""


def stop_after(job: JobConfig, steps: int) -> int:
    """End the toy program's run `steps` steps after the newest one logged (every rank reads the file
    at each step, so `steps` must leave them a second or so to see it); returns the last step."""
    last = last_step_before(read_events(job.events), time.time()) + steps
    job.stop_file.write_text(str(last))
    return last


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events so far (a partially written last line is ignored)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `condition` until it returns something truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def ranks_of_group(events: Sequence[dict[str, Any]], group: str) -> dict[int, str]:
    """Rank -> node name for one worker group, from the `joined` events its ranks wrote."""
    return {e["rank"]: e["node"] for e in events if e["event"] == "joined" and e["group"] == group}


def first_step_at(events: Sequence[dict[str, Any]], world: int, after: float) -> dict[str, Any] | None:
    """The first completed step at world size `world` after time `after`."""
    for event in events:
        if event["event"] == "step" and event["world"] == world and event["t"] > after:
            return event
    return None


def last_step_before(events: Sequence[dict[str, Any]], before: float) -> int:
    """The highest step completed before time `before` (0 if none)."""
    steps = [e["step"] for e in events if e["event"] == "step" and e["t"] <= before]
    return max(steps, default=0)


def resumed_step_after(events: Sequence[dict[str, Any]], after: float) -> int | None:
    """The step the first worker group started after time `after` resumed from."""
    for event in events:
        if event["event"] == "start" and event["t"] > after:
            return int(event["step"])
    return None
