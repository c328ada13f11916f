"""A GPT-style causal language model sharded with FSDP2, trained in a plain loop with torchspot's recovery API.

GPT-2's architecture (pre-LayerNorm blocks of causal self-attention and a GELU MLP), written here in plain
torch, each block sharded on its own (`fully_shard`), trained on the corpus examples/transformers/corpus.py
generates. `Manager(sharded=True)`: every rank checkpoints its own shards through DCP (to the job's Blob),
an eviction notice makes every rank write its shards of the emergency checkpoint at once, and a restart
resumes at any world size, each sample trained once. `--bf16` computes in bfloat16 on GPUs, the parameters
and the gradients' reduction kept in float32 (FSDP2's mixed precision). `--shard-size N` shards the model
over groups of N ranks that each hold one copy of it (HSDP: the copies are replicas, their gradients
all-reduced), where the world size divides into such groups; elsewhere over every rank (FSDP), said in
one line: a checkpoint of either loads into the other. Under torchspot-run it re-forms in place instead
of restarting: each node one copy of the model, sharded over its own workers, or, where the job's replica
groups span nodes, each group one copy, sharded over its nodes' workers (`Manager.shard_mesh`), the copies
kept alike by the manager (docs/sharded-in-place.md); with `--restart-path` every worker restarts at each
membership change.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchspot import elastic

try:  # its image copies the corpus beside it (Dockerfile)
    from corpus import SEQUENCE, VOCABULARY, corpus
except ImportError:  # a checkout: the Transformers example's, in the folder beside this one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transformers"))
    from corpus import SEQUENCE, VOCABULARY, corpus


class Block(nn.Module):
    """One GPT-2 block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (part.view(batch, length, self.heads, -1).transpose(1, 2) for part in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, the blocks, a final norm and the next token's logits."""

    def __init__(self, vocabulary: int, *, context: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocabulary, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocabulary, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> GPT:
    """A two-layer GPT over the corpus's characters, initialised alike on every rank (before sharding)."""
    torch.manual_seed(0)
    return GPT(len(VOCABULARY), context=SEQUENCE, width=32, heads=2, layers=2)


def shard(model: GPT, *, bf16: bool, mesh: DeviceMesh | None = None) -> None:
    """Each block its own FSDP2 unit (its parameters gathered only around its own passes), then the rest;
    over `mesh` (`Manager.shard_mesh`), else over every rank."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy over `batch`'s sequences."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def evaluate(manager: elastic.Manager, model: nn.Module, batches: list[torch.Tensor]) -> float | None:
    """The mean loss over `batches`, each rank its share of each; None where the group changed meanwhile (the
    loop goes on from the state it holds: a heal may have replaced it). Between batches the eviction
    notices are heeded: one that comes during the evaluation has its emergency checkpoint at once."""
    total = torch.zeros(2, device=batches[0].device)
    with torch.no_grad():
        for batch in batches:
            if manager.heed_notices():
                return None
            mine = batch[manager.rank :: manager.world_size]
            total[0] += loss_of(model, mine).float() * len(mine)
            total[1] += len(mine)
    return float(total[0] / total[1]) if manager.all_reduce(total) else None


def arguments() -> argparse.Namespace:
    """The example's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=24, help="sequences per step, at any world size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16 (GPUs)")
    # An ElasticJob's replicaGroupSize reaches each pod as TORCHSPOT_REPLICA_GROUP_SIZE (nodes; absent: no groups).
    group = int(os.environ.get("TORCHSPOT_REPLICA_GROUP_SIZE", "0")) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    parser.add_argument("--shard-size", type=int, default=group,
                        help="ranks that hold one copy (HSDP); 0: all (FSDP); default: the job's groups")  # fmt: skip
    parser.add_argument("--step-seconds", type=float, default=0.0, help="least seconds a step takes (a bigger model)")
    parser.add_argument("--log-every", type=int, default=50, help="steps between lines of the mean loss")
    parser.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: none)")
    path = parser.add_mutually_exclusive_group()  # (neither: in place wherever it can run, said in one line)
    path.add_argument("--in-place", action="store_true",
                      help="re-form in place (each node, or replica group, one copy), or stop")  # fmt: skip
    path.add_argument("--restart-path", action="store_true", help="restart every worker at each membership change")
    parser.add_argument("--peer-copy-every", type=int, default=0,
                        help="restart path: steps between trades of each rank's shards with the next node's, so a "
                             "node lost without notice loses no step (0: none)")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    args = arguments()

    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    model: GPT | None = None
    optimizer: torch.optim.Optimizer | None = None

    def state_dict() -> dict[str, object]:
        weights, moments = get_state_dict(model, optimizer)
        return {"model": weights, "optimizer": moments}

    def load_state_dict(state: dict[str, object]) -> None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    in_place = False if args.restart_path else args.in_place or None  # (None: wherever it can run)
    manager = elastic.Manager(state_dict, load_state_dict, sharded=True, device=device, in_place=in_place,
                              peer_copy_every=args.peer_copy_every)  # fmt: skip
    model = build_model().to(device)
    mesh = manager.shard_mesh(args.shard_size)  # (in place: the node's workers; else HSDP's groups, or all)
    if args.shard_size and mesh.ndim == 1 and not manager.in_place and manager.rank == 0:
        print(f"fsdp example: {manager.world_size} ranks do not make replica groups of {args.shard_size}: FSDP "
              "over all of them", file=sys.stderr, flush=True)  # fmt: skip
    shard(model, bf16=args.bf16, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    stepper = elastic.OptimizerWrapper(manager, optimizer)
    tokens = corpus().to(device)
    sampler = elastic.ElasticSampler(manager, len(tokens), global_batch=args.global_batch)
    evaluation = list(tokens[: 2 * args.global_batch].split(args.global_batch))  # (a fixed set, for the example)
    while manager.current_step() < args.steps:
        begun = time.monotonic()
        stepper.zero_grad()
        sits_out = manager.state_arriving  # (healed beside this step: its loss counts nothing, its state comes)
        indices = sampler.indices()
        loss = loss_of(model, tokens[indices])
        loss.backward()  # FSDP2 reduce-scatters each block's gradients as its backward ends
        applied = stepper.step()  # (a step not applied: not logged, nor evaluated after)
        logs = applied and manager.current_step() % args.log_every == 0
        total = loss.detach().float() * (0 if sits_out else len(indices))
        if logs and manager.all_reduce(total) and manager.rank == 0:
            line = {"step": manager.current_step(), "loss": float(total) / args.global_batch}
            print(json.dumps(line), flush=True)
        evaluates = applied and args.eval_every and manager.current_step() % args.eval_every == 0
        if evaluates and not manager.state_arriving:
            figure = evaluate(manager, model, evaluation)
            if figure is not None and manager.rank == 0:
                print(json.dumps({"evaluation": manager.current_step(), "loss": figure}), flush=True)
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - begun)))
    manager.close()


if __name__ == "__main__":
    main()
