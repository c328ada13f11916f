"""The recovery API for any training loop: a script that calls it re-forms in place.

A loop calls a `Manager` at a handful of points, through three wrappers shaped like TorchFT's:

- `DistributedDataParallel(manager, model)`: torch's DDP, its buckets and overlap kept, with each
  bucket's all-reduce sent over the manager's current group (a communication hook);
- `OptimizerWrapper(manager, optimizer)`: `zero_grad()` starts a step (entering a new group and
  healing from a live peer first when a membership changed), `step()` applies the update only when
  every collective of the step completed (the commit rule) and returns whether it did;
- `ElasticSampler(manager, length, global_batch=...)`: the samples of each step at any world size,
  each sample once per epoch (exact-once across every change);
- `GradScaler(manager, device)`: torch's loss scaler for float16, which tells the manager of a step
  whose update it skipped (inf or NaN gradients): the step still counts, its samples trained.

The manager takes the state as two callables (`state_dict`, `load_state_dict`), so the loop never
names a heal, a generation or a round. Under `torchspot-run` with the etcd-v3 rendezvous a membership
change restarts no process; elsewhere (plain torchrun) the same script takes the restart path, resuming
from its last checkpoint. The docs' guide ("Bring your own script") shows the ten-line diff.
"""

from torchspot_trainer.elastic.ddp import DistributedDataParallel, GradScaler, OptimizerWrapper
from torchspot_trainer.elastic.manager import Manager
from torchspot_trainer.elastic.sampler import ElasticSampler
from torchspot_trainer.elastic.settings import ApiOrderError, Refused

__all__ = [
    "ApiOrderError",
    "DistributedDataParallel",
    "ElasticSampler",
    "GradScaler",
    "Manager",
    "OptimizerWrapper",
    "Refused",
]
