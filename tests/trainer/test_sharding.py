"""A sharded run's layout for re-forming in place (elastic/sharding.py, handover.column_of): shards within a
node over the node's own default group, one generation group per column on the round's store, a heal's
state as local shards. Real gloo groups in real processes: 2 nodes of 2 workers, each node's agent folder
its own, the round's store a real TCPStore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchspot_lab.etcd import free_port
from torchspot_trainer import REPLICA_GROUP_ENV, REPLICA_GROUP_SIZE_ENV
from torchspot_trainer.elastic.sharding import COPY_PREFIX, Columns, node_group, node_store
from torchspot_trainer.handover import (
    ASSIGNMENT_FILE,
    Assignment,
    assignment_record,
    column_of,
    group_column_of,
    replica_group,
    whole_groups,
)
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.recovery.generation import generation_prefix

NODES, PER_NODE, STEPS = 2, 2, 3

MODEL = """
import torch

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

def batches(steps):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(steps, 16, 8, generator=generator), torch.randn(steps, 16, 4, generator=generator)
"""

WORKER = (
    MODEL
    + """
import copy, os, sys, time
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchspot_trainer.elastic.sharding import like, local_state, node_group
from torchspot_trainer.handover import Assignment, column_of
from torchspot_trainer.recovery.live import in_place_groups
from torchspot_trainer.recovery.outcome import Outcome

port, node, steps, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
rank, world = node * per_node + local, 2 * per_node
node_group(torch.device("cpu"))
model = build()
fully_shard(model[0], mesh=init_device_mesh("cpu", (per_node,)))
fully_shard(model, mesh=init_device_mesh("cpu", (per_node,)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
live = in_place_groups(torch.device("cpu"))
round_ = Assignment(1, rank, world, "127.0.0.1", port, node=node)
assert live.reconfigure(column_of(round_, local, per_node), time.monotonic() + 30)
inputs, targets = batches(steps)
for step in range(steps):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs[step][rank::world]), targets[step][rank::world])
    loss.backward()  # FSDP2: each gradient's mean over the node's workers, sharded
    grads = [p.grad.to_local() for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    assert live.all_reduce(flat, time.monotonic() + 30) is Outcome.DONE  # over the column: the nodes
    for grad, part in zip(grads, torch.split(flat / 2, [g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))
    optimizer.step()

def full():
    return {name: p.full_tensor() for name, p in model.named_parameters()}

trained = full()
torch.save(trained, f"{out}/trained-{node}{local}.pt")
own = {"model": get_state_dict(model, optimizer)[0], "optimizer": get_state_dict(model, optimizer)[1]}
sent = copy.deepcopy(local_state(own))  # (a copy: what arrives is not the live state)
tensors = [t for part in (sent["model"], *sent["optimizer"]["state"].values()) for t in part.values()
           if isinstance(t, torch.Tensor)]
if node == 1:  # a joiner's state: nothing of the run's, until the heal
    with torch.no_grad():
        for t in tensors:
            t.zero_()
        for p in model.parameters():
            p.to_local().zero_()
for t in tensors:
    assert live.broadcast(t, 0, time.monotonic() + 30) is Outcome.DONE
healed = like(sent, own)
assert all(isinstance(v, DTensor) for v in healed["model"].values())
set_state_dict(model, optimizer, model_state_dict=healed["model"], optim_state_dict=healed["optimizer"])
torch.save(full(), f"{out}/healed-{node}{local}.pt")
dist.barrier()
sys.stdout.flush()
os._exit(0)  # (the generation's gloo group is left to the process's end, as a worker's is)
"""
)


def _one_process(steps: int) -> dict[str, torch.Tensor]:
    """The same model trained on the global batch by one process: the mean of the ranks' mean losses."""
    namespace: dict[str, object] = {}
    exec(MODEL, namespace)  # the workers' model and data, defined once above
    model = namespace["build"]()  # type: ignore[operator]
    inputs, targets = namespace["batches"](steps)  # type: ignore[operator]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    world = NODES * PER_NODE
    for step in range(steps):
        optimizer.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(inputs[step][r::world]), targets[step][r::world])
                  for r in range(world)]  # fmt: skip
        (torch.stack(losses).sum() / world).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return dict(model.named_parameters())


def test_a_column_is_one_worker_per_node_ranked_by_its_node() -> None:
    round_ = Assignment(5, 7, 8, "10.0.0.4", 29400, node=3, grows=True)
    column = column_of(round_, 1, 2)
    assert (column.rank, column.world, column.column, column.node, column.generation, column.grows) == (
        3, 4, 1, 3, 5, True,
    )  # fmt: skip
    assert generation_prefix(column) == "generation/5/column/1/"
    assert generation_prefix(round_) == "generation/5/"
    with pytest.raises(ValueError, match="a round of 7 workers does not make columns of nodes of 2 workers"):
        column_of(Assignment(5, 6, 7, "10.0.0.4", 29400, node=3), 0, 2)


def test_a_column_of_replica_groups_is_one_place_in_every_whole_group() -> None:
    round_ = Assignment(7, 2, 5, "10.0.0.4", 29400, node=2, groups=("b", "a", "b", "c", "a"))
    assert whole_groups(round_.groups, 2) == ["a", "b"]  # (c has one of its two nodes)
    column = group_column_of(round_, "b", 2, place=1)
    assert column is not None
    assert (column.rank, column.world, column.column, column.generation) == (1, 2, 1, 7)
    assert generation_prefix(column) == "generation/7/column/1/"
    assert group_column_of(round_, "c", 2, place=0) is None  # its group is not whole: it holds no column
    assert group_column_of(round_, "a", 2, place=-1) is None  # its group's process group has not formed
    assert replica_group({REPLICA_GROUP_ENV: "b", REPLICA_GROUP_SIZE_ENV: "2"}) == ("b", 2)
    assert replica_group({REPLICA_GROUP_ENV: "b", REPLICA_GROUP_SIZE_ENV: "1"}) == ("", 1)  # a node is a copy
    assert replica_group({REPLICA_GROUP_SIZE_ENV: "2"}) == ("", 1)  # (unnamed: choose_path takes the restart path)


MEMBER = """
import sys, torch
import torch.distributed as dist
from torchspot_trainer.elastic.sharding import copy_group

place = copy_group(torch.device("cpu"), "g", 2)
total = torch.tensor([float(place + 1)])
dist.all_reduce(total)
print(place, int(total.item()), flush=True)
dist.destroy_process_group()
"""


def test_a_replica_groups_members_that_came_in_different_rounds_meet_in_the_newer(tmp_path: Path) -> None:
    """Replica group g of 2 nodes: its first member's agent hands it round 1 (the group whole), the second's
    round 2 only (the rounds moved on while its node started). The first waits for the group on round 1's
    store; when its agent hands it round 2 too, it moves there, and the two make their process group on
    round 2's store, placed by their nodes' order there. Before, each waited on its own round until
    COPY_SECONDS (120 s) ran out and both took the restart path."""
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
              for _ in range(2)]  # fmt: skip
    folders = [tmp_path / "first", tmp_path / "second"]

    def hand(folder: Path, generation: int, node: int, groups: tuple[str, ...]) -> None:
        record = assignment_record(generation, len(groups), "127.0.0.1", stores[generation - 1].port, {0: node},
                                   node=node, groups=groups)  # fmt: skip
        (folder / ASSIGNMENT_FILE).write_text(json.dumps(record))

    members = []
    for folder in folders:
        folder.mkdir()
        env = {**os.environ, PEER_LOST_ENV: str(folder / "peer-lost"), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        members.append(subprocess.Popen([sys.executable, "-c", MEMBER], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))  # fmt: skip
    hand(folders[0], 1, 0, ("g", "g"))
    hand(folders[1], 2, 2, ("g", "h", "g"))
    rounds = [PrefixStore(COPY_PREFIX.format(group="g", generation=n), store) for n, store in enumerate(stores, 1)]
    rounds[0].wait(["here/0"])  # the first is waiting on round 1
    hand(folders[0], 2, 0, ("g", "h", "g"))
    said = [member.communicate(timeout=60) for member in members]
    assert [member.returncode for member in members] == [0, 0], [err[-2000:] for _, err in said]
    assert [out.split() for out, _ in said] == [["0", "3"], ["1", "3"]]  # places by node order in round 2
    assert [round_.compare_set("outcome", "", "?") for round_ in rounds] == [b"moved", b"formed"]


def test_each_incarnation_of_a_nodes_workers_meets_on_a_store_of_its_own(tmp_path: Path) -> None:
    environ = {PEER_LOST_ENV: str(tmp_path / "agent" / "peer-lost"), "TORCHELASTIC_RESTART_COUNT": "2"}
    assert node_store(environ) == tmp_path / "agent" / "node-group-2"
    assert node_store({**environ, "TORCHELASTIC_RESTART_COUNT": "3"}) != node_store(environ)


def test_a_script_that_made_its_own_default_group_is_told_why_it_cannot_shard_in_place() -> None:
    store = TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="default process group exists already: a sharded run in place"):
            node_group(torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_a_receiver_beside_a_step_takes_the_layout_of_its_own_state_built_without_its_gradients() -> None:
    """A heal's receiver beside a step holds that step's gradients when the shards arrive; the layout they
    load into (`like`) is its own state built with the gradients set aside (`Columns.without_gradients`):
    a fresh optimizer's moments there as DTensors, and the same gradients back on the parameters."""
    model = torch.nn.Linear(4, 3)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()  # the step it sits out, taken on the state it had
    grads = [parameter.grad for parameter in model.parameters()]
    columns = Columns(torch.device("cpu"), environ={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    columns.parameters = list(model.parameters())
    layout: dict[str, Any] = columns.without_gradients(lambda: dict(get_state_dict(model, optimizer)[1]))
    moments = [value for entry in layout["state"].values() for key, value in entry.items() if key != "step"]
    assert len(moments) == 4
    assert all(isinstance(moment, DTensor) for moment in moments)
    assert all(parameter.grad is grad for parameter, grad in zip(model.parameters(), grads, strict=True))


def test_shards_within_nodes_and_columns_across_them_train_the_one_process_model_and_heal_by_shard(
    tmp_path: Path,
) -> None:
    """FSDP2 over each node's own group, each rank's gradient shards averaged over its column's generation
    group: the parameters are one process's (float32 order). Then node 1's ranks, their state zeroed, take
    node 0's local shards over their columns, loaded back as DTensors in their own layout: node 0's model."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    workers = []
    for node in range(NODES):
        agent = tmp_path / f"agent-{node}"
        agent.mkdir()
        for local in range(PER_NODE):
            env = {**os.environ, PEER_LOST_ENV: str(agent / "peer-lost"), "LOCAL_RANK": str(local),
                   "LOCAL_WORLD_SIZE": str(PER_NODE), "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
            command = [sys.executable, "-c", WORKER, str(port), str(node), str(STEPS), str(tmp_path)]
            workers.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True))
    errors = [worker.communicate(timeout=120)[1] for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * len(workers), errors
    del store
    expected = _one_process(STEPS)
    for node in range(NODES):
        for local in range(PER_NODE):
            trained = torch.load(tmp_path / f"trained-{node}{local}.pt")
            for name, value in expected.items():
                torch.testing.assert_close(trained[name], value.detach(), rtol=0, atol=1e-6)
    reference = torch.load(tmp_path / "trained-00.pt")
    for local in range(PER_NODE):
        healed = torch.load(tmp_path / f"healed-1{local}.pt")
        assert all(torch.equal(healed[name], reference[name]) for name in reference)
