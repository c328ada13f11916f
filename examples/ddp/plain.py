"""A plain DDP training script: an MLP on synthetic data, launched with torchrun.

The starting point of train.py beside it, which is this script made elastic with torchspot's recovery
API (the README shows the diff). Here a membership change ends the run: torchrun restarts every worker,
and the script, with no checkpoint, starts again from step 0.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import build_model, synthetic_data
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="least seconds a step takes (a bigger model)")
    args = parser.parse_args()

    dist.init_process_group()  # NCCL for GPU tensors, gloo for CPU ones
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    inputs, labels = (tensor.to(device) for tensor in synthetic_data())
    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ddp = DistributedDataParallel(model)
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        begun = time.monotonic()
        optimizer.zero_grad()
        start = step * args.global_batch % len(inputs)
        batch = order[start : start + args.global_batch][dist.get_rank() :: dist.get_world_size()]
        loss = F.cross_entropy(ddp(inputs[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - begun)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
