"""The training program's configuration: one dataclass, one flag per field.

Each field's docstring is its `--help` text; `__post_init__` rejects bad values with
a message that names the flag.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import os
import textwrap
import types
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, get_args, get_type_hints

from torchspot_trainer import ENV_PREFIX, env_switch
from torchspot_trainer.checkpoint.manager import CHECKPOINT_RETRIES, SAVER_PROCESS, SAVER_THREAD
from torchspot_trainer.data.datasets import DATA_SETS
from torchspot_trainer.data.loader import DECODERS
from torchspot_trainer.models import MODELS
from torchspot_trainer.optim import LR_SCALINGS, RECIPES, BatchRule, Recipe
from torchspot_trainer.precision import PRECISIONS
from torchspot_trainer.recovery.signals import NOTICE_HOLD, STUCK_EXIT_AFTER, events_setting_valid, events_url

JPEG_DATA_SETS = tuple(name for name, spec in DATA_SETS.items() if spec.jpeg)
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "step", "constant")
SAVERS = (SAVER_PROCESS, SAVER_THREAD)


@dataclass
class TrainConfig:
    """Everything `python -m torchspot_trainer` takes."""

    data: str
    """CIFAR-10: `cifar-10-python.tar.gz` or its folder; ImageNet: a folder with train/ and
    val/; either may be az://container/prefix (copied to --data-cache first). Ignored for digits."""
    dataset: str = "cifar10"
    """Data set format: cifar10, imagenet, or digits (scikit-learn's bundled 8x8 digits)."""
    model: str = "resnet18"
    """Model: resnet18 (CIFAR variant), resnet50 (ImageNet), small_cnn (two convolutions: digits, tests,
    or any data set where the model's cost should not count, such as the sandbox's test)."""
    epochs: int = 1
    """Epochs to train (the run ends after this many, or after --max-steps)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: no limit besides --epochs)."""
    global_batch_size: int = 0
    """Samples per optimizer step for the whole group, whatever its size: the optimisation is
    then the same at any world size (0: use --batch-size per worker instead)."""
    micro_batch_size: int = 0
    """Most samples a worker runs forward and backward at once; a step accumulates gradients
    over as many passes as its share needs. A cap on memory that does not change the optimisation.
    0: with --global-batch-size under torchspot-run (without --sync-bn), a worker's share at the
    largest world (--max-world-size), so its memory does not grow as nodes leave; else the whole share."""
    max_world_size: int = 0
    """Workers of the largest group the run may have: torchspot-run sets it for its workers (the
    maximum of --nnodes times --nproc-per-node). 0: not known."""
    batch_size: int = 128
    """Samples per worker per step, used when --global-batch-size is 0: the group's batch then
    grows and shrinks with the world size, and --lr-scaling says how the learning rate follows."""
    lr: float | None = None
    """Peak learning rate for a global batch of --lr-batch samples (default: the data set's
    reference recipe; see docs/trainer.md)."""
    lr_batch: int | None = None
    """The global batch --lr is stated for (default: the data set's reference recipe)."""
    lr_scaling: str = "linear"
    """How the peak learning rate follows the step's global batch B: linear (lr x B / lr-batch),
    sqrt (lr x sqrt(B / lr-batch)) or none (lr as given). Recorded in the checkpoint; a resumed
    run keeps the recorded rule."""
    optimizer: str = "sgd"
    """sgd (momentum 0.9, Nesterov) or adamw."""
    weight_decay: float | None = None
    """L2 weight decay (default: the data set's reference recipe)."""
    sync_bn: bool = False
    """Batch normalisation over the whole group (SyncBatchNorm; GPUs only). Without it, batch
    statistics are per worker, so they change with how the global batch is split."""
    schedule: str = "cosine"
    """Learning-rate schedule over the whole run: cosine, step (x0.1 at 50% and 75%), constant."""
    warmup: float = 0.0
    """Fraction of the run spent warming the learning rate up linearly from zero."""
    seed: int = 0
    """Seed for model initialization and data order (the same on every worker)."""
    image_size: int = 224
    """ImageNet crop size in pixels."""
    data_cache: str = ""
    """Local folder that receives an az:// data set and keeps image folders' file indexes across
    restarts ('' = torchspot-data in the temp folder)."""
    workers: str = "auto"
    """Data-loading processes per worker: a number (0: load in the training process), or auto: on a
    GPU the cores this process may use shared among the node's workers, less one for the training
    process (11 per GPU on a 96-vCPU node with 8); on a CPU 2. They last for the run and keep 4
    batches each ready; the test set's loader has at most 4 (it runs once an epoch)."""
    decode: str = "cpu"
    """Where ImageNet JPEGs are decoded: cpu (libjpeg-turbo in the loader workers) or gpu (nvJPEG
    through torchvision, which the `gpu` extra and the trainer image install; the workers then
    only read files). The GPU's decode competes with the model for the GPU: not measured here."""
    eval_batch_size: int = 256
    """Samples per worker per evaluation pass."""
    checkpoint_uri: str = ""
    """Where checkpoints go: a folder, file://..., or az://container/prefix ('' = none)."""
    checkpoint_every: int = 200
    """Steps between asynchronous checkpoints (0: only at the end and on eviction)."""
    keep_checkpoints: int = 3
    """Committed checkpoints to keep; older ones are deleted after a new one commits."""
    checkpoint_retries: int = CHECKPOINT_RETRIES
    """Attempts per checkpoint save before it is reported failed (training goes on)."""
    checkpoint_saver: str = SAVER_PROCESS
    """Where asynchronous checkpoints are serialized and uploaded: 'process' (a child at lower
    priority, which leaves the training step its GIL and cores) or 'thread'."""
    log_every: int = 20
    """Steps between progress lines."""
    events_file: str = ""
    """Also append every JSON record to this file ('' = stdout only; the sandbox reads it)."""
    tensorboard: str = ""
    """Folder for TensorBoard event files ('' = off; needs the tensorboard package)."""
    scheduled_events: str = "auto"
    """Azure Scheduled Events: 'auto' (on inside a Kubernetes pod), 'off', or an endpoint URL."""
    vm_name: str = ""
    """This VM's name as Scheduled Events lists it ('' = ask the metadata service)."""
    stuck_exit_after: float = STUCK_EXIT_AFTER
    """Seconds after SIGTERM to reach a step boundary before exiting at once (stuck collective)."""
    notice_hold: float = NOTICE_HOLD
    """After an emergency checkpoint, seconds the group waits for the evicted node to go
    before training on (a notice that comes to nothing costs at most this)."""
    precision: str = "fp32"
    """Forward passes in fp32, bf16 (autocast) or fp16 (autocast with a gradient scaler). On GPUs
    the model also runs channels_last with cuDNN's algorithm search."""
    collective_timeout: float = 300.0
    """Seconds a step (or any wait on the group) may take before the worker counts its group as
    broken: it writes its node's snapshot, aborts its communicator and exits, and the agents
    re-form the group. The process group's own timeout is twice this (the watchdog acts first)."""
    in_place: bool | None = None
    """Re-form in place at a membership change: the workers keep their processes, rebuild only their
    group and take the newest state from a live peer, instead of being restarted; a worker that cannot
    is restarted as without it. Unset: in place wherever it can run (under torchspot-run with etcd-v3,
    without --sync-bn), else the restart path, said in one line; --no-in-place: the restart path. On
    GPUs each generation's data travel on an NCCL communicator of its own (recovery/planes.py): built
    by NCCL's documented semantics, not measured across GPUs."""
    snapshot_every: int = 1
    """GPUs: steps between host copies of the state, which a node's snapshot is written from (1:
    the snapshot holds the last completed step; K: a copy costs 1/K as much, and the snapshot may
    be up to K-1 steps older). On CPUs the live state is host memory and no copy is taken."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available, decided by each process). NCCL is used on cuda, gloo on cpu.
    cuda where CUDA is not usable stops the worker naming the node (the operator sets it for GPU jobs)."""

    def __post_init__(self) -> None:
        data_set = DATA_SETS.get(self.dataset)
        checks = [
            (
                data_set is not None,
                f"--dataset {self.dataset!r}: choose one of {', '.join(DATA_SETS)}",
            ),
            (self.model in MODELS, f"--model {self.model!r}: choose one of {', '.join(MODELS)}"),
            (
                self.optimizer in OPTIMIZERS,
                f"--optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}",
            ),
            (
                self.checkpoint_saver in SAVERS,
                f"--checkpoint-saver {self.checkpoint_saver!r}: choose one of {', '.join(SAVERS)}",
            ),
            (
                self.schedule in SCHEDULES,
                f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}",
            ),
            (self.epochs >= 1, f"--epochs {self.epochs}: must be at least 1"),
            (self.max_steps >= 0, f"--max-steps {self.max_steps}: must be 0 or more"),
            (self.batch_size >= 1, f"--batch-size {self.batch_size}: must be at least 1"),
            (
                self.global_batch_size >= 0,
                f"--global-batch-size {self.global_batch_size}: must be 0 (off) or more",
            ),
            (
                self.micro_batch_size >= 0,
                f"--micro-batch-size {self.micro_batch_size}: must be 0 (off) or more",
            ),
            (
                self.max_world_size >= 0,
                f"--max-world-size {self.max_world_size}: must be 0 (not known) or more",
            ),
            (self.lr is None or self.lr > 0, f"--lr {self.lr}: must be greater than 0"),
            (self.lr_batch is None or self.lr_batch >= 1, f"--lr-batch {self.lr_batch}: must be at least 1"),
            (
                self.lr_scaling in LR_SCALINGS,
                f"--lr-scaling {self.lr_scaling!r}: choose one of {', '.join(LR_SCALINGS)}",
            ),
            (
                self.weight_decay is None or self.weight_decay >= 0,
                f"--weight-decay {self.weight_decay}: must be 0 or more",
            ),
            (self.eval_batch_size >= 1, f"--eval-batch-size {self.eval_batch_size}: must be at least 1"),
            (0 <= self.warmup < 1, f"--warmup {self.warmup}: must be a fraction in [0, 1)"),
            (self.image_size >= 32, f"--image-size {self.image_size}: must be at least 32"),
            (
                self.workers == "auto" or self.workers.isdigit(),
                f"--workers {self.workers!r}: use auto or a number of processes (0 or more)",
            ),
            (
                self.checkpoint_every >= 0,
                f"--checkpoint-every {self.checkpoint_every}: must be 0 or more",
            ),
            (
                self.keep_checkpoints >= 1,
                f"--keep-checkpoints {self.keep_checkpoints}: keep at least 1",
            ),
            (
                self.checkpoint_retries >= 1,
                f"--checkpoint-retries {self.checkpoint_retries}: must be at least 1",
            ),
            (self.log_every >= 1, f"--log-every {self.log_every}: must be at least 1"),
            (
                self.stuck_exit_after > 0,
                f"--stuck-exit-after {self.stuck_exit_after}: must be greater than 0",
            ),
            (self.notice_hold >= 0, f"--notice-hold {self.notice_hold}: must be 0 or more"),
            (
                self.precision in PRECISIONS,
                f"--precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}",
            ),
            (
                self.collective_timeout >= 1,
                f"--collective-timeout {self.collective_timeout}: must be at least 1 (seconds)",
            ),
            (self.decode in DECODERS, f"--decode {self.decode!r}: choose one of {', '.join(DECODERS)}"),
            (
                self.decode == "cpu" or (data_set is not None and data_set.jpeg),
                f"--decode {self.decode}: only JPEG folders (--dataset {', '.join(JPEG_DATA_SETS)}) are decoded; "
                f"{self.dataset} is not",
            ),
            (self.snapshot_every >= 1, f"--snapshot-every {self.snapshot_every}: must be at least 1"),
            (
                self.device in ("auto", "cpu", "cuda"),
                f"--device {self.device!r}: choose auto, cpu or cuda",
            ),
            (
                events_setting_valid(self.scheduled_events),
                f"--scheduled-events {self.scheduled_events!r}: use auto, off, or an http(s) URL",
            ),
            (
                data_set is None or not data_set.needs_data or bool(self.data),
                f"--data is required for --dataset {self.dataset}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def recipe(self) -> Recipe:
        """The data set's reference recipe with this run's --lr, --lr-batch and --weight-decay over it."""
        base = RECIPES[self.dataset]
        return replace(
            base,
            lr=base.lr if self.lr is None else self.lr,
            lr_batch=base.lr_batch if self.lr_batch is None else self.lr_batch,
            weight_decay=base.weight_decay if self.weight_decay is None else self.weight_decay,
        )

    def micro_batch(self, global_batch: int) -> int:
        """The micro-batch a step's passes take (0: the whole share). Pure.

        Unset, with a global batch and the largest world known: that world's share, rounded up. A
        job sized for 8 nodes then runs 4 passes of the same size at 2 nodes, where the whole
        share (4 times the memory) hit CUDA OOM and crash-looped. Not with --sync-bn: its
        statistics are taken per pass, and docs/trainer.md's same-model condition wants one pass."""
        if self.micro_batch_size or not global_batch or not self.max_world_size or self.sync_bn:
            return self.micro_batch_size
        return -(-global_batch // self.max_world_size)

    def batch_rule(self) -> BatchRule:
        """The batch and learning-rate rule these flags give (a checkpoint's may override it)."""
        recipe = self.recipe()
        return BatchRule(
            global_batch_size=self.global_batch_size,
            batch_size=self.batch_size,
            lr=recipe.lr,
            lr_batch=recipe.lr_batch,
            lr_scaling=self.lr_scaling,
        )

    def scheduled_events_url(self) -> str | None:
        """The endpoint to poll, or None when the watcher is off."""
        return events_url(self.scheduled_events, os.environ)


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings (the string right after each field), whitespace folded: --help's
    texts, and the docs' reference pages'."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = getattr(following, "value", None)
            if isinstance(following, ast.Expr) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs[node.target.id] = " ".join(value.value.split())
    return docs


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, with its docstring as help and its default shown.

    A flag's default is TORCHSPOT_<FLAG> from the environment when set (for example
    TORCHSPOT_CHECKPOINT_URI): the operator passes the job's settings that way without
    rewriting the user's command line, and a flag given on it still wins. A field that may
    be None (`float | None`) is a flag whose default comes from the data set's recipe; a
    bool field is an on/off switch (`--sync-bn`, `--no-sync-bn`), and a `bool | None` one a switch
    that may be left unset (`--in-place`).
    """
    parser = argparse.ArgumentParser(
        prog="python -m torchspot_trainer",
        description="Elastic ResNet training under torchspot-run (or torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    docs = field_docs(TrainConfig)
    hints = get_type_hints(TrainConfig)
    for item in fields(TrainConfig):
        flag = "--" + item.name.replace("_", "-")
        kind: Any = hints[item.name]
        kwargs: dict[str, Any] = {"type": kind, "help": docs.get(item.name, "").replace("%", "%%")}
        from_env = os.environ.get(ENV_PREFIX + item.name.upper())
        if isinstance(kind, types.UnionType):  # X | None: absent means "the recipe's" (a switch: "unset")
            kind = kwargs["type"] = next(arg for arg in get_args(kind) if arg is not type(None))
            if from_env is None:
                kwargs["default"] = argparse.SUPPRESS  # the dataclass's None; --help shows no "None"
        if kind is bool:
            del kwargs["type"]
            kwargs["action"] = argparse.BooleanOptionalAction
            if from_env is not None:
                kwargs["default"] = _switch(flag, from_env)
            elif "default" not in kwargs:
                kwargs["default"] = item.default
        elif from_env is not None:  # argparse converts a string default with `type`, as if typed
            kwargs["default"] = from_env
        elif item.default is MISSING:
            kwargs["required"] = True
        elif "default" not in kwargs:
            kwargs["default"] = item.default
        parser.add_argument(flag, **kwargs)
    return parser


def _switch(flag: str, value: str) -> bool:
    """An on/off flag's value from the environment."""
    switch = env_switch(value)
    if switch is not None:
        return switch
    raise SystemExit(f"{ENV_PREFIX}{flag[2:].upper().replace('-', '_')}={value!r} ({flag}): use true or false")


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse flags into a TrainConfig; bad values exit with a message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))
