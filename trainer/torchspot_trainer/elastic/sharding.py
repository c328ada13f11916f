"""A sharded run's layout for re-forming in place (docs/sharded-in-place.md): each node holds one copy of
the state, sharded over its own workers, so the shards never cross a node and a remote node's loss or
freeze never reaches a shard's collectives.

- `node_group`: torch's default process group over this node's workers only, on a file store in the
  agent's folder named by the agent's restart count (a new incarnation of the node's workers gets a new
  one). FSDP2 shards over it, and DCP saves and loads over it: one node's ranks write a whole checkpoint.
- The replicate dimension is one column per local rank: local rank i of every node holds the same shard,
  and column i's workers re-form together in the round's generations (handover.column_of), where the
  gradients are averaged and a heal's state travels, as a replicated run's do over every rank.
- `local_state` and `like`: a heal's state as each rank's local shards (what its column peer holds too),
  and back into DTensors laid out as the receiver's own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore  # what torch.distributed re-exports
from torch.distributed.tensor import DTensor

from torchspot_trainer.handover import agent_folder

__all__ = ["like", "local_state", "node_group", "node_store"]

NODE_STORE = "node-group-{restart}"
"""The node group's file store in the agent's folder, by TORCHELASTIC_RESTART_COUNT."""


def node_store(environ: Mapping[str, str] = os.environ) -> Path:
    """Where this incarnation of the node's workers meets (pure): a restarted set of workers never finds a
    store its predecessors left behind."""
    return agent_folder(environ) / NODE_STORE.format(restart=environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def node_group(device: torch.device, environ: Mapping[str, str] = os.environ) -> None:
    """Make torch's default process group over this node's LOCAL_WORLD_SIZE workers (NCCL on a GPU, else
    gloo). Raises RuntimeError where the script made a default group already: it would span every node,
    and a lost node would hang the shards' collectives."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch's default process group exists already: a sharded run in place shards within each node, "
            "over the group the manager makes (do not call init_process_group)"
        )
    size = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    store = FileStore(str(node_store(environ)), size)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo", store=store, rank=int(environ.get("LOCAL_RANK", "0")),
        world_size=size, device_id=device if device.type == "cuda" else None,
    )  # fmt: skip


def local_state(state: Any) -> Any:
    """`state` with each DTensor as its local shard (a new structure over the same tensors): what a heal
    sends within a column, whose members hold the same shards."""
    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {key: local_state(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_state(value) for value in state)
    return state


def like(state: Any, template: Any) -> Any:
    """`state`, a heal's local shards, with each tensor where `template` (the receiver's own state) holds
    a DTensor made one laid out as that one, on its device: the receiver holds the same shard as the sender
    (same column), so its own layout is the state's."""
    if isinstance(template, DTensor) and isinstance(state, torch.Tensor):
        return DTensor.from_local(
            state.to(template.device), template.device_mesh, template.placements, run_check=False,
            shape=template.shape, stride=template.stride(),
        )  # fmt: skip
    if isinstance(template, Mapping) and isinstance(state, dict):
        return {key: like(value, template.get(key)) for key, value in state.items()}
    if isinstance(template, list | tuple) and isinstance(state, list | tuple) and len(template) == len(state):
        return type(state)(like(value, mold) for value, mold in zip(state, template, strict=True))
    return state
