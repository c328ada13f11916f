"""torch's DDP and a user's optimizer, wired to a `Manager` (manager.py says what each step does).

In place, DDP keeps what makes it fast (its buckets, filled in the order gradients are ready, each
all-reduced while the backward pass goes on) and hands each bucket to the manager, which sends it over
the current group: DDP's own process group is a one-rank gloo group that never changes, so a membership
change rebuilds nothing of DDP. A generation's first step goes whole, every rank's gradients in the
model's order (buckets.py: DDP's layout then differs between a rank that joined and the others). On the
restart path both wrappers are torch's own behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket, HashStore  # what torch.distributed re-exports
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from torchspot_trainer.elastic.manager import Manager
from torchspot_trainer.elastic.settings import Refused


def _one_rank_group(device: torch.device) -> dist.ProcessGroup:
    """A process group of this rank alone (gloo, on the CPU and on `device`): what DDP is built on in
    place, where the manager's hook carries every bucket (its collectives never run)."""
    store = HashStore()
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
    group = dist.ProcessGroup(store, 0, 1)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    for kind in {torch.device("cpu"), torch.device(device.type)}:
        group._register_backend(kind, dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def _reduce_hook(manager: Manager, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    return manager.reduce_bucket(bucket)


# DDP checks a hook's annotations against the classes themselves, and this module's are strings.
_reduce_hook.__annotations__.update(bucket=GradBucket, manager=Manager)
_reduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


class DistributedDataParallel(_TorchDDP):
    """torch's `DistributedDataParallel` whose gradients travel over `manager`'s current group.

    Refused in place: a model with SyncBatchNorm (it syncs over torch's default group, which a worker
    that re-forms in place does not have, and would silently use each rank's own statistics),
    `process_group` (the manager owns the groups) and `static_graph`. Other keyword arguments are DDP's:
    `find_unused_parameters=True` where the model has parameters a step may not use, as under plain DDP.
    """

    def __init__(self, manager: Manager, module: nn.Module, **kwargs: Any) -> None:
        self.manager = manager
        if manager.in_place:
            if any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
                raise Refused(
                    "SyncBatchNorm in place: it syncs over torch's default process group, which a worker that "
                    "re-forms in place does not have; use BatchNorm (its statistics come from rank 0 after each "
                    "step, as DDP's do) or Manager(in_place=False)"
                )
            if "process_group" in kwargs:
                raise Refused("process_group in place: the manager's groups carry the gradients; drop it")
            if kwargs.get("static_graph"):
                raise Refused(
                    "static_graph in place: DDP then reduces its first step's gradients after the backward pass and "
                    "takes the graph to stay as it was, which the manager's re-forms are not built for; drop it"
                )
            kwargs.setdefault("broadcast_buffers", False)  # the manager takes rank 0's after each step
            super().__init__(module, process_group=_one_rank_group(manager.device), **kwargs)
            self.register_comm_hook(manager, _reduce_hook)
        else:
            manager.ensure_group()
            super().__init__(module, **kwargs)
        manager.watch_model(module)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.manager.computed()
        return super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]


class OptimizerWrapper:
    """A user's optimizer whose `zero_grad()` begins a step and whose `step()` applies the update only
    when the step's collectives completed (the commit rule). Other attributes are the optimizer's.

    `step()` returns whether the update was applied: a step that was not will be taken again, after
    the group re-formed, on the same samples (`ElasticSampler`).
    """

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer) -> None:
        self.manager = manager
        self.optimizer = optimizer
        manager.watch_shards([parameter for group in optimizer.param_groups for parameter in group["params"]])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> bool:
        if not self.manager.should_commit():
            return False
        self.manager.before_update()
        self.optimizer.step(closure)
        self.manager.commit()
        return True

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class GradScaler(torch.amp.GradScaler):
    """torch's `GradScaler` (loss scaling for float16) that tells `manager` of each step whose update it
    skips: where the gradients hold inf or NaN it does not call `optimizer.step()`, as torch's does, and
    the step, which consumed its samples, counts as taken (`Manager.update_skipped`) before the loop's
    condition reads `current_step()`. Other arguments are torch's.
    """

    def __init__(self, manager: Manager, device: str = "cuda", **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.manager = manager
        manager.scales_loss()

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """torch's `step`; then, where it skipped the update, the manager told: its answer (whether the
        skipped step counted) is returned then, the optimizer's otherwise."""
        result = super().step(optimizer, *args, **kwargs)
        if self.manager.stepping():
            return self.manager.update_skipped()
        return result
