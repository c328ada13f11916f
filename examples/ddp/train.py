"""The plain DDP script beside it (plain.py), made elastic with torchspot's recovery API.

Launched by torchspot-run (an ElasticJob's workers, or the lab), a membership change restarts no
process: the survivors re-form in place, a joiner is healed from a live peer, every sample is trained
once per epoch, and the model is the one an uninterrupted run computes. Launched by plain torchrun, the
same script takes the restart path and resumes from its newest checkpoint.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from common import build_model, synthetic_data

from torchspot import elastic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="least seconds a step takes (a bigger model)")
    args = parser.parse_args()

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    inputs, labels = (tensor.to(device) for tensor in synthetic_data())
    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    manager = elastic.Manager(
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), optimizer.load_state_dict(s["optimizer"])),
    )  # checkpoints: where the ElasticJob's spec.checkpoint says (TORCHSPOT_CHECKPOINT_*)
    ddp = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, optimizer)
    sampler = elastic.ElasticSampler(manager, len(inputs), global_batch=args.global_batch)
    while manager.current_step() < args.steps:
        begun = time.monotonic()
        optimizer.zero_grad()
        batch = sampler.indices()
        loss = F.cross_entropy(ddp(inputs[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - begun)))
    manager.close()


if __name__ == "__main__":
    main()
