"""A Hugging Face Transformers causal language model trained in a plain loop with torchspot's recovery API.

GPT-2's architecture built from a config (small, randomly initialised, dropout off so that every world
size computes the same steps), trained on the corpus corpus.py generates. Under torchspot-run a
membership change restarts no process; under plain torchrun it resumes from its newest checkpoint.
"""

import argparse
import contextlib
import os
import time

import torch
from corpus import VOCABULARY, corpus
from transformers import GPT2Config, GPT2LMHeadModel

from torchspot import elastic


def build_model() -> GPT2LMHeadModel:
    """A two-layer GPT-2 over the corpus's characters, initialised alike on every rank."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(VOCABULARY), n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=24, help="sequences per step, at any world size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="the model's")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="least seconds a step takes (a bigger model)")
    parser.add_argument("--log-every", type=int, default=50, help="steps between lines of the mean loss")
    parser.add_argument("--micro-batches", type=int, default=1, help="per step, each rank's share in this many passes")
    args = parser.parse_args()

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    tokens = corpus().to(device)
    model = build_model().to(device, getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    manager = elastic.Manager(
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), optimizer.load_state_dict(s["optimizer"])),
    )
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, optimizer)
    sampler = elastic.ElasticSampler(manager, len(tokens), global_batch=args.global_batch)
    while manager.current_step() < args.steps:
        begun = time.monotonic()
        optimizer.zero_grad()
        indices = torch.tensor(sampler.indices())
        total = torch.zeros(1, device=device, dtype=model.dtype)
        passes = indices.chunk(args.micro_batches)  # gradient accumulation: DDP all-reduces after the last one
        for number, chunk in enumerate(passes):
            with contextlib.nullcontext() if number == len(passes) - 1 else ddp.no_sync():
                batch = tokens[chunk]
                loss = ddp(input_ids=batch, labels=batch).loss * (len(chunk) / len(indices))
                loss.backward()
            total += loss.detach()  # this rank's mean over its sequences, once all passes are in
        logs = optimizer.step() and manager.current_step() % args.log_every == 0
        if logs and manager.all_reduce(total) and manager.rank == 0:  # every rank sums (False: the group changed)
            print(f"step {manager.current_step()}: loss {float(total) / manager.world_size:.4f}", flush=True)
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - begun)))
    manager.close()


if __name__ == "__main__":
    main()
