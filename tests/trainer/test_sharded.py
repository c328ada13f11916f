"""A sharded (FSDP2) run on the recovery API, examples/fsdp's GPT-style LM, stopped by a notice and resumed at
another world size: real gloo processes, real DCP checkpoints on Azurite (checkpoint/sharded.py,
elastic/saving.py); the checkpoints in a local folder, in this process."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from torchspot_lab.azurite import Azurite
from torchspot_lab.etcd import EtcdServer, free_port
from torchspot_lab.local import JobConfig, NodeFactory, read_events, wait_for
from torchspot_trainer import REPLICA_GROUP_ENV, REPLICA_GROUP_SIZE_ENV
from torchspot_trainer.checkpoint.dcp import committed
from torchspot_trainer.checkpoint.sharded import ShardedCheckpoints
from torchspot_trainer.checkpoint.storage import blob_container
from torchspot_trainer.data.sampler import ElasticSampler as Position
from torchspot_trainer.elastic import Manager, Refused
from torchspot_trainer.elastic.settings import (
    CHECKPOINT_EVERY_ENV,
    CHECKPOINT_URI_ENV,
    EVENTS_FILE_ENV,
    KEEP_CHECKPOINTS_ENV,
    choose_path,
)
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.recovery.notices import EXIT_EVICTED, EXIT_FAILED

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "fsdp"
STEPS, GLOBAL_BATCH = 8, 24
SHARD_SIZE = 2
"""The job's replica groups (as an ElasticJob's replicaGroupSize reaches a pod: REPLICA_GROUP_SIZE_ENV), the
example's --shard-size default: at 4 ranks two replica groups of 2 (HSDP), at 3 FSDP over all three."""
JOIN_STEPS = 90
"""The join test's run: long enough that the second node's start-up (a few seconds), five steps of two and
the first node's restart after the second's loss land inside it."""
TOLERANCE = 1e-5
"""float32 reduction order: the ranks' shares of a step are summed in another order at another world size."""


def _start(world: int, uri: str, env: dict[str, str], events: Path) -> list[subprocess.Popen[str]]:
    """`world` ranks of the example (a step of at least 0.15 s: a notice lands inside the run), each with
    its events file, the job's checkpoint settings every 3 steps to `uri`, replica groups of 2 ranks
    (HSDP) where the world divides into them."""
    common = {
        **os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
        CHECKPOINT_URI_ENV: uri, CHECKPOINT_EVERY_ENV: "3", REPLICA_GROUP_SIZE_ENV: str(SHARD_SIZE),
    }  # fmt: skip
    command = [sys.executable, str(EXAMPLE / "train.py"), f"--steps={STEPS}", f"--global-batch={GLOBAL_BATCH}",
               "--log-every=1", "--step-seconds=0.15"]  # fmt: skip
    return [
        subprocess.Popen(
            command,
            env={**common, "RANK": str(rank), EVENTS_FILE_ENV: str(events / f"rank{rank}.jsonl")},
            cwd=EXAMPLE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]


def _finish(
    processes: list[subprocess.Popen[str]], codes: list[int], *, lines: list[str]
) -> tuple[list[dict[str, Any]], str]:
    """Rank 0's loss lines (those in `lines` already, and the rest) and its stderr, once every rank has
    exited with its status in `codes`."""
    said = [process.communicate(timeout=180) for process in processes]
    assert [process.returncode for process in processes] == codes, [err[-3000:] for _, err in said]
    every = lines + said[0][0].splitlines()
    return [record for record in map(json.loads, filter(None, every)) if "loss" in record], said[0][1]


def _samples(events: Path) -> dict[int, list[int]]:
    """Each committed step's samples, as rank 0's events file has them (the whole group's)."""
    records = [json.loads(line) for line in (events / "rank0.jsonl").read_text().splitlines()]
    return {record["step"]: sorted(record["samples"]) for record in records if record["event"] == "step"}


def _example() -> ModuleType:
    """examples/fsdp/train.py, imported here under a name of its own; this process's import path as it was."""
    spec = importlib.util.spec_from_file_location("fsdp_example", EXAMPLE / "train.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)  # (it finds the corpus in the Transformers example's folder)
    finally:
        sys.path[:] = saved
    return module


def _alone(
    steps: int = STEPS, *, evaluations: dict[int, float] | None = None, eval_every: int = 0
) -> dict[int, tuple[float, list[int]]]:
    """The example's training in this process, unsharded, on one rank: each step's loss and samples; every
    `eval_every` steps its evaluation's figure into `evaluations` (the example's fixed set, whole)."""
    example = _example()
    model, tokens = example.build_model(), example.corpus()
    held = tokens[: 2 * GLOBAL_BATCH].split(GLOBAL_BATCH)  # (the example's `evaluation`)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # (the example's default)
    position = Position(len(tokens), batch_size=1, seed=0, global_batch=GLOBAL_BATCH)
    taken = {}
    for step in range(1, steps + 1):
        ids = position.step_chunk(1)
        optimizer.zero_grad()
        loss = example.loss_of(model, tokens[ids])
        loss.backward()
        optimizer.step()
        position.advance(1)
        taken[step] = (loss.item(), sorted(ids))
        if evaluations is not None and step % eval_every == 0:
            with torch.no_grad():
                evaluations[step] = sum(example.loss_of(model, batch).item() for batch in held) / len(held)
    return taken


@pytest.mark.slow(seconds=25)
def test_the_hsdp_example_stopped_by_a_notice_at_four_ranks_resumes_at_three_as_one_unsharded_rank_trains(
    azurite: Azurite, tmp_path: Path
) -> None:
    """examples/fsdp (a GPT-style LM, each block an FSDP2 unit) at a fixed global batch, checkpointing to
    Blob every 3 steps: four ranks in two replica groups of two (HSDP) train until rank 3's node gets a
    notice (SIGTERM) after step 3; at the next boundary every rank writes its shards of the emergency
    checkpoint, rank 3 leaves (143) and the others for the restart path (1). Three ranks, which make no
    replica groups of two, resume from it with FSDP over all three (DCP reshards) and train to the end.
    Every step is trained once, on the samples, and with the loss, of the same training unsharded on one
    rank (float32 reduction order apart)."""
    env, blob = azurite.env(), f"az://sharded/{uuid.uuid4().hex[:10]}"
    (tmp_path / "two").mkdir()
    (tmp_path / "three").mkdir()
    two = _start(4, blob, env, tmp_path / "two")
    assert two[0].stdout is not None
    seen: list[str] = []
    while not seen or json.loads(seen[-1]).get("step") != 3:  # rank 0's line of step 3 (and the manager's)
        line = two[0].stdout.readline()
        assert line, two[0].communicate()[1][-3000:]
        if line.startswith('{"step"'):
            seen.append(line)
    two[3].send_signal(signal.SIGTERM)  # the node's notice: at the boundary after step 3, or soon after
    first, said = _finish(two, [EXIT_FAILED, EXIT_FAILED, EXIT_FAILED, EXIT_EVICTED], lines=seen)
    assert "FSDP over all of them" not in said  # two replica groups of two
    stopped = max(_samples(tmp_path / "two"))  # the step whose boundary the notice stopped the group at
    assert stopped >= 3  # (the boundary after a step is passed as the next begins: after the step's line)
    assert committed(blob, env=env)[-1] == f"{blob}/step-{stopped:010d}"  # the emergency checkpoint
    container, prefix = blob.removeprefix("az://").split("/", 1)
    shards = blob_container(container, env).list_blobs(name_starts_with=f"{prefix}/step-{stopped:010d}/")
    written = sorted(item.name.rsplit("/", 1)[1] for item in shards if item.name.endswith(".distcp"))
    print("the emergency checkpoint's shard files:", written)
    assert len(written) == 4, written  # each rank its own
    resumed, said = _finish(_start(3, blob, env, tmp_path / "three"), [0, 0, 0], lines=[])
    assert f"3 ranks do not make replica groups of {SHARD_SIZE}: FSDP over all of them" in said
    reference = _alone()
    samples = {**_samples(tmp_path / "two"), **_samples(tmp_path / "three")}
    assert sorted(samples) == list(range(1, STEPS + 1))  # every step once: none lost, none redone
    assert all(samples[step] == reference[step][1] for step in samples), samples
    losses = {record["step"]: record["loss"] for record in first + resumed}
    assert set(losses) == set(range(1, STEPS + 1))  # the stopped step's line too: the notice stops the next step
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step][0], rel=TOLERANCE), step


@pytest.mark.slow(seconds=25)
def test_a_sharded_run_on_the_restart_path_loses_no_step_to_a_join_nor_to_a_node_killed_without_notice(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """examples/fsdp --restart-path --peer-copy-every=1 under torchspot-run (a sharded run's restart path) on
    one node, joined by a second, which is then killed. At the join the agents restart the workers, and their
    SIGTERM stops the group at the next boundary, where the rank writes its snapshot of its shards
    (recovery/reshard.py; no checkpoint is written: no node leaves); the round of two resumes from it,
    resharded (the joining node's rank is sent its rows by the first). There each rank trades its shards
    with the other's after every step (recovery/peer_copy.py), so when the second node is killed the first
    holds both ranks' shards of the last trade and resumes alone from them: no step lost, none trained
    twice but the one a trade in flight at the kill may leave (the checkpoint is every 1000 steps: without
    the snapshots the run would go back to step 0 at each change)."""
    events = tmp_path / "events.jsonl"
    job = JobConfig(workdir=tmp_path, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes="1:2",
                    program=[str(EXAMPLE / "train.py"), f"--steps={JOIN_STEPS}", f"--global-batch={GLOBAL_BATCH}",
                             "--step-seconds=0.2", "--log-every=5", "--restart-path", "--peer-copy-every=1"],
                    extra_env={EVENTS_FILE_ENV: str(events), CHECKPOINT_URI_ENV: str(tmp_path / "ckpt"),
                               CHECKPOINT_EVERY_ENV: "1000"})  # fmt: skip

    def steps(world: int) -> list[int]:  # (each rank's records: each step once)
        return sorted({r["step"] for r in read_events(events) if r["event"] == "step" and r["world_size"] == world})

    (first,) = nodes(job, 1)
    wait_for(lambda: len(steps(1)) >= 5, 90, "5 steps on one node")
    (second,) = nodes(job, 1)
    wait_for(lambda: len(steps(2)) >= 5, 90, "5 steps on two nodes")
    second.kill()
    assert first.wait(120) == 0, first.log_tail()
    records = read_events(events)
    assert not [r for r in records if r["event"] == "emergency_checkpoint"]
    starts = sorted({(r["step"], r["world_size"], r["resumed_from"]) for r in records if r["event"] == "start"})
    (joined, killed) = [start for start in starts if start[2] == "snapshot"]
    alone, together = steps(1), steps(2)
    before, after = [s for s in alone if s < together[0]], [s for s in alone if s > together[0]]
    assert joined == (before[-1], 2, "snapshot"), starts
    assert killed[1:] == (1, "snapshot"), starts
    assert max(together) - 1 <= killed[0] <= max(together), (starts, together)  # (a trade in flight: one step)
    lineage = before + [s for s in together if s <= killed[0]] + after
    assert lineage == list(range(1, JOIN_STEPS + 1)), (starts, alone, together)  # none lost, none twice


@pytest.mark.usefixtures("one_rank_group")
def test_sharded_checkpoints_in_a_folder_keep_the_step_saved_the_newest_two_and_pass_over_a_torn_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ShardedCheckpoints in a local folder, in this process's one-rank group: three saves beside the loop
    (each followed by an update as soon as `staged()` returned) keep the newest two, each holding its own
    step; a newer folder without metadata (a save that stopped) is said in one line and passed over."""
    checkpoints = ShardedCheckpoints(tmp_path.as_uri(), keep=2)  # (file://, as --checkpoint-uri may name it)
    state: dict[str, Any] = {"weight": torch.zeros(4, 3), "step": 0}
    for step in (1, 2, 3):
        state["weight"].fill_(step)
        state["step"] = step
        checkpoints.save_async(step, state)
        checkpoints.staged()
        state["weight"].fill_(-1.0)  # the next update
    checkpoints.close()
    torn = tmp_path / "step-0000000004"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"step-000000000{n}" for n in (2, 3, 4)]
    loaded: dict[str, Any] = {"weight": torch.zeros(4, 3), "step": 0}
    reader = ShardedCheckpoints(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        found = reader.load_latest(lambda: loaded)
    assert found is not None
    reader.close()
    assert found[0] == 3
    assert torch.equal(found[1]["weight"], torch.full((4, 3), 3.0))
    assert found[1]["step"] == 3
    assert [record.message for record in caplog.records if "no metadata" in record.message] == [
        "sharded checkpoints of steps [4] have no metadata (their saves stopped before they committed): not "
        "loaded; resuming from step 3"
    ]


def test_sharded_in_place_over_replica_groups_of_several_nodes_needs_each_node_told_its_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under torchspot-run (its agent's variable set) where the job's replica groups span nodes but the node
    is not told its group's name, a sharded manager takes the restart path, saying why in one line; asked
    for in place there, it is refused. Told its group (as the operator does), it re-forms in place."""
    monkeypatch.setenv(PEER_LOST_ENV, "1")
    monkeypatch.setenv(REPLICA_GROUP_SIZE_ENV, "2")
    with Manager(dict, lambda state: None, sharded=True, checkpoint_uri="") as manager:  # (closed: its SIGTERM
        assert not manager.in_place  # handler and commit watcher must not outlive the test in this process)
    (said,) = capsys.readouterr().err.splitlines()
    assert said.startswith(f"torchspot: the restart path: replica groups of 2 nodes, but no {REPLICA_GROUP_ENV}")
    with pytest.raises(Refused, match=f"replica groups of 2 nodes, but no {REPLICA_GROUP_ENV} names this node's"):
        Manager(dict, lambda state: None, in_place=True, sharded=True, checkpoint_uri="")
    path, why = choose_path(
        None, {PEER_LOST_ENV: "1", REPLICA_GROUP_SIZE_ENV: "2", REPLICA_GROUP_ENV: "a"}, sharded=True
    )
    assert path, why


RESUMED_STEPS = 10
"""The in-place test's steps after its resume (the job again, from its last checkpoint)."""

EVAL_EVERY = 10
"""The in-place test's steps between evaluations (the example's `--eval-every`)."""

IN_PLACE_STEPS = 170
"""The in-place test's run (a step of at least 0.2 s): two nodes' start, a third's join (its agent's and
workers' start-up take 20 s on a loaded 2-core machine), a kill and a notice land inside it."""


@pytest.mark.slow(seconds=60)
def test_in_place_nodes_of_two_sharded_workers_take_a_join_a_kill_and_a_notice_and_train_the_unsharded_model(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """examples/fsdp --in-place under torchspot-run, 2 workers a node, each node one copy of the model
    sharded over its workers (FSDP2), the nodes' copies kept alike over each column's generation: 2 nodes,
    a third joins (healed by shard from a live node), then the second is killed, then the third has a notice
    (SIGTERM: its workers write the emergency checkpoint, a whole copy, and leave; the first trains on). The
    first node's workers are the processes they started as throughout; every step is committed once, on the
    samples and with the loss (within float32 order) of the same training unsharded on one rank, and so is
    each evaluation between steps (which heeds the notices at every batch). One node's workers write each
    checkpoint (every node holds a whole copy), through the join, the kill and the notice. Then the job
    again on one node of one worker resumes from the last one and trains on as the unsharded run does."""
    events, folder = tmp_path / "events.jsonl", tmp_path / "ckpt"
    job = JobConfig(workdir=tmp_path, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes="1:3",
                    nproc_per_node=2, extra_env={EVENTS_FILE_ENV: str(events), CHECKPOINT_URI_ENV: str(folder),
                                                 CHECKPOINT_EVERY_ENV: "50", KEEP_CHECKPOINTS_ENV: "9"},
                    program=[str(EXAMPLE / "train.py"), f"--steps={IN_PLACE_STEPS}", f"--global-batch={GLOBAL_BATCH}",
                             "--step-seconds=0.2", "--log-every=1", f"--eval-every={EVAL_EVERY}",
                             "--in-place"])  # fmt: skip

    def steps() -> list[dict[str, Any]]:
        return [r for r in read_events(events) if r["event"] == "step" and r["rank"] == 0]

    first, second = nodes(job, 2)
    wait_for(lambda: len(steps()) >= 10, 90, "10 steps on two nodes")
    (third,) = nodes(job, 1)
    wait_for(lambda: steps()[-1]["world_size"] == 6, 120, "the third node's join")
    joined = steps()[-1]["step"]
    wait_for(lambda: steps()[-1]["step"] >= joined + 5, 60, "5 steps on three nodes")
    second.kill()
    wait_for(lambda: steps()[-1]["world_size"] == 4, 60, "the re-form without the second node")
    killed = steps()[-1]["step"]
    wait_for(lambda: steps()[-1]["step"] >= killed + 5, 60, "5 steps on two nodes")
    third.terminate(grace=30)
    assert third.poll() == 128 + signal.SIGTERM, third.log_tail()  # (stopped by the notice, left in time)
    assert first.wait(120) == 0, first.log_tail()
    records = read_events(events)
    (emergency,) = {r["step"] for r in records if r["event"] == "emergency_checkpoint" and r["ok"]}  # (its workers')
    pids = {(r["node"], r["rank"] % 2): r["pid"] for r in records if r["event"] == "generation"}
    first_pids = {r["pid"] for r in records if r["event"] == "generation" and r["node"] == first.name}
    assert len(first_pids) == 2, pids  # its two workers, never restarted
    healed = [r for r in records if r["event"] == "generation" and r["resumed_from"] == "peer"]
    assert {r["node"] for r in healed} == {third.name}, healed
    # Beside the step the first two nodes took; by one broadcast where the join came while they evaluated
    # between steps (their loop decides next from the state it holds: heal.py's holders_between_steps).
    beside = [(r["generation"], r["trainers"], r["step"]) for r in healed]
    assert all(trainers in ([0, 1], None) for _, trainers, _ in beside), beside
    assert {r["world_size"] for r in steps()} == {2, 4, 6}
    assert [r["step"] for r in steps()] == list(range(1, IN_PLACE_STEPS + 1))  # each step once
    evaluations: dict[int, float] = {}
    more = IN_PLACE_STEPS + RESUMED_STEPS  # (the reference runs on through the resume below)
    reference = _alone(more, evaluations=evaluations, eval_every=EVAL_EVERY)
    ids_before = {s: ids for s, (_, ids) in reference.items() if s <= IN_PLACE_STEPS}
    assert {r["step"]: sorted(r["samples"]) for r in steps()} == ids_before
    lines = [json.loads(line) for line in first.log_path.read_text().splitlines() if line.startswith('{"step"')]
    losses = {line["step"]: line["loss"] for line in lines}
    assert len(lines) == len(losses) >= IN_PLACE_STEPS - 2  # (a figure whose sum a re-form broke is skipped)
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step][0], rel=TOLERANCE), step
    said = [json.loads(line) for line in first.log_path.read_text().splitlines() if line.startswith('{"evaluation"')]
    assert len(said) >= IN_PLACE_STEPS // EVAL_EVERY // 2, said  # (one that a re-form broke is begun no more)
    for figure in said:  # each between steps, heeding the notices (a sharded run's: its columns', agreed)
        assert figure["loss"] == pytest.approx(evaluations[figure["evaluation"]], rel=TOLERANCE), figure
    saved = sorted(path.name for path in folder.iterdir() if (path / ".metadata").exists())
    kept = sorted({50, 100, 150, emergency, IN_PLACE_STEPS})  # the last: close()'s
    assert saved == [f"step-{step:010d}" for step in kept]

    # The job again, one node of one worker: it resumes from the last checkpoint, resharded (DCP) from the
    # node's two shards to one, with the samplers' positions, and trains on as the unsharded run did.
    again = tmp_path / "again.jsonl"
    resumed = JobConfig(workdir=tmp_path / "again", backend="etcd-v3", endpoint=etcd.endpoint, run_id=f"{run_id}-again",
                        nnodes="1", nproc_per_node=1,
                        extra_env={EVENTS_FILE_ENV: str(again), CHECKPOINT_URI_ENV: str(folder)},
                        program=[str(EXAMPLE / "train.py"), f"--steps={more}", f"--global-batch={GLOBAL_BATCH}",
                                 "--log-every=1"])  # fmt: skip
    (alone,) = nodes(resumed, 1)
    assert alone.wait(120) == 0, alone.log_tail()
    records = read_events(again)
    assert [r["resumed_from"] for r in records if r["event"] == "generation"] == ["checkpoint"]
    taken = {r["step"]: sorted(r["samples"]) for r in records if r["event"] == "step"}
    assert taken == {step: reference[step][1] for step in range(IN_PLACE_STEPS + 1, more + 1)}
    lines = [json.loads(line) for line in alone.log_path.read_text().splitlines() if line.startswith('{"step"')]
    assert [line["step"] for line in lines] == list(range(IN_PLACE_STEPS + 1, more + 1))
    for line in lines:
        assert line["loss"] == pytest.approx(reference[line["step"]][0], rel=TOLERANCE), line


GROUP_STEPS = 260
"""The replica-group test's run (a step of at least 0.1 s): four nodes' start, a freeze, its group's
restarts (the survivor's, then a new node's start-up: up to 20 s on a loaded 2-core machine) and a notice
land inside it."""


@pytest.mark.slow(seconds=45)
def test_replica_groups_of_two_nodes_in_place_a_group_that_loses_a_node_is_healed_by_column_the_other_trains_on(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """examples/fsdp under torchspot-run with the job's replica groups of 2 nodes (one worker each): each
    group one copy of the model sharded over its two nodes, the groups' copies kept alike over each column's
    generation. A node of the second group freezes: its group-mate's worker, held in an FSDP collective with
    it, ends at once when the round without the frozen node comes (its copy is incomplete; it starts again
    and stands by), and the first group trains on in place alone. The frozen node is then lost for good and
    a new node of the second group comes: the group's process group forms again and it is healed by column,
    beside the step the first group takes. Then the new node has a notice (SIGTERM): the second group's two
    workers write the emergency checkpoint together (its copy's shards) and the new node leaves; the
    group-mate ends again and stands by until the first group finishes the run, and its node finishes with
    it. The first group's workers are the processes they started as; every step is committed once, on the
    samples and with the loss (within float32 order) of unsharded training."""
    events, folder = tmp_path / "events.jsonl", tmp_path / "ckpt"
    job = JobConfig(workdir=tmp_path, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes="2:4",
                    extra_env={EVENTS_FILE_ENV: str(events), REPLICA_GROUP_SIZE_ENV: "2",
                               CHECKPOINT_URI_ENV: str(folder), CHECKPOINT_EVERY_ENV: "50", KEEP_CHECKPOINTS_ENV: "9"},
                    program=[str(EXAMPLE / "train.py"), f"--steps={GROUP_STEPS}", f"--global-batch={GLOBAL_BATCH}",
                             "--step-seconds=0.1", "--log-every=1"])  # fmt: skip

    def group(name: str) -> JobConfig:
        return dataclasses.replace(job, extra_env={**job.extra_env, REPLICA_GROUP_ENV: name})

    def steps() -> list[dict[str, Any]]:
        return [r for r in read_events(events) if r["event"] == "step" and r["rank"] == 0]

    def after(step: int, world: int) -> int:
        """The step once 5 steps at `world` ranks were taken past `step`."""
        wait_for(lambda: steps()[-1]["world_size"] == world and steps()[-1]["step"] >= step + 5, 120,
                 f"5 steps at {world} ranks after step {step}")  # fmt: skip
        return int(steps()[-1]["step"])

    first = nodes(group("a"), 2)
    mate, frozen = nodes(group("b"), 2)
    wait_for(lambda: steps() and steps()[-1]["world_size"] == 4, 120, "both groups training")
    together = after(steps()[-1]["step"], 4)
    frozen.freeze()
    wait_for(lambda: steps()[-1]["world_size"] == 2, 60, "the first group alone")
    frozen.kill()
    (returned,) = nodes(group("b"), 1)  # (its start-up goes beside the first group's steps)
    alone = after(together, 2)
    back = after(alone, 4)
    returned.terminate(grace=30)
    assert returned.poll() == 128 + signal.SIGTERM, returned.log_tail()  # (stopped by the notice, left in time)
    after(back, 2)
    for node in (*first, mate):  # (the mate stood by at the end: its node finishes with the first group)
        assert node.wait(120) == 0, node.log_tail()
    records = read_events(events)
    generations = [r for r in records if r["event"] == "generation"]
    assert len({r["pid"] for r in generations if r["node"] in {n.name for n in first}}) == 2  # never restarted
    assert len({r["pid"] for r in generations if r["node"] == mate.name}) == 2, generations  # ended, by:
    said = mate.log_path.read_text()
    assert "torchspot: replica group b is not whole in round" in said
    assert said.count("torchspot: replica group b has 1 of its 2 nodes in round") == 2  # stood by twice
    healed = [r for r in generations if r["resumed_from"] == "peer"]
    assert {r["node"] for r in healed} == {mate.name, returned.name}, healed
    saved = [r for r in records if r["event"] == "emergency_checkpoint"]
    assert [r["ok"] for r in saved] == [True, True], saved  # (the second group's two workers)
    assert (folder / f"step-{saved[0]['step']:010d}" / ".metadata").exists()
    assert {r["world_size"] for r in steps()} == {2, 4}
    assert [r["step"] for r in steps()] == list(range(1, GROUP_STEPS + 1))  # each step once
    reference = _alone(GROUP_STEPS)
    assert {r["step"]: sorted(r["samples"]) for r in steps()} == {s: ids for s, (_, ids) in reference.items()}
    lines = [json.loads(line) for line in first[0].log_path.read_text().splitlines() if line.startswith('{"step"')]
    assert len(lines) >= GROUP_STEPS - 4  # (a figure whose sum a re-form broke is skipped)
    for line in lines:
        assert line["loss"] == pytest.approx(reference[line["step"]][0], rel=TOLERANCE), line
