"""torchspot-run with the etcd-v3 backend: real etcd, real agents, real gloo workers.

Faults are applied to whole process trees (agent and workers): SIGKILL for a node
that vanishes, SIGSTOP for a node that hangs with its sockets open.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from torchspot_lab.azurite import Azurite
from torchspot_lab.datasets import write_synthetic_imagenet
from torchspot_lab.etcd import EtcdServer, free_port
from torchspot_lab.local import (
    JobConfig,
    LocalNode,
    NodeFactory,
    first_step_at,
    last_step_before,
    ranks_of_group,
    read_events,
    resumed_step_after,
    stop_after,
    wait_for,
)
from torchspot_operator.certs import etcd_certificates
from torchspot_trainer import NODE_FAULT_EXIT
from torchspot_trainer.checkpoint.storage import open_storage
from torchspot_trainer.fork_server import THREADS_ENV, thread_count
from torchspot_trainer.launch import staging_command
from torchspot_trainer.rendezvous import milestones
from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError, EtcdTls

pytestmark = pytest.mark.slow

# Generous bounds for the waits below: failing them means "did not happen", not "slow".
# gloo's own collective timeout is 30 minutes, so a frozen peer is only noticed in
# time if the rendezvous notices it.
FORM = 90.0
RECOVER = 60.0


def _job(tmp_path: Path, etcd: EtcdServer, run_id: str, **overrides: Any) -> JobConfig:
    # Steps enough to outlast any test; a test ends its run with stop_after once it has seen what it needs.
    settings: dict[str, Any] = {"nnodes": "1:3", "steps": 100_000}
    settings.update(overrides)
    return JobConfig(
        workdir=tmp_path / "job",
        backend="etcd-v3",
        endpoint=etcd.endpoint,
        run_id=run_id,
        **settings,
    )


def _events(job: JobConfig) -> list[dict[str, Any]]:
    return read_events(job.events)


def _await_world(
    job: JobConfig, world: int, after: float, timeout: float, show: list[LocalNode] | None = None
) -> dict[str, Any]:
    """The first step at `world` after `after`; on a timeout, say how training ended and show `show`'s logs."""
    try:
        found: dict[str, Any] = wait_for(
            lambda: first_step_at(_events(job), world, after), timeout, f"a step at world size {world}"
        )
    except TimeoutError as exc:
        done = [e for e in _events(job) if e["event"] == "done"]
        logs = "\n".join(f"--- {n.name}\n{n.log_tail()}" for n in show or [])
        pytest.fail(f"{exc}; done events: {done}\n{logs}")
    return found


def _ranks_of_group(job: JobConfig, group: str) -> list[int]:
    return sorted(ranks_of_group(_events(job), group))


def _finish(nodes: list[LocalNode], timeout: float = 120) -> list[int]:
    codes = []
    for node in nodes:
        try:
            codes.append(node.wait(timeout))
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {node.name} did not finish:\n{node.log_tail()}")
    return codes


def _done(job: JobConfig) -> dict[str, Any]:
    done = [e for e in _events(job) if e["event"] == "done"]
    assert done, "training never completed"
    return done[-1]


def _three_then_pick(
    job: JobConfig, nodes: NodeFactory, rank: int
) -> tuple[dict[str, Any], LocalNode, list[LocalNode]]:
    """Start three nodes, wait until all train together, and pick the node holding `rank`.

    Returns the group's first step at world size 3, that node, and the other two.
    """
    started = nodes(job, 3)
    three = _await_world(job, 3, 0, FORM)
    wait_for(lambda: len(_ranks_of_group(job, three["group"])) == 3, 10, "all ranks to join")
    return three, *_pick(job, three["group"], started, rank)


def _pick(job: JobConfig, group: str, started: list[LocalNode], rank: int) -> tuple[LocalNode, list[LocalNode]]:
    """The node of `started` holding `rank` in `group`, and the others."""
    name = ranks_of_group(_events(job), group)[rank]
    picked = next(n for n in started if n.name == name)
    return picked, [n for n in started if n is not picked]


def _assert_same_group_trains_on(job: JobConfig, formed: dict[str, Any], *, since: float, steps: int, why: str) -> None:
    """Training goes on for `steps` more steps after `since`, all in the worker group `formed` began."""
    reached = last_step_before(_events(job), since)
    wait_for(lambda: last_step_before(_events(job), time.time()) >= reached + steps, 60, "training to go on")
    groups_after = {e["group"] for e in _events(job) if e["event"] == "step" and e["t"] > since}
    assert groups_after == {formed["group"]}, why


@pytest.mark.slow(seconds=25)
def test_forms_group_admits_late_joiner_and_survives_losing_the_rank0_node(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """Two nodes form a group, a third joins it, then the node whose worker is rank 0 (and which would
    host c10d's store) is killed: the survivors re-form without it, lose no rendezvous state, and
    resume from a checkpoint. One job for the three (each used to start its own: 17 s of CPU apiece).
    First a node alone, as the last node of a job whose others were all evicted: it fails at its join
    timeout with a message that says so (torch's says nothing), having left the rendezvous, and the
    nodes that come back form it (test_backend.py's agent test shows why it leaves, not closes).

    With `--max-restarts 0`: the survivors' workers fail at the kill (their peer's socket closed)
    before their agents see the change, and a failure that a peer's loss explains is not counted (it
    used one restart of every survivor, and a cohort that had lived through as many losses as its
    budget gave up together). Before the joiner, a node that cannot run the program comes (its worker
    exits with the node-fault code at once, as the trainer does on a GPU it cannot use): it is not
    restarted there, its agent leaves and exits with that code, and the others go on without it
    (before, the agent restarted it up to --max-restarts times, each a departure and a join for all)."""
    # The run ends when the test says (stop_after): with a fixed 300 steps, two nodes once finished
    # before a joiner starting on loaded CI cores was admitted. The nodes are named n0, n1... in the
    # order they start: n3 is the node that cannot run the program.
    job = _job(tmp_path, etcd, run_id, nnodes="2:3", max_restarts=0, toy_args=["--bad-node", "n3"])
    (alone,) = nodes(replace(job, rdzv_conf="join_timeout=3"), 1)
    assert alone.wait(60) != 0
    said = alone.log_path.read_text(errors="replace")
    assert "no round of at least 2 node(s) formed within the join timeout" in said, said[-3000:]
    assert "the others go on without it" in said, said[-3000:]
    first = nodes(job, 2)
    two = _await_world(job, 2, 0, FORM)
    wait_for(lambda: len(_ranks_of_group(job, two["group"])) == 2, 10, "both ranks to join")
    assert _ranks_of_group(job, two["group"]) == [0, 1]
    # A program other than our trainer keeps torch's NCCL watchdog: torchrun's agent gives each worker
    # TORCH_NCCL_ASYNC_ERROR_HANDLING=1, and the CUDA-error rethrow stays torch's (on). (Our trainer's:
    # test_training.py.)
    joined = [e for e in _events(job) if e["event"] == "joined"]
    assert joined
    torchs = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_RETHROW_CUDA_ERRORS": None}
    assert all(e["nccl"] == torchs for e in joined)

    (bad,) = nodes(job, 1)
    assert bad.wait(60) == NODE_FAULT_EXIT, bad.log_tail()
    assert "this node cannot run the program" in bad.log_path.read_text(errors="replace")
    assert [e["node"] for e in _events(job) if e["event"] == "node-fault"] == ["n3"]  # once: not restarted there
    _await_world(job, 2, time.time(), RECOVER, show=first)  # the others go on without it
    joined_at = time.time()
    late = nodes(job, 1)
    started = first + late
    three = _await_world(job, 3, joined_at, RECOVER, show=started)
    wait_for(lambda: len(_ranks_of_group(job, three["group"])) == 3, 10, "all three ranks to join")
    assert _ranks_of_group(job, three["group"]) == [0, 1, 2]
    # Rank 0's agent reports each round where the operator reads it.
    client = etcd.client()
    try:
        reported = wait_for(
            lambda: milestones.read(client, run_id).get("round", {}).get("nodes") == 3, 10, "round report"
        )
    finally:
        client.close()
    assert reported
    # Scale-up is a membership change, not a failure: training resumes from a checkpoint.
    assert resumed_step_after(_events(job), joined_at) is not None

    # Past a checkpoint of the group of three, then its rank 0's node is gone without a word.
    wait_for(lambda: last_step_before(_events(job), time.time()) >= three["step"] + 2 * job.ckpt_every, 60, "steps")
    victim, survivors = _pick(job, three["group"], started, 0)
    fault = time.time()
    victim.kill()
    _await_world(job, 2, fault, RECOVER, show=survivors)
    resumed = resumed_step_after(_events(job), fault)
    assert resumed is not None
    assert resumed % job.ckpt_every == 0
    assert resumed <= last_step_before(_events(job), fault)

    last = stop_after(job, 20)
    assert _finish(survivors) == [0, 0]
    done = _done(job)
    assert (done["world"], done["step"]) == (2, last)


@pytest.mark.slow(seconds=17)
def test_frozen_node_is_detected_by_heartbeat_and_fenced_out(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    job = _job(tmp_path, etcd, run_id)
    # Freeze a node that does not hold rank 0, so the old group's rank 0 keeps logging.
    three, frozen, survivors = _three_then_pick(job, nodes, rank=2)

    fault = time.time()
    frozen.freeze()
    two = _await_world(job, 2, fault, RECOVER)

    thawed = time.time()
    frozen.thaw()
    # The running group is untouched: after the thaw, no step is logged by the old
    # three-node group, and the group of two keeps counting up without going back.
    wait_for(lambda: last_step_before(_events(job), time.time()) >= two["step"] + 30, 60, "30 more steps")
    after = [e for e in _events(job) if e["event"] == "step" and e["t"] > thawed]
    assert all(e["group"] != three["group"] for e in after)
    current = [e["step"] for e in after if e["group"] == two["group"]]
    assert current == sorted(current)

    # The thawed node either joins a later round or stops with an error; the job finishes.
    last = stop_after(job, 20)
    codes = _finish(survivors, timeout=180)
    assert codes == [0, 0]
    assert _done(job)["step"] == last
    frozen_code = frozen.wait(60)
    rejoined = any(e["event"] == "joined" and e["node"] == frozen.name and e["t"] > thawed for e in _events(job))
    assert rejoined or frozen_code != 0


@pytest.mark.slow(seconds=25)
def test_a_finished_run_deletes_its_keys_an_abandoned_rerun_starts_clean_and_its_keys_expire(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """A run that finishes deletes its rendezvous keys (but its status records), so a rerun under the same
    id starts clean (it trains from scratch, not from the first run's state); a run whose nodes all vanish
    leaves keys that expire by their lease."""
    client = etcd.client()
    prefix = f"/torchspot/rdzv/{run_id}/"

    def rendezvous_keys() -> set[str]:  # the run's status records stay on leases of their own (REPORT_TTL)
        return {key for key in client.get_prefix(prefix) if not key.startswith(milestones.milestone_prefix(run_id))}

    job = _job(tmp_path, etcd, run_id, nnodes="2:2", steps=40)
    assert _finish(nodes(job, 2)) == [0, 0]
    assert _done(job)["step"] == 40
    assert rendezvous_keys() == set()

    rerun = _job(tmp_path / "again", etcd, run_id, nnodes="2:2", rdzv_conf="lease_ttl=6")
    started = nodes(rerun, 2)
    _await_world(rerun, 2, 0, FORM)
    assert resumed_step_after(_events(rerun), 0) == 0
    for node in started:
        node.kill()
    assert rendezvous_keys()
    wait_for(lambda: not rendezvous_keys(), 30, "the abandoned run's keys to expire")


IN_PLACE_RECOVER = 10.0
"""The most a re-form in place may take here: failing it means it fell back (its workers waited 30 s for
a round they would accept, then were restarted), not that it was slow."""


def _workers(job: JobConfig, group: str) -> dict[str, int]:
    """Node name -> the process id of its worker in worker group `group` (in place: a generation)."""
    return {e["node"]: e["pid"] for e in _events(job) if e["event"] == "joined" and e["group"] == group}


@pytest.mark.slow(seconds=35)
def test_etcd_restarted_or_wiped_keeps_the_job_running_and_its_changes_re_form_in_place(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """etcd down for longer than a silent node is given, then back without its data (it lost its
    disk, as the managed etcd does when its pod moves): neither restarts the workers, and the changes
    after it, a kill and a join, re-form the workers in place, in generations numbered after the one
    they trained in. Before, the rounds began again at 0 after the wipe: the workers refused them, and
    every change waited 30 s and restarted every worker. (The agents restore the round: both paths
    alike, test_backend.py.) On the way, the agents report that the toy's workers use the CPU: the toy
    reports no steps, and the operator's stall rule reads that instead."""
    job = _job(tmp_path, etcd, run_id, toy_args=["--in-place"])
    began = time.time()
    started = nodes(job, 3)
    three = _await_world(job, 3, 0, FORM)
    wait_for(lambda: len(_workers(job, three["group"])) == 3, 10, "all ranks to join")
    pids = _workers(job, three["group"])

    outage = time.time()
    etcd.restart(down_for=5.0)  # longer than the 3 s a silent node is given
    _assert_same_group_trains_on(job, three, since=outage, steps=150, why="the outage restarted the workers")
    # The toy reports no steps: its agents report that its workers use the CPU (the operator's stall rule).
    client = etcd.client()
    try:
        activity = wait_for(lambda: milestones.read(client, run_id).get("activity"), 10, "an activity report")
    finally:
        client.close()
    assert activity["at"] >= int(began)

    wiped = time.time()
    etcd.restart(wipe=True)
    _assert_same_group_trains_on(
        job, three, since=wiped, steps=60, why="losing etcd's data alone restarted the workers"
    )

    fault = time.time()
    started[2].kill()
    two = _await_world(job, 2, fault, RECOVER, show=started[:2])
    assert two["t"] - fault < IN_PLACE_RECOVER, "the loss after the wipe fell back to a restart"
    assert _workers(job, two["group"]) == {n.name: pids[n.name] for n in started[:2]}, "a survivor was restarted"
    assert int(two["group"]) > int(three["group"])

    joined = time.time()
    (joiner,) = nodes(job, 1)
    back = _await_world(job, 3, joined, RECOVER, show=[*started[:2], joiner])
    again = _workers(job, back["group"])
    assert {name: again[name] for name in pids if name in again} == {n.name: pids[n.name] for n in started[:2]}
    assert int(back["group"]) > int(two["group"])
    last = stop_after(job, 20)
    assert _finish([*started[:2], joiner]) == [0, 0, 0]
    assert _done(job)["step"] == last


@pytest.mark.slow(seconds=15)
def test_an_etcd_with_mutual_tls_admits_only_holders_of_the_jobs_certificate(
    tmp_path: Path, run_id: str, nodes: NodeFactory
) -> None:
    """The operator's managed etcd: its own CA, `--client-cert-auth`. With the job's certificate the
    launcher forms a group, reports progress and recovers as over plain gRPC; without it, or with a
    certificate another job's CA signed, a client is refused (the rendezvous state it would read is
    unpickled by torch: reading or writing it must take the job's credentials)."""
    bundle = etcd_certificates("tls-etcd", "default")
    server = EtcdServer(tmp_path / "etcd-data", log_path=tmp_path / "etcd.log", tls=bundle)
    server.start()
    try:
        files = server.tls_files()
        conf = f"cacert={files['ca.crt']},cert={files['client.crt']},key={files['client.key']}"
        job = _job(tmp_path, server, run_id, nnodes="1:2", rdzv_conf=conf)
        started = nodes(job, 2)
        _await_world(job, 2, 0, FORM)
        client = server.client()
        try:
            wait_for(lambda: milestones.read(client, run_id).get("round", {}).get("nodes") == 2, 10, "round report")
        finally:
            client.close()
        fault = time.time()
        started[1].kill()
        _await_world(job, 1, fault, RECOVER)
        stop_after(job, 20)
        assert _finish(started[:1]) == [0]
        # Its JSON gateway is off: etcd's own dials of it with the server's certificate (serverAuth only)
        # were refused and logged every few seconds as if TLS were broken.
        assert "incompatible key usage" not in server.log_path.read_text(errors="replace")

        other = etcd_certificates("other-etcd", "default")
        strangers = {
            "plain gRPC": None,
            "TLS without a client certificate": EtcdTls(bundle.ca),
            "another job's certificate": EtcdTls(bundle.ca, other.client.cert, other.client.key),
        }
        for why, tls in strangers.items():
            stranger = EtcdClient("127.0.0.1", server.port, request_timeout=1.0, tls=tls)
            try:
                stranger.wait_reachable(2.0)
            except EtcdError:
                pass  # refused, as it must be
            else:
                pytest.fail(f"the job's etcd admitted a client with {why}")
            finally:
                stranger.close()
    finally:
        server.stop()


def test_the_data_set_is_staged_before_the_agent_joins(azurite: Azurite, tmp_path: Path) -> None:
    """An ImageNet folder under az:// is copied and indexed by the node's agent before the rendezvous
    (here unreachable: the launcher stops there, the data set already on the node), so a joiner's
    copy never holds a round's set-up; a copy that fails stops the launcher before it joins, saying
    so. Real torchspot-run, real Blob API calls against Azurite."""
    source = tmp_path / "imagenet"
    write_synthetic_imagenet(source, classes=2, per_class=6, size=48)
    prefix = f"az://datasets/{uuid.uuid4().hex}"
    storage = open_storage(prefix, azurite.env())
    files = sorted(p for p in source.rglob("*") if p.is_file())
    for path in files:
        storage.put(path.relative_to(source).as_posix(), path.read_bytes())
    endpoint = f"127.0.0.1:{free_port()}"
    cache = tmp_path / "cache"
    cmd = [
        sys.executable, "-m", "torchspot_trainer.launch", "--nnodes", "1:2", "--rdzv-backend", "etcd-v3",
        "--rdzv-endpoint", endpoint, "--rdzv-id", "staged", "--rdzv-conf", "connect_timeout=2",
        "-m", "torchspot_trainer", "--dataset", "imagenet", "--model", "resnet50", "--data", prefix,
        "--data-cache", str(cache),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=os.environ | azurite.env())
    assert done.returncode != 0
    assert f"etcd at {endpoint} is unreachable" in done.stderr  # the join came after the staging
    assert "torchspot-run: staging: train: 12 images in 2 classes indexed" in done.stderr, done.stderr
    for path in files:
        assert (cache / path.relative_to(source)).read_bytes() == path.read_bytes()
    assert len(list((cache / "index").glob("index-*/"))) == 2  # train and val, for the trainer to map

    cmd[cmd.index(prefix)] = f"az://missing-{uuid.uuid4().hex}/imagenet"  # no such container
    cmd[cmd.index(str(cache))] = str(tmp_path / "cache-2")
    env = os.environ | azurite.env()
    failed = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert failed.returncode != 0
    assert "torchspot-run: error: staging the data set failed (exit 1); see above" in failed.stderr, failed.stderr
    assert "cannot list" in failed.stderr  # the staging's own message, above ours
    assert "unreachable" not in failed.stderr  # it never tried to join


@pytest.mark.parametrize(
    ("script", "trainer_args", "environ", "staged"),
    [
        ("torchspot_trainer", ["--dataset", "cifar10", "--data", "az://datasets/cifar10"], {}, True),
        ("torchspot_trainer", ["--dataset=imagenet", "--data=/mnt/imagenet"], {}, True),  # its index
        ("torchspot_trainer", ["--dataset", "cifar10", "--data", "/data/cifar.tar.gz"], {}, False),
        ("torchspot_trainer", ["--dataset", "digits"], {}, False),
        ("torchspot_trainer", [], {"TORCHSPOT_DATA": "az://datasets/x"}, True),  # the operator's way
        ("torchspot_lab.toy_train", ["--data", "az://datasets/x"], {}, False),  # not our trainer
    ],
)
def test_staging_runs_for_our_trainer_with_something_to_stage(
    script: str, trainer_args: list[str], environ: dict[str, str], staged: bool
) -> None:
    args = argparse.Namespace(module=True, training_script=script, no_python=False, training_script_args=trainer_args)
    command = staging_command(args, environ)
    assert (command is not None) == staged
    if command is not None:
        assert command[1:3] == ["-m", "torchspot_trainer.data.stage"]
        assert command[3:] == trainer_args


SCRIPT = """
import os, signal, sys
from functools import partial
import torch.distributed as dist
from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.checkpoint.storage import LocalStorage
dist.init_process_group("gloo")
ones = __import__("torch").ones(2)
dist.all_reduce(ones)
server = os.getppid()
name = open(f"/proc/{server}/comm").read().strip()
agent = open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[1]  # the server's parent
agent_line = open(f"/proc/{agent}/cmdline").read().replace("\\0", " ")
folder = sys.argv[1] + ".ckpt"
saver = CheckpointManager(LocalStorage(folder), reopen=partial(LocalStorage, folder))
helper = saver.saver_pid
sibling = open(f"/proc/{helper}/stat").read().rsplit(")", 1)[1].split()[1] == str(server)
with open(sys.argv[1], "w") as out:
    out.write(f"{__name__}|{int(ones.sum())}|{sys.argv[2:]}|{name}|{agent_line}|{helper}|{sibling}")
dist.destroy_process_group()
if os.environ.get("SCRIPT_EXIT", "0") != "0":
    os.kill(os.getpid(), signal.SIGKILL)  # gone without a word: its saver must not outlive it
saver.close()
sys.exit(0)
"""


CUDA_FORK = Path(__file__).with_name("cuda_fork")
"""A sitecustomize that gives the CPU build of torch a CUDA build's fork semantics (its docstring)."""


@pytest.mark.slow(seconds=20)
def test_a_script_runs_in_a_forked_worker_as_python_would_run_it(tmp_path: Path, etcd: EtcdServer) -> None:
    """Any program under etcd-v3 is forked from the warm server (not started as a new interpreter), itself
    a fork of the agent: a script runs as __main__ with its arguments, its exit status 0 is a success and
    a worker's death the launcher's failure. A checkpoint saver it starts is forked from the same server
    (forks.py: no torch import of its own), and ends with the worker that started it. With what a CUDA
    build does to fork (CUDA_FORK: CI has the CPU build): the agent forked its server after torchrun's
    config asked torch.cuda.is_available(), and every worker refused to start (refuse_bad_fork)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    path = os.pathsep.join(p for p in (str(CUDA_FORK), os.environ.get("PYTHONPATH", "")) if p)
    runs = []
    for exit_code in (0, 3):
        out = tmp_path / f"out-{exit_code}"
        cmd = [
            sys.executable, "-m", "torchspot_trainer.launch", "--nnodes", "1", "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", f"script-{exit_code}", "--max-restarts", "0",
            str(script), str(out), "--epochs", "2",
        ]  # fmt: skip
        env = os.environ | {"SCRIPT_EXIT": str(exit_code), "PYTHONPATH": path}
        runs.append(subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env))
        assert out.exists(), runs[-1].stderr[-2000:]  # the worker ran
        name, total, argv, server, agent, saver, saver_forked = out.read_text().split("|")
        assert (name, total, argv) == ("__main__", "2", "['--epochs', '2']")
        # The warm server's child, not the agent's new interpreter; the server a fork of the agent (it
        # shares the agent's imports), not a new interpreter of multiprocessing's.
        assert server == "torchspot-forks"
        assert "torchspot_trainer.launch" in agent
        assert saver_forked == "True"  # the saver is the worker's sibling, forked by the same server
        saver_pid = int(saver)
        wait_for(lambda: not psutil.pid_exists(saver_pid), 10, "the saver to end with its worker")  # noqa: B023
    assert runs[0].returncode == 0, runs[0].stderr[-2000:]
    assert runs[1].returncode != 0


THREADS = """
import os, torch
with open(os.environ["OUT"] + os.environ["LOCAL_RANK"], "w") as out:
    out.write(f"{os.environ.get('OMP_NUM_THREADS')}|{torch.get_num_threads()}")
"""


@pytest.mark.slow(seconds=10)
def test_forked_workers_size_their_thread_pool_as_torchrun_asks(tmp_path: Path, etcd: EtcdServer) -> None:
    """Two workers a node and no OMP_NUM_THREADS in the pod: torchrun asks one torch thread each, and a
    new interpreter's torch takes it as it starts. Forked from the warm server, each kept the pool of
    the agent's torch, a thread per core (2 here), until the worker's entry sized it (take_thread_count)."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    env = {k: v for k, v in os.environ.items() if k != THREADS_ENV} | {"OUT": str(tmp_path / "threads-")}
    cmd = [
        sys.executable, "-m", "torchspot_trainer.launch", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "threads", "--max-restarts", "0",
        str(script),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(tmp_path / f"threads-{rank}").read_text() for rank in (0, 1)] == ["1|1", "1|1"]
    assert thread_count({THREADS_ENV: "4"}) == 4
    assert thread_count({THREADS_ENV: "0"}) is None  # not a count: torch's default stands
    assert thread_count({}) is None


def test_unreachable_endpoint_fails_in_bounded_time_naming_it(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable, "-m", "torchspot_trainer.launch", "--nnodes", "1:2",
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", "unreachable",
        "--rdzv-conf", "connect_timeout=2", "-m", "torchspot_lab.toy_train",
        "--ckpt-dir", str(tmp_path), "--events", str(tmp_path / "e.jsonl"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert f"torchspot-run: error: etcd at {endpoint} is unreachable" in done.stderr
    assert not (tmp_path / "e.jsonl").exists()
