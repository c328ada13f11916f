"""What a training run is built from before its first step: the device and its refusals, the default
group, the model, the data sets and loaders, the optimizer and sampler (`build_run`), the checkpoints,
and the first pass's one-off costs (`warm_up_run`).

`Run` is what the trainer holds between steps. The device choice and the refusals are pure;
`node_device` and `exit_node_fault` end a worker whose node cannot run it (`NodeFault`), and
`load_datasets` fetches the data where it is remote.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from torchspot_trainer import NODE_FAULT_EXIT, takes_in_place
from torchspot_trainer.config import TrainConfig
from torchspot_trainer.data.cache import ensure_local_data, index_cache
from torchspot_trainer.data.datasets import DATA_SETS, Normalize
from torchspot_trainer.data.loader import EVAL_LOADER_WORKERS, DeviceDecoder, EpochLoader
from torchspot_trainer.data.sampler import ElasticSampler
from torchspot_trainer.elastic.settings import node_name
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.models import MODELS
from torchspot_trainer.optim import BatchRule, build_optimizer
from torchspot_trainer.precision import Precision
from torchspot_trainer.recovery.group import control_group, group_device, group_timeout, nccl_environment
from torchspot_trainer.recovery.rng import rng_state, set_rng_state
from torchspot_trainer.recovery.signals import reset_sigterm
from torchspot_trainer.step import warm_up

__all__ = [
    "NodeFault",
    "Run",
    "build_model",
    "build_run",
    "choose_device",
    "choose_in_place",
    "decode_refusal",
    "exit_node_fault",
    "form_default_group",
    "in_place_refusal",
    "load_datasets",
    "make_loader",
    "node_device",
    "probe_device",
    "sync_bn_refusal",
    "warm_up_run",
]


class NodeFault(ValueError):
    """This node cannot run the trainer (its GPU is not usable, or fewer GPUs are visible than it was
    given): the worker exits with `NODE_FAULT_EXIT`, so that it is replaced on another node instead of
    restarted on this one (torchspot_trainer's NODE_FAULT_EXIT says who reads it)."""


def choose_device(
    flag: str,
    cuda_available: bool,
    local_rank: int,
    *,
    gpus: int | None = None,
    node: str = "",
    cuda_built: bool = True,
) -> tuple[torch.device, str]:
    """(device, process-group backend) for `--device`: NCCL on GPUs, gloo on CPU. Pure.

    `--device cuda` on a node where CUDA is not usable (or with fewer GPUs than local ranks) raises
    NodeFault naming the node, before the group forms: the node's GPU or driver failed (an Xid, an
    uncorrectable ECC error, a device plugin that lost the GPU), which another node does not share.
    A torch built without CUDA (`cuda_built` False) is the image's fault, which every node shares:
    ValueError. Why not fall back to the CPU: `auto` is decided by each process alone, and one rank on
    gloo among NCCL ranks hangs the group's set-up, where no watchdog runs yet. The operator passes
    `cuda` to GPU jobs (TORCHSPOT_DEVICE). `gpus`: the GPUs this process sees (None: not checked)."""
    where = f" on node {node}" if node else ""
    if flag == "cuda" and not cuda_built:
        raise ValueError(
            f"--device cuda, but the image's torch {torch.__version__} is built without CUDA: use a CUDA build "
            "(the trainer image's base is one)"
        )
    if flag == "cuda" and not cuda_available:
        raise NodeFault(
            f"--device cuda, but CUDA is not usable{where}: torch.cuda.is_available() is False (no driver, or "
            "the GPU not visible to the container); check nvidia-smi there and the pod's nvidia.com/gpu limit"
        )
    if flag == "cuda" and gpus is not None and local_rank >= gpus:
        raise NodeFault(
            f"--device cuda: local rank {local_rank} but {gpus} GPU(s) visible{where}; nprocPerNode must not "
            "exceed the node's GPUs"
        )
    if flag == "cuda" or (flag == "auto" and cuda_available):
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def probe_device(device: torch.device) -> None:
    """Run one small computation on `device` and wait for it; raises NodeFault where the GPU fails it (a
    GPU that fell off the bus or has an uncorrectable ECC error may still be counted by CUDA, and
    fails its first kernel: the worker would fail at its first step instead, after joining the group
    and holding it up). Nothing to do on the CPU."""
    if device.type != "cuda":
        return
    try:
        torch.ones(1, device=device).add_(1).item()
    except RuntimeError as exc:  # CUDA error: ...
        raise NodeFault(f"the GPU {device} failed a first computation: {str(exc).splitlines()[0]}") from exc


def node_device(flag: str, local_rank: int, cuda_available: bool) -> tuple[torch.device, str]:
    """`choose_device` for this process on its node, probed (`probe_device`): a node fault exits with
    NODE_FAULT_EXIT (`exit_node_fault`), a device the image cannot use stops naming `--device`."""
    try:
        device, backend = choose_device(
            flag, cuda_available, local_rank, gpus=torch.cuda.device_count() if cuda_available else None,
            node=node_name(), cuda_built=torch.version.cuda is not None,
        )  # fmt: skip
        probe_device(device)
    except NodeFault as fault:
        exit_node_fault(fault)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    return device, backend


def exit_node_fault(fault: NodeFault) -> NoReturn:
    """Say why this node cannot run the trainer, then exit with NODE_FAULT_EXIT (NodeFault's docstring)."""
    print(f"torchspot_trainer: node fault: {fault}", file=sys.stderr, flush=True)
    raise SystemExit(NODE_FAULT_EXIT)


def decode_refusal(decode: str, device: torch.device) -> str | None:
    """Why --decode cannot run on this worker's device, or None. Pure."""
    if decode == "gpu" and device.type != "cuda":
        return f"--decode gpu needs a CUDA device, and this worker runs on {device.type}"
    return None


def sync_bn_refusal(sync_bn: bool, device: torch.device) -> str | None:
    """Why `--sync-bn` cannot run on `device`, or None. Pure.

    torch's SyncBatchNorm runs its statistics' all-reduce only on GPUs; on CPU its forward pass
    raises. Said before training starts instead of at the first step."""
    if sync_bn and device.type != "cuda":
        return "--sync-bn needs GPUs (torch's SyncBatchNorm does not run on CPU); drop it on CPU nodes"
    return None


def in_place_refusal(in_place: bool | None, environ: Mapping[str, str], *, sync_bn: bool = False) -> str | None:
    """Why an asked-for `--in-place` cannot run in this worker, or None (also where it was not asked for:
    `choose_in_place` then takes the restart path). Pure.

    Only torchspot-run's agent hands a round over (handover.py); under another launcher no round
    would ever come. (On GPUs its generations' data travel on NCCL communicators: planes.py.) Not with
    `--sync-bn`: torch's SyncBatchNorm syncs its statistics over the default process group, which a
    run in place has none of (each generation is a group of its own), and silently falls back to
    per-GPU statistics: a different, usually worse, model than the restart path trains."""
    if not in_place:
        return None
    if PEER_LOST_ENV not in environ:
        return "--in-place needs torchspot-run (etcd-v3), whose agent hands each new round to its live workers"
    if sync_bn:
        return (
            "--sync-bn with --in-place: SyncBatchNorm syncs over torch's default process group, which a run in "
            "place does not have (it would use each GPU's own statistics); drop one of them"
        )
    return None


def choose_in_place(
    in_place: bool | None, environ: Mapping[str, str], *, sync_bn: bool = False, nccl: bool = False
) -> tuple[bool, str]:
    """(whether the trainer re-forms in place, why): `--in-place` unset takes in place wherever it can run
    (`in_place_refusal`'s rules) and the restart path elsewhere, so that a job under torchspot-run gets
    its best path without a flag; `--no-in-place` the restart path. Pure; an asked-for `--in-place` that
    cannot run is `in_place_refusal`'s. On NCCL (`nccl`) the line says that path is built by NCCL's
    documented semantics and not measured on a GPU, so a platform engineer reads it where it runs."""
    if in_place is False:
        return False, "the restart path, as asked (--no-in-place)"
    if in_place is None and PEER_LOST_ENV not in environ:
        return False, "the restart path: in place needs torchspot-run (etcd-v3), whose agent hands workers each round"
    if not takes_in_place(in_place, sync_bn=sync_bn):
        return False, "the restart path: --sync-bn syncs over torch's default group, which in place has none of"
    asked = "as asked (--in-place)" if in_place else "torchspot-run's agent hands this worker each new round"
    unmeasured = " (on GPUs built by NCCL's documented semantics, not measured on one)" if nccl else ""
    return True, f"in place{unmeasured}, {asked}; --no-in-place takes the restart path"


def build_model(config: TrainConfig, classes: int, device: torch.device) -> nn.Module:
    """The model, initialised from --seed (the same on every rank), with SyncBatchNorm for --sync-bn."""
    torch.manual_seed(config.seed)
    model: nn.Module = MODELS[config.model](classes, DATA_SETS[config.dataset].channels)
    if config.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
    return model.to(device)


@dataclass
class Run:
    """What one training run holds between steps."""

    model: nn.Module
    ddp: nn.Module
    """The model under the recovery API's DDP (elastic.DistributedDataParallel)."""
    optimizer: torch.optim.Optimizer
    sampler: ElasticSampler
    rule: BatchRule
    train_set: Dataset[Any]
    test_set: Dataset[Any]
    train_loader: EpochLoader
    test_loader: EpochLoader
    normalize: Normalize
    total_samples: int
    evaluated: tuple[int, float] = (-1, math.nan)
    """(step, top-1 accuracy) of the last completed evaluation."""


def build_run(
    config: TrainConfig,
    model: nn.Module,
    sets: tuple[Dataset[Any], Dataset[Any]],
    *,
    world: int,
    device: torch.device,
    loader_workers: int,
    decoder: DeviceDecoder | None,
    wrap: Callable[[nn.Module], nn.Module],
) -> Run:
    """The run around `model` on the data `sets` (train, test): the model under DDP (`wrap`), the
    optimizer, the exact-once sampler and the loaders."""
    train_set, test_set = sets
    rule = config.batch_rule()
    return Run(
        model=model,
        ddp=wrap(model),
        optimizer=build_optimizer(
            model, config.optimizer, lr=rule.peak_lr(world), weight_decay=config.recipe().weight_decay, device=device
        ),
        sampler=ElasticSampler(
            len(train_set),  # type: ignore[arg-type]
            rule.batch_size,
            seed=config.seed,
            global_batch=rule.global_batch_size,
            micro_batch=config.micro_batch(rule.global_batch_size),
        ),
        rule=rule,
        train_set=train_set,
        test_set=test_set,
        train_loader=make_loader(train_set, decoder, loader_workers, device),
        test_loader=make_loader(test_set, decoder, min(loader_workers, EVAL_LOADER_WORKERS), device),
        normalize=train_set.normalize,  # type: ignore[attr-defined]
        total_samples=config.epochs * len(train_set),  # type: ignore[arg-type]
    )


def load_datasets(config: TrainConfig) -> tuple[Dataset[Any], Dataset[Any], int]:
    """The training and test sets of `--dataset` (fetched and staged first where they are remote), and
    the number of classes (its entry in `DATA_SETS`)."""
    spec = DATA_SETS[config.dataset]
    path = ensure_local_data(config.data, config.data_cache) if spec.needs_data else Path()
    return spec.load(path, config.image_size, index_cache(config.data_cache))


def make_loader(
    dataset: Dataset[Any], decoder: DeviceDecoder | None, workers: int, device: torch.device
) -> EpochLoader:
    """`dataset`'s loader for the run: `workers` processes that persist from epoch to epoch, each leaving
    SIGTERM to the training process."""
    cuda = device.type == "cuda"
    return EpochLoader(
        dataset, workers=workers, pin_memory=cuda, worker_init=_reset_sigterm_in_loader,
        decoder=decoder, ahead=device if cuda and decoder is None else None,
    )  # fmt: skip


def form_default_group(backend: str, device: torch.device, collective_timeout: float) -> Any:
    """The restart path's default process group (NCCL bound to `device`, or gloo) for this round; returns
    the gloo control group beside an NCCL one (group.control_group), else None."""
    if backend == "nccl":
        os.environ.update(nccl_environment(os.environ))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=group_timeout(collective_timeout), device_id=group_device(device))
    return control_group(backend, collective_timeout)


def warm_up_run(run: Run, *, rank: int, world: int, device: torch.device, precision: Precision) -> None:
    """The first pass's one-off costs paid before a worker in place enters its group (step.warm_up), on a
    batch of this rank's first micro-batch's size, the random number generators left as they were."""
    plan = next(run.sampler.epoch_steps(rank, world), [])
    size = max((len(part) for part in plan), default=1)
    image, _label = run.train_set[0]
    kept = rng_state()
    warm_up(
        run.model, torch.stack([image] * size), torch.zeros(size, dtype=torch.long), device=device,
        precision=precision, normalize=run.normalize,
    )  # fmt: skip
    set_rng_state(kept)


def _reset_sigterm_in_loader(_worker: int) -> None:
    """A DataLoader worker leaves SIGTERM to the training process (signals.reset_sigterm)."""
    reset_sigterm()
