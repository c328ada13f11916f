"""A sharded run's layout for re-forming in place (docs/sharded-in-place.md): each node holds one copy of
the state, sharded over its own workers, so the shards never cross a node and a remote node's loss or
freeze never reaches a shard's collectives. Where the job's replica groups span nodes, each group holds one
copy, sharded over its nodes' workers (`copy_group`), and a group that loses a member is lost as a whole: its
other workers end their processes (`Columns.copy_lost`, the one abort that ends a collective in flight on
gloo too), stand by when they start again, and are healed by column once the group is whole.

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
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, PrefixStore, TCPStore  # what torch.distributed re-exports
from torch.distributed.tensor import DTensor

from torchspot_trainer.elastic.riders import Line
from torchspot_trainer.handover import (
    Assignment,
    Handover,
    agent_folder,
    column_of,
    group_column_of,
    replica_group,
    whole_groups,
)
from torchspot_trainer.recovery.notices import EXIT_FAILED
from torchspot_trainer.recovery.outcome import Outcome

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchspot_trainer.elastic.groups import InPlaceGroups

__all__ = ["Columns", "copy_group", "like", "local_state", "node_group", "node_store", "restart_mesh"]

T = TypeVar("T")

NODE_STORE = "node-group-{restart}"
"""The node group's file store in the agent's folder, by TORCHELASTIC_RESTART_COUNT."""
COPY_PREFIX = "replica-group/{group}/{generation}/"
"""A replica group's keys on the store of the round it met in (`_Meeting`), its process group's under them."""
COPY_SECONDS = 120.0
"""The timeout of a replica group's store and process group: its forming once its workers met (`_Meeting`:
they wait for one another there, without one), and its collectives after. A member that is lost is not
waited for: its group's other workers end their processes (`Columns.copy_lost`)."""
STANDBY_LOOK_SECONDS = 0.05
"""Between a standing-by worker's looks at its agent's assignment (`copy_group`)."""


_OWN_GROUP = (
    "torch's default process group exists already: a sharded run in place shards within each copy of the "
    "state, over the group the manager makes (do not call init_process_group; or call it before making the "
    "Manager, which then takes the restart path)"
)


def node_store(environ: Mapping[str, str] = os.environ) -> Path:
    """Where this incarnation of the node's workers meets (pure): a restarted set of workers never finds a
    store its predecessors left behind."""
    return agent_folder(environ) / NODE_STORE.format(restart=environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def node_group(device: torch.device, environ: Mapping[str, str] = os.environ) -> None:
    """Make torch's default process group over this node's LOCAL_WORLD_SIZE workers (NCCL on a GPU, else
    gloo). Raises RuntimeError where the script made a default group already: it would span every node,
    and a lost node would hang the shards' collectives."""
    if dist.is_initialized():
        raise RuntimeError(_OWN_GROUP)
    size = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    store = FileStore(str(node_store(environ)), size)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo", store=store, rank=int(environ.get("LOCAL_RANK", "0")),
        world_size=size, device_id=device if device.type == "cuda" else None,
    )  # fmt: skip


def copy_group(device: torch.device, group: str, nodes: int, environ: Mapping[str, str] = os.environ) -> int:
    """Make torch's default process group over this worker's replica group `group` of `nodes` nodes (their
    LOCAL_WORLD_SIZE workers each), once the group's workers have all met in one round in which it is whole
    (`_Meeting`), on that round's store (`COPY_PREFIX`), each worker placed by its node's place among the
    group's nodes in that round. Until then the worker stands by, saying so once: the group's nodes may come
    at different times, and in different rounds (the rounds move on while a node starts): a worker that met
    in one round moves to a newer one in which the group is whole unless the group met where it is already.
    Returns this worker's place (its rank there, which names its shard). Raises RuntimeError where the script
    made a default group already (`node_group`), or where the group's process group does not form within
    COPY_SECONDS once its workers met: the worker then takes the restart path."""
    if dist.is_initialized():
        raise RuntimeError(_OWN_GROUP)
    per_node, local = int(environ.get("LOCAL_WORLD_SIZE", "1")), int(environ.get("LOCAL_RANK", "0"))
    reader = Handover(agent_folder(environ), local)
    said, meeting = False, None
    while True:
        assignment = reader.read_as_written()
        whole = assignment is not None and group in whole_groups(assignment.groups, nodes)
        newer = whole and assignment is not None and (meeting is None or assignment.generation > meeting.generation)
        if newer and assignment is not None and (meeting is None or meeting.moved()):
            meeting = _Meeting(assignment, group, nodes, per_node, local)
        if whole and meeting is not None and meeting.met():  # (not where the newest round lost a member)
            break
        if assignment is not None and not whole and not said:
            present = sum(1 for name in assignment.groups if name == group)
            print(f"torchspot: replica group {group} has {present} of its {nodes} nodes in round "
                  f"{assignment.generation}: standing by until it is whole", file=sys.stderr, flush=True)  # fmt: skip
            reader.stand_by(True)  # (its agent finishes it where the run finishes meanwhile)
            said = True
        time.sleep(STANDBY_LOOK_SECONDS)
    reader.stand_by(False)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo", store=PrefixStore("group/", meeting.store),
        rank=meeting.place, world_size=nodes * per_node, timeout=timedelta(seconds=COPY_SECONDS),
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    return meeting.place


class _Meeting:
    """A replica group's workers meeting in one round before they make their process group (`copy_group`):
    each says it is here on the round's store; the group forms there once all are, unless one of them moved
    to a newer round first. One key decides which, set once by whoever comes first (the store's compare-and-
    set): `FORMED` by a worker that found all here, `MOVED` by one that saw a newer round in which the group
    is whole. Without it two workers that entered different rounds waited for each other in two places
    until COPY_SECONDS ran out. A round whose store is gone counts as moved from."""

    FORMED, MOVED = "formed", "moved"

    def __init__(self, assignment: Assignment, group: str, nodes: int, per_node: int, local: int) -> None:
        own = [node for node, name in enumerate(assignment.groups) if name == group]
        self.generation = assignment.generation
        self.place = own.index(assignment.node) * per_node + local
        self._size = nodes * per_node
        store = TCPStore(assignment.store_host, assignment.store_port, is_master=False,
                         timeout=timedelta(seconds=COPY_SECONDS))  # fmt: skip
        self.store = PrefixStore(COPY_PREFIX.format(group=group, generation=assignment.generation), store)
        self.store.set(f"here/{self.place}", "1")

    def met(self) -> bool:
        """Whether the group forms in this round: all its workers here, and none moved on first."""
        try:
            if not self.store.check([f"here/{place}" for place in range(self._size)]):
                return False
            return self._settle(self.FORMED) == self.FORMED
        except (RuntimeError, OSError):  # (the round's store is gone: the group forms in a newer round)
            return False

    def moved(self) -> bool:
        """Move on from this round, unless the group formed in it (then this worker forms it too)."""
        try:
            return self._settle(self.MOVED) == self.MOVED
        except (RuntimeError, OSError):
            return True

    def _settle(self, outcome: str) -> str:
        return bytes(self.store.compare_set("outcome", "", outcome)).decode()


def restart_mesh(device: torch.device, shard_size: int) -> DeviceMesh:
    """A sharded run's mesh on the restart path, over torch's default group of every rank: HSDP's
    ("replicate", "shard") where `shard_size` ranks hold one copy and the world makes two or more such
    groups, else one dimension over every rank (FSDP)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - (with the group, not before)

    world, kind = dist.get_world_size(), device.type
    if shard_size <= 0 or world % shard_size or world == shard_size:
        return init_device_mesh(kind, (world,))
    return init_device_mesh(kind, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


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


class Columns:
    """One worker's part in a sharded run in place (module docstring): its node's workers agree, over the
    node's group, on what each of their columns saw, so that they act as one copy of the state.

    - At a step's start every worker of the node re-forms where any of them must (`reform_now`): each
      reads the same assignment from the node's agent, so they enter the same round, and a step's
      attempt is never split over two generations.
    - At a step's end (`agree`) the update is applied on every worker of the node or on none (one failed
      column fails the node's step: its shards are one copy), a switch to a joiner's group and every
      notice any of them saw are every worker's. A node that applied while another did not is healed in
      the next round, as any rank that did not commit (heal.py: the newest step's holder sends), and every
      column heals from the same node, since a node's workers always hold the same step.

    Where the job's replica groups span nodes, read "copy" for "node" above: the workers that agree are the
    group's, over its process group (`copy_group`), and a worker's column is its place there.

    :param device: where the node's agreements run (its GPU: the node's group is NCCL there).
    :param environ: LOCAL_RANK and LOCAL_WORLD_SIZE; REPLICA_GROUP_ENV and REPLICA_GROUP_SIZE_ENV (over 1:
        each replica group of that many nodes holds one copy).
    """

    def __init__(self, device: torch.device, environ: Mapping[str, str] = os.environ) -> None:
        self.device = device
        self.local = int(environ.get("LOCAL_RANK", "0"))
        self.per_node = int(environ.get("LOCAL_WORLD_SIZE", "1"))
        self.group, self.nodes = replica_group(environ)
        """This node's replica group, and the nodes one copy of the state spans: its group's, else 1 (each
        node a copy)."""
        self.per_copy = self.nodes * self.per_node
        """The workers that hold one copy between them."""
        self.place = self.local if self.nodes == 1 else -1
        """This worker's rank among its copy's workers (its shard): known once its copy's group formed."""
        self.parameters: list[torch.Tensor] = []
        """The model's parameters (`OptimizerWrapper` gives its optimizer's): their local gradient shards
        travel over the column (`reduce`)."""
        self._made = False

    def ensure_group(self) -> None:
        """The copy's group as torch's default one, made once: the node's (`node_group`), or the replica
        group's once it is whole (`copy_group`: the worker stands by until then)."""
        if not self._made:
            if self.nodes == 1:
                node_group(self.device)
            else:
                self.place = copy_group(self.device, self.group, self.nodes)
            self._made = True

    def mesh(self) -> DeviceMesh:
        """The 1-D device mesh over the copy's workers, which FSDP2's `fully_shard` shards over."""
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - (with the group, not before)

        self.ensure_group()
        return init_device_mesh(self.device.type, (self.per_copy,))

    def global_rank(self, column_rank: int) -> int:
        """This worker's rank in the run (what the data is dealt by) from its rank in its column: its copy's."""
        return column_rank * self.per_copy + self.place

    def view(self, assignment: Assignment) -> Assignment | None:
        """A round as this worker's column sees it (handover.py's `column_of`, `group_column_of`): None where
        its replica group is not whole there, or has not formed yet."""
        if self.nodes == 1:
            return column_of(assignment, self.local, self.per_node)
        return group_column_of(assignment, self.group, self.nodes, self.place)

    def copy_lost(self, assignment: Assignment) -> None:
        """A round in which this worker's replica group is not whole (a member lost or frozen), seen on the
        hand-over's watcher thread: where the group had formed, the worker ends its process at once, with
        the code for which its agent restarts it. Its shards are an incomplete copy that no collective can
        complete, and its training thread may wait in one of FSDP's with the gone member, which only the
        process's end stops on gloo (torch's abort does not). Started again, it stands by until the group
        is whole, then is healed by column (`copy_group`). A group that has not formed holds nothing."""
        if not self._made or self.nodes == 1:
            return
        print(f"torchspot: replica group {self.group} is not whole in round {assignment.generation}: this "
              "worker's copy is incomplete; it ends, to be healed once the group is whole again",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.stdout.flush()
        os._exit(EXIT_FAILED)

    def without_gradients(self, build: Callable[[], T]) -> T:
        """`build()` with the parameters' gradients set aside meanwhile. A heal's receiver beside a step
        (heal.py) builds its own state as the layout to load the sender's shards into (`like`) after the
        step's backward; torch's `get_state_dict` makes a fresh optimizer's state (its DTensor moments)
        only where no parameter has a gradient, and without it the shards would load as plain tensors."""
        kept = [p.grad for p in self.parameters]
        for parameter in self.parameters:
            parameter.grad = None
        try:
            return build()
        finally:
            for parameter, grad in zip(self.parameters, kept, strict=True):
                parameter.grad = grad

    def reform_now(self, mine: bool) -> bool:
        """Whether any worker of the node must re-form before this step (`mine`: this one must)."""
        flag = torch.tensor([float(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def reduce(
        self, groups: InPlaceGroups, **reduce: Any
    ) -> tuple[list[torch.Tensor], torch.futures.Future[torch.Tensor]]:
        """The step's gradients: this worker's local gradient shards (as FSDP2 left them, the mean over the
        node's workers), averaged over its column as one bucket whose last part carries the riders
        (`groups.reduce_flat`, `reduce` its keywords), its end waited for here, as DDP waits for its buckets
        before the update: posted until then, a newer round gives it up. The shards, and the future whose
        value is their average (`take`)."""
        grads = [local_state(p.grad) for p in self.parameters if p.grad is not None]
        future = groups.reduce_flat(torch.cat([grad.reshape(-1) for grad in grads]), **reduce)
        future.wait()
        return grads, future

    @staticmethod
    def take(shards: tuple[list[torch.Tensor], torch.futures.Future[torch.Tensor]]) -> None:
        """The column's average (`reduce`) back into the local gradient shards, before the update."""
        grads, average = shards[0], shards[1].value().reshape(-1)
        for grad, part in zip(grads, torch.split(average, [g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def agree(self, world: int, lines: list[Line] | None) -> list[Line] | None:
        """The column's lines of a step (riders.py: in columns of `world` nodes, every worker of the node
        in the same generation: `reform_now`) as the node's workers agree on them: None where any worker's
        column did not complete (`lines` None), else each node's notice level and whether a joiner is
        ready, as any worker of the node saw them."""
        seen = torch.zeros(2 + world, device=self.device)
        seen[0] = float(lines is None)
        if lines is not None:
            seen[1] = float(any(line.ready for line in lines))
            seen[2:] = torch.tensor([float(line.level) for line in lines])
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        values = seen.tolist()
        if values[0] > 0 or lines is None:
            return None
        return [Line(values[1] > 0, round(level), line.node) for level, line in zip(values[2:], lines, strict=True)]

    def agree_notices(self, world: int, rows: list[list[int]] | None) -> list[list[int]] | None:
        """A boundary's [notice level, node] rows between steps (`Manager.heed_notices`) as the node's workers
        agree on them (`agree`): `rows` this worker's column's gather, None where it did not complete; None
        where any worker's did not, else every notice any of them saw."""
        lines = self.agree(world, None if rows is None else [Line(False, level, node) for level, node in rows])
        return None if lines is None else [[line.level, line.node] for line in lines]

    def all_reduce(self, tensor: torch.Tensor, over_column: Callable[[torch.Tensor], Outcome]) -> Outcome:
        """A sum over the run: over the node's workers, then over the column (`over_column`); where the
        column's did not complete, `tensor` is left as it was."""
        before = tensor.clone()
        dist.all_reduce(tensor)
        outcome = over_column(tensor)
        if outcome is not Outcome.DONE:
            tensor.copy_(before)
        return outcome
