"""A sharded state's snapshots (recovery/reshard.py): which set a round resumes from, and the resume itself, an
FSDP2 model's and AdamW's shards written at 2 ranks and loaded at 3, one of which holds none. Real gloo
processes; the snapshot files written as a worker writes them (snapshot.LocalSnapshot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchspot_lab.etcd import free_port
from torchspot_trainer.recovery.reshard import Holding, choose_set
from torchspot_trainer.recovery.snapshot import Held

WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchspot_trainer.recovery.reshard import own_shards, resume_from
from torchspot_trainer.recovery.snapshot import LocalSnapshot

phase, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0 if phase == "write" else 1)  # (the reader's own start differs: what it loads must win)
model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
fully_shard(model[0], mesh=init_device_mesh("cpu", (world,)))
fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

def state():
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"user": {"model": model_state, "optimizer": optimizer_state},
            "torchspot": {"step": 2, "positions": [{"taken": 48}]}}

def whole():
    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors = {f"model.{k}": v.full_tensor() for k, v in model_state.items()}
    for fqn, moments in optimizer_state["state"].items():
        for name, value in moments.items():
            tensors[f"optimizer.{fqn}.{name}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return tensors

if phase == "write":
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(16, 8, generator=generator)[rank::world]).square().mean().backward()
        optimizer.step()
    snapshot = LocalSnapshot(__import__("pathlib").Path(out) / f"shards-{rank}.pt")
    assert snapshot.write({"step": 2, **own_shards(state())}, 0) is not None
    reference = whole()
    if rank == 0:
        torch.save(reference, f"{out}/reference.pt")
else:
    held_by = {0: 1, 2: 0}  # new rank -> the writer rank whose file it holds; new rank 1 holds none
    mine = []
    if rank in held_by:
        mine.append(LocalSnapshot(__import__("pathlib").Path(out) / f"shards-{held_by[rank]}.pt").read())
    group = dist.new_group(backend="gloo")
    assert resume_from(group, mine, state, lambda: 3) is None  # a newer checkpoint: it wins
    loaded = resume_from(group, mine, state, lambda: 2)
    assert loaded is not None
    set_state_dict(model, optimizer, model_state_dict=loaded["user"]["model"],
                   optim_state_dict=loaded["user"]["optimizer"])
    local = [p.to_local().shape[0] for p in model.parameters()]
    mine_now = whole()
    if rank == 0:
        torch.save(mine_now, f"{out}/resharded.pt")
    print(json.dumps({"rank": rank, "torchspot": loaded["torchspot"], "rows": local}))
dist.barrier()
dist.destroy_process_group()
"""


def _run(phase: str, world: int, out: Path) -> list[str]:
    """`world` gloo processes of WORKER's `phase`; each one's stdout, once all exited with 0."""
    common = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, phase, str(out)],
            env={**common, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    said = [worker.communicate(timeout=120) for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * world, [err[-3000:] for _, err in said]
    return [stdout for stdout, _ in said]


@pytest.mark.slow(seconds=12)  # five processes that import torch's FSDP2, on 2 cores
def test_shards_written_at_two_ranks_load_at_three_from_the_ranks_that_hold_them(tmp_path: Path) -> None:
    """Two ranks train an FSDP2 model (rows that do not divide evenly) and AdamW two steps and write their
    snapshots; three ranks, the first and last holding the two files in the other order and the middle one
    none, resume from them: every parameter and moment is the writers' (exactly), each rank holds its own
    rows of them, and the manager's part (step, positions) comes along. A newer committed checkpoint wins."""
    _run("write", 2, tmp_path)
    said = _run("read", 3, tmp_path)
    reference, resharded = torch.load(tmp_path / "reference.pt"), torch.load(tmp_path / "resharded.pt")
    assert set(resharded) == set(reference)
    assert any(name.endswith("exp_avg") for name in reference)  # the optimizer's moments too
    for name, value in reference.items():
        assert torch.equal(resharded[name], value), name
    lines = [json.loads(out) for out in said]
    assert all(line["torchspot"] == {"step": 2, "positions": [{"taken": 48}]} for line in lines)
    assert [line["rows"] for line in lines] == [[11, 11, 2, 2], [11, 11, 2, 2], [11, 11, 1, 1]]  # 33 and 5 rows


def _holds(base: int, step: int, rank: int, world: int) -> Holding:
    return Holding(Held(base, step), rank, world)


def test_the_newest_whole_set_of_snapshots_wins_unless_a_checkpoint_is_newer() -> None:
    """A set is one lineage, step and world size; it is whole where every writer rank is held, and the newest
    whole one wins, each writer held by the lowest new rank that holds it; a node lost without notice leaves
    its set incomplete, unless a trade's copy of its shards is held elsewhere (recovery/peer_copy.py)."""
    stale, fresh = [_holds(0, 50, r, 2) for r in range(2)], [_holds(50, 80, r, 3) for r in range(3)]
    # writer rank 2 of step 80 was on the lost node: the older set, whole, wins
    assert choose_set([[fresh[0]], [stale[1]], [fresh[1]], [stale[0]]], None) == (Held(0, 50), [3, 1])
    assert choose_set([[fresh[1]], [fresh[2]], [], [fresh[0]], [fresh[1]]], None) == (Held(50, 80), [3, 0, 1])
    assert choose_set([[fresh[0]], [stale[1]], [fresh[1]], [stale[0]]], 60) is None  # a newer checkpoint
    assert choose_set([[fresh[0]], [fresh[1]], []], 70) is None  # not whole
    assert choose_set([[], []], None) is None
    assert choose_set([[_holds(0, 9, 1, 1)]], None) is None  # (a rank outside its world: not a snapshot of it)
    # Trades every 10 steps, 3 nodes of one rank: each holds its live snapshot (step 83), its own copy of the
    # last trade (step 80) and its source's. The third node is lost: the trade's set is whole, the live one not.
    live = [_holds(50, 83, r, 3) for r in range(3)]
    held = [[live[0], fresh[0], fresh[2]], [live[1], fresh[1], fresh[0]]]
    assert choose_set(held, None) == (Held(50, 80), [0, 1, 0])
    assert choose_set([*held, [live[2], fresh[2], fresh[1]]], None) == (Held(50, 83), [0, 1, 2])  # none lost
