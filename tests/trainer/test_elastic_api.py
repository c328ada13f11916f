"""`torchspot.elastic` as a script calls it, in one process: the restart path's loop on a real
one-rank gloo group, its checkpoints and resume, the errors of a call in the wrong order, and the
combinations refused at start. (In place, under real agents: tests/lab/examples.py, and here a loop whose
gradient scaler skips a step's update.)"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchspot.elastic
from tests.trainer import scaler_loop, thaw_loop
from torchspot import elastic
from torchspot_lab.etcd import EtcdServer, free_port
from torchspot_lab.local import JobConfig, NodeFactory, read_events, wait_for
from torchspot_trainer import REPLICA_GROUP_ENV, REPLICA_GROUP_SIZE_ENV
from torchspot_trainer.checkpoint.manager import CheckpointManager, step_dir
from torchspot_trainer.checkpoint.storage import open_storage
from torchspot_trainer.elastic.heal import Row, holders_between_steps, source_of, trainers_beside
from torchspot_trainer.elastic.leaving import node_snapshot
from torchspot_trainer.elastic.metrics import METRICS_PORT_ENV, WorkerMetrics
from torchspot_trainer.elastic.records import write_record
from torchspot_trainer.elastic.riders import Line, pack, unpack
from torchspot_trainer.elastic.settings import choose_path
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.recovery.snapshot import LocalSnapshot, default_path


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The environment torchrun gives a worker of a world of one; the default group destroyed after."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(PEER_LOST_ENV, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


CPU = torch.device("cpu")


def _loop(ckpt: Path, steps: int, events: Path, device: torch.device = CPU) -> tuple[elastic.Manager, torch.nn.Linear]:
    """The examples' loop (examples/ddp/train.py), on a linear model on `device`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = elastic.Manager(
        state_dict=lambda: {"model": model.state_dict(), "optimizer": inner.state_dict()},
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optimizer"])),
        checkpoint_uri=str(ckpt), checkpoint_every=5, events_file=events, device=device,
    )  # fmt: skip
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, inner)
    sampler = elastic.ElasticSampler(manager, 40, global_batch=8)
    inputs, labels = torch.randn(40, 4, generator=torch.Generator().manual_seed(1)), torch.arange(40) % 2
    inputs, labels = inputs.to(device), labels.to(device)
    while manager.current_step() < steps:
        optimizer.zero_grad()
        batch = sampler.indices()
        F.cross_entropy(ddp(inputs[batch]), labels[batch]).backward()  # type: ignore[no-untyped-call]
        assert optimizer.step() is True
    manager.close()
    return manager, model


def test_the_public_names_are_one_import_and_typed() -> None:
    assert sorted(torchspot.elastic.__all__) == [
        "ApiOrderError", "DistributedDataParallel", "ElasticSampler", "GradScaler", "Manager", "OptimizerWrapper",
        "Refused",
    ]  # fmt: skip
    assert all(getattr(torchspot.elastic, name).__doc__ for name in torchspot.elastic.__all__)
    assert (Path(torchspot.elastic.__file__).parent / "py.typed").exists()


@pytest.mark.usefixtures("one_rank")
def test_outside_torchspot_run_a_loop_takes_the_restart_path_checkpoints_and_resumes(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    manager, model = _loop(tmp_path / "ckpt", 12, events)
    assert manager.in_place is False
    assert manager.resumed_from == "start"
    dist.destroy_process_group()
    # A restart: the same loop resumes from the final checkpoint (step 12) and trains on to 15.
    again, resumed = _loop(tmp_path / "ckpt", 15, events)
    assert again.resumed_from == "checkpoint"
    records = [line for line in events.read_text().splitlines() if '"event": "step"' in line]
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in records]
    assert steps == [*range(1, 13), 13, 14, 15]  # 12 steps, then the resumed run's 3: none redone
    assert '"samples": [' in records[0]
    assert not torch.equal(model.weight, resumed.weight)


@pytest.mark.cuda
@pytest.mark.usefixtures("one_rank")
def test_on_a_gpu_the_restart_path_trains_checkpoints_and_resumes_on_nccl(tmp_path: Path) -> None:
    """The same loop with its model and data on the GPU: the manager makes an NCCL default group for DDP,
    checkpoints the device state to host memory and loads it back onto the device at the resume."""
    device = torch.device("cuda", 0)
    events = tmp_path / "events.jsonl"
    manager, model = _loop(tmp_path / "ckpt", 7, events, device)
    assert manager.device == device
    assert dist.get_backend() == "nccl"
    dist.destroy_process_group()
    again, resumed = _loop(tmp_path / "ckpt", 9, events, device)
    assert again.resumed_from == "checkpoint"
    assert resumed.weight.device == device
    assert not torch.equal(model.weight, resumed.weight)


@pytest.mark.usefixtures("one_rank")
def test_calls_in_the_wrong_order_say_what_to_call_first(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None)
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, inner)
    sampler = elastic.ElasticSampler(manager, 10, global_batch=2)
    with pytest.raises(
        elastic.ApiOrderError, match=r"the forward pass before the step began: call optimizer\.zero_grad"
    ):
        ddp(torch.zeros(1, 4))
    with pytest.raises(elastic.ApiOrderError, match=r"optimizer\.step\(\) before the step began"):
        optimizer.step()
    with pytest.raises(elastic.ApiOrderError, match=r"ElasticSampler\.indices\(\) before the step began"):
        sampler.indices()
    optimizer.zero_grad()
    with pytest.raises(elastic.ApiOrderError, match="make it before the loop begins"):
        elastic.ElasticSampler(manager, 10, global_batch=2)
    with pytest.raises(elastic.ApiOrderError, match=r"heed_notices\(\) inside a step: call it between optimizer"):
        manager.heed_notices()
    with pytest.raises(elastic.ApiOrderError, match=r"commit\(\) without a step allowed to commit: call should_"):
        manager.commit()
    assert manager.should_commit()  # a loop of its own that forgets to say the update was applied:
    with pytest.raises(elastic.ApiOrderError, match=r"allowed but the manager was not told: call manager\.commit"):
        optimizer.zero_grad()
    manager.commit()
    assert manager.current_step() == 1
    manager.close()
    with pytest.raises(elastic.ApiOrderError, match=r"no step after close\(\)"):
        optimizer.zero_grad()


@pytest.mark.parametrize(
    ("in_place", "under_ours", "chosen"),
    [(None, True, True), (None, False, False), (False, True, False), (True, True, True)],
)
def test_in_place_is_the_default_wherever_the_launcher_hands_rounds_over(
    in_place: bool | None, under_ours: bool, chosen: bool
) -> None:
    environ = {PEER_LOST_ENV: "/tmp/x"} if under_ours else {}
    path, why = choose_path(in_place, environ)
    assert path is chosen
    assert why.startswith("in place" if chosen else "the restart path")


@pytest.mark.parametrize(
    ("environ", "own_group", "why"),
    [
        ({PEER_LOST_ENV: "/tmp/x"}, False, "in place"),
        ({PEER_LOST_ENV: "/tmp/x", REPLICA_GROUP_SIZE_ENV: "1"}, False, "in place"),
        ({PEER_LOST_ENV: "/tmp/x", REPLICA_GROUP_SIZE_ENV: "2"}, False, "the restart path: replica groups of 2 nodes"),
        ({PEER_LOST_ENV: "/tmp/x", REPLICA_GROUP_SIZE_ENV: "2", REPLICA_GROUP_ENV: "a"}, False, "in place"),
        ({PEER_LOST_ENV: "/tmp/x"}, True, "the restart path: the script made torch's default process group"),
        ({}, False, "the restart path: in place needs torchspot-run"),
    ],
)
def test_a_sharded_state_re_forms_in_place_by_default_where_each_node_can_hold_a_whole_copy(
    environ: dict[str, str], own_group: bool, why: str
) -> None:
    """A sharded state (FSDP2) in place: each node, or each replica group of several nodes told its name,
    one copy sharded over its own workers, over the copy's own default group. Replica groups without their
    names, or a default group the script made over every rank, take the restart path by default, and are
    refused where in place is asked for."""
    path, said = choose_path(None, environ, sharded=True, own_group=own_group)
    assert said.startswith(why)
    assert path is (why == "in place")
    if not path and PEER_LOST_ENV in environ:
        with pytest.raises(
            elastic.Refused, match=rf"in_place=True.*({REPLICA_GROUP_ENV} on every node|init_process_group)"
        ):
            choose_path(True, environ, sharded=True, own_group=own_group)


def test_what_cannot_be_honoured_is_refused_at_start_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(elastic.Refused, match="in_place=True: in place needs torchspot-run"):
        choose_path(True, {})
    with pytest.raises(elastic.Refused, match="without a checkpoint_uri"):
        elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None, checkpoint_every=10)
    monkeypatch.setenv(PEER_LOST_ENV, str(tmp_path / "peer-lost"))  # as torchspot-run sets it: in place
    manager = elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None)
    assert manager.in_place is True
    with pytest.raises(elastic.Refused, match="SyncBatchNorm in place"):
        elastic.DistributedDataParallel(manager, torch.nn.SyncBatchNorm(4))
    with pytest.raises(elastic.Refused, match="static_graph in place"):
        elastic.DistributedDataParallel(manager, torch.nn.Linear(4, 2), static_graph=True)
    manager.close()


SILENT_LOOP = """
import time, torch
from torchspot import elastic
manager = elastic.Manager(state_dict=dict, load_state_dict=lambda s: None, commit_seconds=1)
optimizer = elastic.OptimizerWrapper(manager, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))
optimizer.zero_grad()
time.sleep(30)  # a loop that never calls optimizer.step()
"""


@pytest.mark.usefixtures("one_rank")
def test_the_path_is_said_once_by_whoever_chose_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The manager says the path it chose (in_place=None); a caller that chose (the built-in trainer,
    from its flags) says its own reason, and the manager says nothing more."""
    elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None, checkpoint_uri="").close()
    assert capsys.readouterr().err.count("torchspot: the restart path: in place needs torchspot-run") == 1
    elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None, checkpoint_uri="", in_place=False).close()
    assert "torchspot: " not in capsys.readouterr().err


def test_a_step_that_never_commits_ends_the_worker_with_one_line_naming_the_cause() -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop(PEER_LOST_ENV, None)
    command = [sys.executable, "-c", SILENT_LOOP]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    said = [line for line in done.stderr.splitlines() if line.startswith("torchspot: ")]
    assert said == [
        "torchspot: the restart path: in place needs torchspot-run with --rdzv-backend etcd-v3, whose agent hands "
        "live workers each round",
        "torchspot: rank 0: step 1 did not commit within 1 s of its start (a collective that never completed, or a "
        "loop that never called optimizer.step()); leaving for the restart path",
    ], done.stderr


@pytest.mark.usefixtures("one_rank")
def test_an_elasticjobs_checkpoint_settings_reach_the_manager_through_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator passes `spec.checkpoint` as TORCHSPOT_CHECKPOINT_* (builders.launcher_env): a script
    that names no checkpoint checkpoints where its job says."""
    monkeypatch.setenv("TORCHSPOT_CHECKPOINT_URI", str(tmp_path / "job-ckpt"))
    monkeypatch.setenv("TORCHSPOT_CHECKPOINT_EVERY", "2")
    monkeypatch.setenv("TORCHSPOT_KEEP_CHECKPOINTS", "1")
    model = torch.nn.Linear(4, 2)
    manager = elastic.Manager(state_dict=model.state_dict, load_state_dict=model.load_state_dict)
    assert (manager.checkpoint_every, manager.checkpoint_uri) == (2, str(tmp_path / "job-ckpt"))
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        optimizer.zero_grad()
        ddp(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    total = torch.tensor([2.5])
    assert manager.all_reduce(total) is True  # the loop's own figure: a sum over a group of one
    assert float(total) == 2.5
    manager.close()
    saved = [p.name for p in (tmp_path / "job-ckpt").iterdir() if p.name.startswith("step-")]
    assert saved == [step_dir(3).rstrip("/")]  # every 2 steps, keep 1: step 2's went when the final one committed
    assert '"event": "checkpoint", "step": 2, "ok": true' in capsys.readouterr().out
    monkeypatch.setenv("TORCHSPOT_CHECKPOINT_EVERY", "often")
    with pytest.raises(elastic.Refused, match="TORCHSPOT_CHECKPOINT_EVERY='often': expected a whole number"):
        elastic.Manager(state_dict=model.state_dict, load_state_dict=model.load_state_dict)


@pytest.mark.slow(seconds=15)
def test_on_the_restart_path_a_lost_peer_leaves_a_snapshot_and_a_sigterm_an_emergency_checkpoint(
    tmp_path: Path,
) -> None:
    """The DDP example on the restart path, under an elastic agent's environment (its run id; the snapshot
    file is named by the parent process, here the test), its checkpoints every 1000 steps:

    - two ranks; rank 1 is killed: rank 0's loop fails (or is stuck, and its SIGTERM ends it) and leaves
      the node's snapshot of its last committed step;
    - the next round, one rank, resumes from that step (not from the start: no checkpoint was written);
    - SIGTERMed mid-run, as a kubelet does at a spot eviction, it writes the checkpoint of the step it
      committed last (the one a restart resumes from) and exits 143.

    Bad values of the notice settings are refused by name."""
    events, ckpt = tmp_path / "events.jsonl", tmp_path / "ckpt"
    script = Path(__file__).resolve().parents[2] / "examples" / "ddp" / "train.py"
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": f"snap-{os.getpid()}",
            "TORCHSPOT_SNAPSHOT_DIR": str(tmp_path / "snapshots"), "TORCHSPOT_EVENTS_FILE": str(events),
            "TORCHSPOT_CHECKPOINT_URI": str(ckpt), "TORCHSPOT_CHECKPOINT_EVERY": "1000"}  # fmt: skip
    base.pop(PEER_LOST_ENV, None)

    def start(rank: int, world: int, port: int) -> subprocess.Popen[str]:
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_PORT": str(port)}
        command = [sys.executable, str(script), "--steps", "100000", "--step-seconds", "0.02"]
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def steps_of_rank_0() -> list[int]:
        return [e["step"] for e in read_events(events) if e["event"] == "step" and e["rank"] == 0]

    port = free_port()
    first = [start(rank, 2, port) for rank in (0, 1)]
    try:
        wait_for(lambda: len(steps_of_rank_0()) >= 5, 60, "5 steps at world 2")
        first[1].kill()
        try:
            first[0].wait(20)
        except subprocess.TimeoutExpired:  # stuck in the collective with the lost peer: its notice ends it
            first[0].send_signal(signal.SIGTERM)
            first[0].wait(30)
    finally:
        for worker in first:
            worker.kill()
            worker.communicate()
    lost_at = max(steps_of_rank_0())
    assert any((tmp_path / "snapshots").glob("*.pt")), "no snapshot left by the lost round"
    assert not [e for e in read_events(events) if e["event"] == "emergency_checkpoint"]
    again = start(0, 1, free_port())
    try:
        wait_for(lambda: len(steps_of_rank_0()) >= lost_at + 5, 60, "5 steps at world 1")
        again.send_signal(signal.SIGTERM)
        _out, err = again.communicate(timeout=60)
    finally:
        again.kill()
    assert again.returncode == 128 + signal.SIGTERM, err
    records = read_events(events)
    starts = [e for e in records if e["event"] == "start"]
    assert (starts[-1]["resumed_from"], starts[-1]["step"]) == ("snapshot", lost_at), (starts[-1], lost_at)
    last = max(steps_of_rank_0())
    (saved,) = [e for e in records if e["event"] == "emergency_checkpoint"]
    assert (saved["step"], saved["ok"]) == (last, True), (saved, last)
    loaded = CheckpointManager(open_storage(str(ckpt))).load_latest()
    assert loaded is not None
    assert (loaded.step, loaded.state["torchspot"]["step"]) == (last, last)
    with pytest.raises(elastic.Refused, match="notice_hold=-1: must be 0 or more"):
        elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None, notice_hold=-1)
    with pytest.raises(elastic.Refused, match="scheduled_events='sometimes'"):
        elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None, scheduled_events="sometimes")
    with pytest.raises(elastic.Refused, match="peer_copy_every=5: peer copies are of shards: sharded=True"):
        elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None, peer_copy_every=5)
    with pytest.raises(elastic.Refused, match="peer_copy_every=-1: must be 0"):
        elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None, sharded=True, peer_copy_every=-1)


@pytest.mark.usefixtures("one_rank")
def test_a_worker_serves_its_steps_samples_regroups_and_checkpoint_age_where_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCHSPOT_TRAINER_METRICS_PORT: the worker's /metrics in Prometheus' text format, scraped as
    Prometheus does, after the examples' loop of 10 steps (8 samples each, a checkpoint every 5)."""
    port = free_port()
    monkeypatch.setenv(METRICS_PORT_ENV, str(port))
    _loop(tmp_path / "ckpt", 10, tmp_path / "events.jsonl")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = answer.read().decode()
    values = {name: float(value) for name, value in (line.split() for line in text.splitlines() if line[0] != "#")}
    assert values["torchspot_trainer_step"] == 10
    assert values["torchspot_trainer_world_size"] == 1
    assert values["torchspot_trainer_samples_total"] == 80
    assert values["torchspot_trainer_step_seconds_count"] == 10
    assert 0 < values["torchspot_trainer_step_seconds_sum"] < 60
    assert values["torchspot_trainer_reforms_total"] == 0
    assert values["torchspot_trainer_checkpoint_step"] == 10
    assert 0 <= time.time() - values["torchspot_trainer_checkpoint_timestamp_seconds"] < 60
    regrouped = WorkerMetrics()
    for world in (2, 3, 2):  # the first group, then two re-forms (in place: no restart)
        regrouped.entered(step=7, world=world)
    assert regrouped.snapshot()["torchspot_trainer_reforms_total"] == 2
    monkeypatch.setenv(METRICS_PORT_ENV, "http")
    with pytest.raises(elastic.Refused, match=f"{METRICS_PORT_ENV}='http': must be a port number"):
        elastic.Manager(state_dict=dict, load_state_dict=lambda _s: None)


def test_in_place_a_new_worker_starts_from_its_nodes_snapshot_unless_a_checkpoint_is_newer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker its agent started again in place (the one before it left for the restart path) loads its
    node's snapshot before the first group's heal; a committed checkpoint newer than the snapshot wins,
    and no snapshot is read outside an elastic agent (no run id: another script's would be)."""
    monkeypatch.setenv(PEER_LOST_ENV, str(tmp_path / "peer-lost"))  # as torchspot-run sets it: in place
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHSPOT_SNAPSHOT_DIR", str(tmp_path / "snapshots"))
    model = torch.nn.Linear(4, 2)

    def manager(checkpoint_uri: str) -> elastic.Manager:
        return elastic.Manager(
            state_dict=model.state_dict, load_state_dict=model.load_state_dict, checkpoint_uri=checkpoint_uri
        )

    kept = {"step": 7, "user": {"weight": torch.full((2, 4), 7.0), "bias": torch.zeros(2)},
            "torchspot": {"step": 7, "positions": []}}  # fmt: skip
    LocalSnapshot(default_path(dict(os.environ))).write(kept, base=0)
    first = manager(checkpoint_uri="")
    first._member.resume()
    assert first.resumed_from == "snapshot"
    assert float(model.weight.detach()[0, 0]) == 7.0
    first.close()
    assert not default_path(dict(os.environ)).exists(), "a finished run leaves its node's snapshot behind"
    ckpt = tmp_path / "ckpt"
    newer = {
        "user": {"weight": torch.full((2, 4), 9.0), "bias": torch.zeros(2)},
        "torchspot": {"step": 9, "positions": []},
    }
    CheckpointManager(open_storage(str(ckpt))).save_sync(9, newer, {"world_size": 1})
    LocalSnapshot(default_path(dict(os.environ))).write(kept, base=0)
    second = manager(checkpoint_uri=str(ckpt))
    second._member.resume()
    assert second.resumed_from == "checkpoint"
    assert float(model.weight.detach()[0, 0]) == 9.0
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert node_snapshot(os.environ) is None


@pytest.mark.usefixtures("one_rank")
def test_a_nodes_snapshot_holds_the_committed_step_whatever_the_next_step_has_begun_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leaving worker's snapshot is the last committed step's state: BatchNorm's running statistics that
    the next step's forward pass already moved are kept as they were at the commit (on a GPU from the
    commit's host copy, which a hung device cannot hold up: recovery/hostcopy.py)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHSPOT_SNAPSHOT_DIR", str(tmp_path / "snapshots"))
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), norm)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = elastic.Manager(
        state_dict=lambda: {"model": model.state_dict()}, load_state_dict=lambda s: model.load_state_dict(s["model"]),
        checkpoint_uri="",
    )  # fmt: skip
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, inner)
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        optimizer.zero_grad()
        ddp(inputs).pow(2).mean().backward()
        optimizer.step()
    committed = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer.zero_grad()
    ddp(inputs * 5).pow(2).mean().backward()  # the next step: its forward moved the running statistics
    assert norm.running_mean is not None
    assert not torch.equal(norm.running_mean, committed["1.running_mean"])
    manager._leaving.keep_snapshot()  # as a worker whose group broke in this step's all-reduce does
    held = LocalSnapshot(default_path(dict(os.environ))).read()
    assert held is not None
    assert held[0].step == 3
    kept = held[1]["user"]["model"]
    assert all(torch.equal(kept[key], committed[key]) for key in committed), "the snapshot is not step 3's"
    manager.close()


@pytest.mark.usefixtures("one_rank")
def test_a_worker_that_resumed_and_broke_in_its_first_step_leaves_the_state_it_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's snapshot holds the state a group starts from before its first commit: a worker that
    resumed from step 5's checkpoint and is lost in step 6 leaves step 5, not nothing."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHSPOT_SNAPSHOT_DIR", str(tmp_path / "snapshots"))
    ckpt = tmp_path / "ckpt"
    saved = {
        "user": {"weight": torch.full((2, 4), 5.0), "bias": torch.zeros(2)},
        "torchspot": {"step": 5, "positions": []},
    }
    CheckpointManager(open_storage(str(ckpt))).save_sync(5, saved, {"world_size": 1})
    model = torch.nn.Linear(4, 2)
    manager = elastic.Manager(state_dict=model.state_dict, load_state_dict=model.load_state_dict,
                              checkpoint_uri=str(ckpt))  # fmt: skip
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.zero_grad()
    assert manager.current_step() == 5
    ddp(torch.randn(3, 4)).sum().backward()  # step 6 under way: the worker is lost here
    manager._leaving.keep_snapshot()
    held = LocalSnapshot(default_path(dict(os.environ))).read()
    assert held is not None
    assert held[0].step == 5
    assert float(held[1]["user"]["weight"][0, 0]) == 5.0
    manager.close()


def _check_skipped_update(out: Path) -> None:
    """scaler_loop.py's run: the skipped step counted and its update not applied, each sample once per epoch."""
    weights = torch.load(out)
    records = [e for e in read_events(out.with_suffix(".jsonl")) if e["event"] == "step"]
    assert [e["step"] for e in records] == list(range(1, scaler_loop.STEPS + 1))
    assert [e["step"] for e in records if e.get("update_skipped")] == [scaler_loop.SKIPPED]
    assert sorted(weights) == list(range(scaler_loop.STEPS + 1))
    for step in range(1, scaler_loop.STEPS + 1):  # the weight after `step` steps against the one before
        unchanged = torch.equal(weights[step], weights[step - 1])
        assert unchanged == (step == scaler_loop.SKIPPED), step
    per_epoch = scaler_loop.SAMPLES // scaler_loop.GLOBAL_BATCH
    for epoch in range(scaler_loop.STEPS // per_epoch):
        taken = [i for e in records[epoch * per_epoch : (epoch + 1) * per_epoch] for i in e["samples"]]
        assert sorted(taken) == list(range(scaler_loop.SAMPLES)), epoch


@pytest.mark.usefixtures("one_rank")
def test_a_step_whose_update_the_grad_scaler_skipped_counts_as_taken_on_the_restart_path(tmp_path: Path) -> None:
    """float16's loss scaler skips the update of a step whose gradients hold inf, as torch's does: the step
    is counted (its samples were trained, each sample stays once per epoch) and its update not applied."""
    scaler_loop.run(tmp_path / "weights.pt")
    _check_skipped_update(tmp_path / "weights.pt")


@pytest.mark.slow(seconds=8)
def test_a_step_whose_update_the_grad_scaler_skipped_counts_as_taken_in_place(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """The same loop under torchspot-run, in place: the skip is said and counted by the same commit rule."""
    out = tmp_path / "weights.pt"
    job = JobConfig(workdir=tmp_path, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes="1:2",
                    program=[str(Path(scaler_loop.__file__)), str(out)])  # fmt: skip
    (node,) = nodes(job, 1)
    assert node.wait(60) == 0, node.log_tail(40)
    assert any(e["event"] == "generation" for e in read_events(out.with_suffix(".jsonl")))  # in place
    _check_skipped_update(out)


@pytest.mark.slow(seconds=15)
def test_a_node_frozen_between_steps_and_thawed_during_the_others_evaluation_joins_it_without_a_restart(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """thaw_loop.py on two nodes: one frozen between two steps (before its loop's own sum of a step's loss)
    while the other trains on alone to an evaluation, and thawed during it. The thawed worker re-forms at
    its next step's start and is healed by the evaluating one, which re-forms between steps: its step is
    void (it sends nothing, its update is not applied) and its loop evaluates with the other's, rather
    than meeting the evaluation's collectives with its gradients (which ended its worker by the restart
    path). Neither worker restarts; every step commits once."""
    job = JobConfig(workdir=tmp_path, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes="1:2",
                    program=[str(Path(thaw_loop.__file__)), str(tmp_path)], extra_env={"HOLD_NODE": "n0"})  # fmt: skip
    frozen, other = nodes(job, 2)
    held = int(wait_for(lambda: (tmp_path / "held").exists() and (tmp_path / "held").read_text(), 60, "the hold"))
    frozen.freeze()
    (tmp_path / "go").touch()  # (read once it is thawed)
    evaluating = int(wait_for(lambda: (tmp_path / "evaluating").exists() and (tmp_path / "evaluating").read_text(),
                              60, "the other node's evaluation alone"))  # fmt: skip
    assert evaluating > held
    frozen.thaw()
    assert frozen.wait(90) == 0, frozen.log_tail(40)
    assert other.wait(30) == 0, other.log_tail(40)

    records = read_events(tmp_path / "records.jsonl")
    generations = [r for r in records if r["event"] == "generation"]
    assert len({r["pid"] for r in generations if r["node"] == "n0"}) == 1, "the thawed node's worker restarted"
    assert len({r["pid"] for r in generations if r["node"] == "n1"}) == 1
    thawed = [r for r in generations if r["node"] == "n0" and r["world_size"] == 2 and r["step"] == evaluating]
    assert thawed, generations
    assert thawed[0]["resumed_from"] == "peer", generations
    assert "not applied: begun before a heal whose holders went on between steps" in frozen.log_path.read_text()
    evaluations = [json.loads(line) for line in (tmp_path / "evaluations.jsonl").read_text().splitlines()]
    assert {(e["node"], e["world_size"]) for e in evaluations if e["step"] == evaluating} == {("n0", 2), ("n1", 2)}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in (r for r in records if r["event"] == "step"):  # (every rank writes its own)
        by_step.setdefault(record["step"], []).append(record)
    assert sorted(by_step) == list(range(1, thaw_loop.STEPS + 1))
    for step, taken in by_step.items():  # once, by one group: each of its ranks
        assert len({r["generation"] for r in taken}) == 1, step
        assert sorted(r["rank"] for r in taken) == list(range(taken[0]["world_size"])), step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("source", [0, 2])
def test_the_last_buckets_riders_sum_to_the_sources_buffers_and_every_ranks_line(
    dtype: torch.dtype, source: int
) -> None:
    """What three ranks' last buckets carry, summed as their all-reduce sums them: every rank reads the
    source's buffers (rank 0's, or the first trainer's after a heal beside the step) and each rank's line,
    exactly, in any float type a gradient may have."""
    lines = [Line(False, 0, 0), Line(True, 2, 1), Line(False, 1, 250)]
    buffers = [[torch.full((3,), 0.5 + rank), torch.full((2, 2), -1.0 - rank)] for rank in range(3)]
    packed = [pack(buffers[r], r, 3, lines[r], source=source, dtype=dtype, device=CPU) for r in range(3)]
    total = torch.stack(packed).sum(dim=0)
    for rank in range(3):
        mine = [torch.zeros_like(b) for b in buffers[rank]]
        assert unpack(total, mine, 3) == lines
        assert [b.tolist() for b in mine] == [b.tolist() for b in buffers[source]]


def _rows(*rows: tuple[int, bool, bool, bool]) -> list[Row]:
    """Rows of states with no change since their step (version 0)."""
    return [Row(step, 0, *flags) for step, *flags in rows]


@pytest.mark.parametrize(
    ("rows", "trainers"),
    [
        # A join at a step's start: the two holders train, the joiner receives beside the step.
        (_rows((7, False, True, True), (7, False, True, True), (0, True, False, True)), [0, 1]),
        # The joiner took rank 0: the holders are ranks 1 and 2, rank 1 sends.
        (_rows((3, True, False, True), (9, False, True, True), (9, False, True, True)), [1, 2]),
        # A rank whose last all-reduce failed where the others' completed, all at a step's start.
        (_rows((5, False, True, True), (4, False, True, True)), [0]),
        # Every rank holds the step: nothing to send.
        (_rows((5, False, True, True), (5, False, True, True)), None),
        # The first group: nobody holds the run live (the newest copy is broadcast).
        (_rows((4, True, False, True), (0, True, False, True)), None),
        # A holder heals after its step failed (not at a step's start): the loop may not step next.
        (_rows((5, False, False, True), (4, False, True, True)), None),
        # A rank may not sit out (a device plane, a gradient scaler): every rank waits for the state.
        (_rows((7, False, True, True), (0, True, False, False)), None),
        # A new process holding a copy of the newest step is still sent it (its copy is not the group's).
        (_rows((7, False, True, True), (7, True, False, True)), [0]),
        # Of two states of one step, the one the loop changed since (an evaluation kept) is the newer.
        ([Row(5, 1, False, True, True), Row(5, 0, False, False, True)], [0]),
        ([Row(5, 0, False, True, True), Row(5, 1, False, False, True)], None),
    ],
)
def test_a_heal_goes_beside_the_next_step_only_where_the_holders_step_next_and_every_rank_may_sit_out(
    rows: list[Row], trainers: list[int] | None
) -> None:
    assert trainers_beside(rows) == trainers


def test_a_broadcast_heal_sends_from_the_lowest_live_holder_of_the_newest_step() -> None:
    assert source_of(_rows((7, True, False, True), (7, False, False, True), (3, False, False, True))) == 1
    assert source_of(_rows((2, True, False, True), (7, True, False, True))) == 1
    assert source_of([Row(7, 0, False, False, True), Row(7, 2, False, False, True)]) == 1


def test_a_step_begun_before_a_heal_is_void_only_where_a_holder_of_the_newest_state_healed_between_steps() -> None:
    """Rows (step, fresh, stepping, may sit out): holders between steps decide next, from their state."""
    assert holders_between_steps(_rows((7, False, False, True), (3, False, True, True)))  # the defect's heal
    assert holders_between_steps(_rows((7, True, False, True), (7, False, True, True)))  # a new process resumed
    assert not holders_between_steps(_rows((7, False, True, True), (3, False, False, True)))  # a joiner between
    assert not holders_between_steps(_rows((7, False, True, False), (7, False, True, False)))
    assert holders_between_steps([Row(7, 1, False, False, True), Row(7, 0, False, True, True)])  # it evaluated
    assert not holders_between_steps([Row(7, 1, False, True, True), Row(7, 0, False, False, True)])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_record_is_one_json_line_in_the_events_file_printed_where_asked_and_readable_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one writer of the manager's records and the trainer's: the events file gets every record, stdout
    the ones asked for, and a terminal's stderr a readable line where the caller gives one (the trainer's
    progress), the JSON line for another record, and nothing without `readable` (the manager's)."""
    events = tmp_path / "events.jsonl"
    write_record({"event": "step", "step": 1}, events=events, stdout=False)
    write_record({"event": "progress", "step": 2, "t": 5.0}, events=events, stdout=True)
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[1]["t"] == 5.0  # a record written again keeps its own time
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [lines[1]]
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    write_record({"event": "done", "step": 3}, events=None, stdout=True)
    assert terminal.getvalue() == ""
    readable = lambda record: f"step {record['step']}" if record["event"] == "progress" else None  # noqa: E731
    write_record({"event": "progress", "step": 4}, events=None, stdout=True, readable=readable)
    write_record({"event": "done", "step": 5}, events=None, stdout=True, readable=readable)
    said = terminal.getvalue().splitlines()
    assert said[0] == "step 4"
    assert said[1].startswith("[torchspot] ")
    assert json.loads(said[1].removeprefix("[torchspot] "))["step"] == 5
