"""The elastic training loop: DDP ResNet training that survives world-size changes.

One public method, `Trainer.train()`. The topology comes from torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK); every start resumes from the newest state a node kept
on its own disk as its worker stopped (snapshot.py: a survivor of a lost peer holds the
last completed step) or, if newer or the only one, the newest committed checkpoint. So
a membership change (which restarts all workers) costs at most the step in flight
while any node survives with its state, and an eviction with notice costs none:

- every step all ranks share (one tiny all-gather) whether any of them got an
  eviction notice; if so, the group stops at that step boundary: the lowest rank whose
  node leaves writes a synchronous emergency checkpoint to Blob (none when every notice
  is only an agent restarting its workers: no node leaves, and each node's snapshot
  carries the state), a worker told by SIGTERM keeps its snapshot and exits without
  waiting for that checkpoint, a Scheduled Event is approved, and the others hold
  (pinging each other) until the evicted node is gone and the agent re-forms the group,
  so no step is run twice;
- rank 0 alone writes checkpoints (asynchronously every `checkpoint_every` steps),
  and reports the last committed step in `latest.json` beside them;
- the learning rate is a function of the fraction of the run's samples consumed, so
  it does not jump when the world size (and so the step count) changes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from torchspot.trainer.checkpoint import CheckpointConfig, CheckpointManager, SaveReport, step_dir
from torchspot.trainer.config import TrainConfig, ensure_local_data
from torchspot.trainer.data import SampleRandom, load_cifar10, load_digits, load_imagenet
from torchspot.trainer.eviction import (
    EvictionNotice,
    Notice,
    ScheduledEventsWatcher,
    agent_restarting,
    node_leaving,
    reset_sigterm,
    watch_sigterm,
)
from torchspot.trainer.models import MODELS
from torchspot.trainer.rendezvous.status import CheckpointReporter
from torchspot.trainer.sampler import ElasticSampler
from torchspot.trainer.snapshot import Held, LocalSnapshot, choose_source, default_path
from torchspot.trainer.storage import open_storage

log = logging.getLogger(__name__)

EXIT_EVICTED = 128 + signal.SIGTERM
"""Exit code of a worker that stopped for SIGTERM after its emergency checkpoint."""
EXIT_FAILED = 1
"""Exit code of a worker whose training loop raised (a collective failed: a peer left)."""
NOTICE_RESTART = 1
NOTICE_LEAVING = 2
"""A rank's notice, all-gathered after every step: any notice stops the group at this boundary,
and the lowest leaving rank, if any, writes the emergency checkpoint (`emergency_saver`)."""
LEAVE_SAVE_WAIT = 5.0
"""Seconds a leaving rank 0 gives its checkpoint save in flight before it exits. The save
usually holds the newest step and needs a few seconds more; the survivors' agents re-form
meanwhile, and a round that completes without this node costs only a worker start-up."""


def emergency_saver(levels: list[int]) -> int | None:
    """The rank that writes the emergency checkpoint: the lowest one whose node leaves, or None
    when no node leaves (every notice is an agent's restart). Pure."""
    return next((rank for rank, level in enumerate(levels) if level >= NOTICE_LEAVING), None)


def notice_level(notice: Notice | None, *, restarting: bool, leaving: bool) -> int:
    """A rank's notice level at a step boundary. Pure.

    NOTICE_LEAVING when our agent has marked that the node leaves (`leaving`), notice or not:
    its SIGTERM may reach us after the other nodes have stopped for their restart, and then
    nobody would write the emergency checkpoint. Otherwise 0 without a notice, NOTICE_RESTART
    for our agent's SIGTERM to re-form the group (`restarting`: the node stays), and
    NOTICE_LEAVING for anything else (the node's eviction, a Scheduled Event).
    """
    if leaving:
        return NOTICE_LEAVING
    if notice is None:
        return 0
    if notice.source == "SIGTERM" and restarting:
        return NOTICE_RESTART
    return NOTICE_LEAVING


def learning_rate(config: TrainConfig, progress: float) -> float:
    """The learning rate at `progress` (fraction of the run's samples consumed). Pure."""
    if config.warmup and progress < config.warmup:
        return config.lr * progress / config.warmup
    if config.schedule == "constant":
        return config.lr
    if config.schedule == "step":
        return config.lr * (0.1 ** sum(progress >= m for m in (0.5, 0.75)))
    span = (progress - config.warmup) / (1 - config.warmup)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(span, 1.0)))


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states, in a form `torch.load(weights_only=True)` accepts."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]
    return {
        "python": [*random.getstate()[1], random.getstate()[2]],
        "python_version": random.getstate()[0],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    values = state["python"]
    random.setstate((state["python_version"], tuple(values[:-1]), values[-1]))
    keys = state["numpy"]["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy"]["pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])


def choose_device(flag: str, cuda_available: bool, local_rank: int) -> tuple[torch.device, str]:
    """(device, process-group backend) for `--device`: NCCL on GPUs, gloo on CPU. Pure."""
    if flag == "cuda" or (flag == "auto" and cuda_available):
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def format_progress(record: dict[str, Any]) -> str:
    """The human-readable progress line shown on a terminal. Pure."""
    ckpt = record["checkpoint_step"]
    line = (
        f"step {record['step']:>7} epoch {record['epoch']:>3} world {record['world_size']} "
        f"loss {record['loss']:.4f} acc {record['accuracy']:.3f} {record['samples_per_s']:.0f} samples/s "
        f"lr {record['lr']:.4g} ckpt {ckpt if ckpt is not None else '-'}"
    )
    if record["checkpoint_error"]:
        line += f" CHECKPOINT FAILING: {record['checkpoint_error']}"
    return line


@dataclass
class Progress:
    """One progress record (a JSON line on stdout)."""

    step: int
    epoch: int
    world_size: int
    loss: float
    accuracy: float
    samples_per_s: float
    lr: float
    checkpoint_step: int | None
    checkpoint_error: str | None
    trained_samples: int = 0
    """Samples the run has trained on so far, all epochs counted (redone work not counted
    twice): the measure of progress that does not depend on the world size."""


@dataclass
class _Run:
    """What one training run holds between steps."""

    model: nn.Module
    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    sampler: ElasticSampler
    train_set: Dataset[Any]
    test_set: Dataset[Any]
    total_samples: int


@dataclass
class _Window:
    """Sums over the steps since the last progress record (this rank's share)."""

    started: float
    loss: float = 0.0
    correct: float = 0.0
    samples: int = 0

    def add(self, loss: float, correct: float, samples: int) -> None:
        self.loss += loss
        self.correct += correct
        self.samples += samples


def process_age() -> float:
    """Seconds since this process started (Linux; 0.0 elsewhere): the interpreter's and imports' share."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0.0
    return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def _leave(code: int) -> NoReturn:
    """Exit now with `code`, our output flushed: no interpreter shutdown to wait on."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _lap(clock: dict[str, float]) -> Callable[[str], None]:
    """A stopwatch that records, under each name it is called with, the time since its previous call."""
    last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        clock[name], last = now - last, now

    return lap


def _trained(sampler: ElasticSampler) -> int:
    return sampler.epoch * sampler.length + sampler.consumed


class _Collate:
    """Stack (image, label) pairs; an empty batch (a short last step) keeps its shape."""

    def __init__(self, sample_shape: torch.Size) -> None:
        self.sample_shape = sample_shape

    def __call__(self, items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not items:
            return torch.empty((0, *self.sample_shape)), torch.empty(0, dtype=torch.long)
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


class Trainer:
    """Trains `config.model` on `config.dataset` under torchrun; see the module docstring."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.notice = EvictionNotice()
        self._sigterm_thread = watch_sigterm(
            self.notice, stuck_exit_after=config.stuck_exit_after, before_exit=self._before_stuck_exit
        )
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device, self.backend = choose_device(config.device, torch.cuda.is_available(), self.local_rank)
        self.step = 0
        self._tensorboard: Any = None
        self._watcher: ScheduledEventsWatcher | None = None
        self.manager: CheckpointManager | None = None
        self._reporter: CheckpointReporter | None = None
        self.setup_seconds: dict[str, float] = {}
        """Where a (re)start's time went: process start-up to here, then each part of `_setup`."""
        self._snapshot = LocalSnapshot(default_path(os.environ, self.local_rank)) if self.local_rank == 0 else None
        """This node's copy of the state as its worker stops (see snapshot.py); one per node."""
        self._run: _Run | None = None
        """Set once the state is whole (after the resume): from then on a snapshot may be taken.
        Kept after the run ends (launch.run_trainer says why)."""
        self._base = 0
        """The step this round resumed from (0: from scratch)."""
        self._snapshot_lock = threading.Lock()
        self._snapshot_taken = False
        self._updating = False
        """True from the optimizer's step until the step count moved: the state is not whole then."""
        self.resumed_from = "start"
        """`checkpoint` (Blob), `snapshot` (a node's local copy) or `start` (nothing to resume)."""

    # -- set-up ---------------------------------------------------------------------

    def _datasets(self) -> tuple[Dataset[Any], Dataset[Any], int]:
        config = self.config
        if config.dataset == "digits":
            train, test = load_digits(seed=0)
            return train, test, 10
        path = ensure_local_data(config)
        if config.dataset == "cifar10":
            train, test = load_cifar10(path)
            return train, test, 10
        train_folder, val_folder = load_imagenet(path, config.image_size)
        return train_folder, val_folder, len(train_folder.classes)

    def _emit(self, record: dict[str, Any], *, any_rank: bool = False) -> None:
        """Print one event line (and append it to --events-file): rank 0's, or any rank's
        with `any_rank` (an event only that rank sees)."""
        if self.rank != 0 and not any_rank:
            return
        record = {"t": time.time(), **record}
        line = json.dumps(record)
        print(line, flush=True)
        if self.config.events_file:
            with open(self.config.events_file, "a") as out:  # one O_APPEND write per record
                out.write(line + "\n")
        if sys.stderr.isatty():
            text = format_progress(record) if record.get("event") == "progress" else f"[torchspot] {line}"
            print(text, file=sys.stderr, flush=True)

    def _on_checkpoint(self, report: SaveReport) -> None:
        self._emit({"event": "checkpoint", **asdict(report)})
        if report.ok and self._reporter is not None and self.manager is not None:
            self._reporter.report(report.step, f"{self.manager.storage.describe().rstrip('/')}/{step_dir(report.step)}")

    # -- the loop -------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Run (or resume) training to the end; return the final summary (rank 0's view).

        If the loop raises (a collective failed because a peer left, or a bug), the
        worker leaves at once with EXIT_FAILED after its traceback: a normal interpreter
        exit would wait on the process group and background threads, and every second
        spent here delays the agents' next round.
        """
        try:
            return self._train()
        except Exception:
            log.exception("rank %d: training stopped at step %d", self.rank, self.step)
            self._keep_snapshot()
            self._finish_save_in_flight()
            _leave(EXIT_FAILED)

    def _keep_snapshot(self) -> None:
        """Leave this node's state at the last completed step for the next round (snapshot.py).

        Only once the state is whole: a failed collective inside a step leaves the model and
        optimizer at the last completed step (the optimizer steps after the gradients'
        all-reduce; `self.step` and the sampler advance after it).
        """
        with self._snapshot_lock:  # the main thread and the SIGTERM watcher may both get here
            if self._snapshot is None or self._run is None or self._snapshot_taken:
                return
            if self._updating:
                log.warning("rank %d: no local snapshot: stopped inside an optimizer step", self.rank)
                return
            self._snapshot_taken = True
            took = self._snapshot.write(self._state(self._run), self._base)
        if took is not None:
            log.info("rank %d: local snapshot of step %d written in %.2f s", self.rank, self.step, took)

    def _before_stuck_exit(self) -> None:
        """A worker stuck in a collective with a lost (frozen) peer is about to be ended by its
        SIGTERM watcher: the main thread waits inside the collective, its state at the last
        completed step, so the snapshot is taken from here."""
        self._keep_snapshot()
        self._finish_save_in_flight()

    def _finish_save_in_flight(self) -> None:
        """Give the checkpoint save in flight up to LEAVE_SAVE_WAIT seconds before leaving."""
        if self.manager is None:
            return
        self.manager.wait(LEAVE_SAVE_WAIT)
        if self.manager.in_flight is not None:
            log.warning("leaving with the save of step %d unfinished", self.manager.in_flight)

    def _train(self) -> dict[str, Any]:
        run = self._setup()
        self._emit({"event": "start", "step": self.step, "epoch": run.sampler.epoch, "world_size": self.world,
                    "resumed_samples": run.sampler.consumed, "trained_samples": _trained(run.sampler),
                    "resumed_from": self.resumed_from,
                    "setup_s": {k: round(v, 2) for k, v in self.setup_seconds.items()}})  # fmt: skip
        accuracy = float("nan")
        evaluated_at = -1
        while run.sampler.epoch < self.config.epochs and not self._step_limit_reached():
            epoch = run.sampler.epoch
            self._train_epoch(run)
            if run.sampler.consumed == 0:
                accuracy, evaluated_at = self._evaluate(run.model, run.test_set), self.step
                self._emit({"event": "eval", "step": self.step, "epoch": epoch, "accuracy": accuracy})
        if evaluated_at != self.step:  # stopped mid-epoch (--max-steps)
            accuracy = self._evaluate(run.model, run.test_set)
            self._emit({"event": "eval", "step": self.step, "epoch": run.sampler.epoch, "accuracy": accuracy})
        if self.manager is not None and self.rank == 0:
            self.manager.wait()
            if self.manager.last_committed != self.step:
                self.manager.save_sync(self.step, self._state(run), self._meta(run.sampler))
            self.manager.close()
        summary = {"event": "done", "step": self.step, "epoch": run.sampler.epoch, "world_size": self.world,
                   "test_accuracy": accuracy}  # fmt: skip
        if self._snapshot is not None:
            self._snapshot.remove()
            self._snapshot = None  # the run is over: nothing to carry to a next round
        self._emit(summary)
        self._shutdown()
        return summary

    def _step_limit_reached(self) -> bool:
        return bool(self.config.max_steps) and self.step >= self.config.max_steps

    def _setup(self) -> _Run:
        """Process group, data, model, optimizer; then resume and start the side channels."""
        config = self.config
        self.setup_seconds["process"] = process_age()
        lap = _lap(self.setup_seconds)
        dist.init_process_group(self.backend, timeout=timedelta(minutes=10))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        lap("group")
        train_set, test_set, classes = self._datasets()
        lap("data")
        model: nn.Module = MODELS[config.model](classes).to(self.device)
        run = _Run(
            model=model,
            ddp=DistributedDataParallel(model, device_ids=[self.local_rank] if self.device.type == "cuda" else None),
            optimizer=self._optimizer(model),
            sampler=ElasticSampler(len(train_set), config.batch_size, seed=config.seed),  # type: ignore[arg-type]
            train_set=train_set,
            test_set=test_set,
            total_samples=config.epochs * len(train_set),  # type: ignore[arg-type]
        )
        if config.checkpoint_uri:
            if self.rank == 0:
                self._reporter = CheckpointReporter.from_environment()
            reopen = partial(open_storage, config.checkpoint_uri, retries=1, timeout=5.0)
            saves_in_child = self.rank == 0 and config.checkpoint_saver == "process"
            self.manager = CheckpointManager(
                reopen(),
                CheckpointConfig(keep=config.keep_checkpoints, retries=config.checkpoint_retries),
                on_report=self._on_checkpoint,
                reopen=reopen if saves_in_child else None,
            )
            lap("model")
            self._resume(run)
            lap("resume")
        self._run = run
        url = config.scheduled_events_url()
        if url:
            self._watcher = ScheduledEventsWatcher(self.notice, url, vm_name=config.vm_name or None).start()
        if config.tensorboard and self.rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
            except ImportError as exc:
                raise SystemExit(f"--tensorboard {config.tensorboard}: install the tensorboard package") from exc
            self._tensorboard = SummaryWriter(config.tensorboard)
        return run

    def _train_epoch(self, run: _Run) -> None:
        """Train on the rest of the current epoch (or until --max-steps)."""
        sampler = run.sampler
        epoch = sampler.epoch
        window = _Window(started=time.perf_counter())
        if isinstance(run.train_set, SampleRandom):  # before the loader forks its workers, which inherit it
            run.train_set.set_epoch(epoch, self.config.seed)
        sample_shape = run.train_set[0][0].shape
        for inputs, labels in self._batches(run.train_set, sampler, sample_shape):
            lr = learning_rate(self.config, (epoch * sampler.length + sampler.consumed) / run.total_samples)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            chunk = len(sampler.step_chunk(self.world))
            loss, correct = self._step(run, inputs.to(self.device), labels.to(self.device), chunk)
            sampler.advance(self.world)
            self.step += 1
            self._updating = False
            window.add(loss, correct, chunk)
            self._after_step(run)
            if self.step % self.config.log_every == 0:
                self._log_progress(run, window, lr)
                window = _Window(started=time.perf_counter())
            if self._step_limit_reached():
                break

    def _log_progress(self, run: _Run, window: _Window, lr: float) -> None:
        """All-reduce the window's loss and accuracy, and emit one progress record."""
        totals = torch.tensor([window.loss, window.correct], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        samples = max(window.samples, 1)
        record = Progress(
            step=self.step,
            epoch=run.sampler.epoch,
            world_size=self.world,
            loss=float(totals[0]) / samples,
            accuracy=float(totals[1]) / samples,
            samples_per_s=window.samples / max(time.perf_counter() - window.started, 1e-9),
            lr=lr,
            checkpoint_step=self.manager.last_committed if self.manager else None,
            checkpoint_error=self.manager.last_error if self.manager else None,
            trained_samples=_trained(run.sampler),
        )
        self._emit({"event": "progress", **asdict(record)})
        if self._tensorboard is not None:
            for key in ("loss", "accuracy", "samples_per_s", "lr"):
                self._tensorboard.add_scalar(key, getattr(record, key), self.step)

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.config.optimizer == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay)
        return torch.optim.SGD(
            model.parameters(),
            lr=self.config.lr,
            momentum=0.9,
            nesterov=True,
            weight_decay=self.config.weight_decay,
        )

    def _batches(
        self, dataset: Dataset[Any], sampler: ElasticSampler, sample_shape: torch.Size
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        loader = DataLoader(
            dataset,
            batch_sampler=list(sampler.epoch_batches(self.rank, self.world)),
            num_workers=self.config.workers,
            collate_fn=_Collate(sample_shape),
            worker_init_fn=lambda _: reset_sigterm(),
            pin_memory=self.device.type == "cuda",
        )
        yield from loader

    def _step(self, run: _Run, inputs: torch.Tensor, labels: torch.Tensor, chunk: int) -> tuple[float, float]:
        """One optimizer step. The loss is scaled so that DDP's average over ranks equals
        the mean over the step's `chunk` samples, even when ranks hold unequal shares."""
        run.ddp.train()
        run.optimizer.zero_grad(set_to_none=True)
        logits = run.ddp(inputs)
        summed = nn.functional.cross_entropy(logits, labels, reduction="sum")
        (summed * self.world / chunk).backward()  # type: ignore[no-untyped-call]
        self._updating = True
        run.optimizer.step()
        correct = float((logits.argmax(1) == labels).sum()) if len(labels) else 0.0
        return float(summed.detach()), correct

    def _state(self, run: _Run) -> dict[str, Any]:
        return {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "sampler": run.sampler.state_dict(),
            "step": self.step,
            "rng": rng_state(),
        }

    def _meta(self, sampler: ElasticSampler) -> dict[str, Any]:
        return {
            "epoch": sampler.epoch,
            "world_size": self.world,
            "samples_in_epoch": sampler.consumed,
        }

    def _after_step(self, run: _Run) -> None:
        """Agree on eviction notices, and checkpoint on schedule."""
        self.notice.step_boundary()
        noticed = [level for (level,) in self._gather_ints([self._notice_level()])]
        if self.notice.is_set():
            self.notice.acknowledged.set()
        if any(noticed):
            self._evict(run, saver=emergency_saver(noticed))
            return
        every = self.config.checkpoint_every
        if self.manager is not None and self.rank == 0 and every and self.step % every == 0:
            self.manager.save_async(self.step, self._state(run), self._meta(run.sampler))

    def _notice_level(self) -> int:
        """notice_level from our notice and our agent's markers (the restart marker is read only
        for a SIGTERM; the leaving marker at every boundary, a file check of microseconds)."""
        notice = self.notice.notice if self.notice.is_set() else None
        restarting = notice is not None and notice.source == "SIGTERM" and agent_restarting()
        return notice_level(notice, restarting=restarting, leaving=node_leaving())

    def _evict(self, run: _Run, *, saver: int | None) -> None:
        """Emergency checkpoint at this step boundary, then leave (or hold) without training on.

        Rank `saver` (a leaving one: its grace period covers it) writes the checkpoint to Blob;
        nobody does when every notice is an agent's restart (a node joins or a peer is lost, no
        node of ours leaves): each node's snapshot carries the state to the next round. A rank
        that got its own SIGTERM, or whose agent marked its node leaving, leaves without waiting
        for the checkpoint (its snapshot holds the same step), so the nodes that stay re-form
        while the leaving one writes.
        """
        if self.manager is not None and self.rank == saver:
            report = self.manager.save_sync(self.step, self._state(run), self._meta(run.sampler))
            self._emit({"event": "emergency_checkpoint", "step": self.step, "ok": report.ok, "rank": self.rank,
                        "seconds": round(report.seconds, 3)}, any_rank=True)  # fmt: skip
        notice = self.notice.notice
        if (notice is not None and notice.source == "SIGTERM") or node_leaving():
            self._keep_snapshot()  # the node may stay (torchrun restarting us for a new member)
            self._exit_evicted()
        self.notice.parked = True  # our agent's SIGTERM (the leaving node is gone) ends us at once
        dist.barrier()  # everyone knows the checkpoint is committed
        if notice is not None and notice.event_id and self._watcher is not None:
            self._watcher.approve(notice.event_id)
        # Hold: ping the group until the evicted node is gone (the ping then fails and
        # the agent re-forms the group), or until notice_hold passes (a false alarm).
        deadline = time.monotonic() + self.config.notice_hold
        ping = torch.zeros(1, device=self.device)
        while time.monotonic() < deadline:
            time.sleep(0.2)
            dist.all_reduce(ping)
            if self.notice.is_set() and self.notice.notice and self.notice.notice.source == "SIGTERM":
                self._keep_snapshot()
                self._exit_evicted()
        self._emit({"event": "notice_expired", "step": self.step, "held_s": self.config.notice_hold})
        self.notice.parked = False
        self.notice.clear()

    def _exit_evicted(self) -> None:
        """Leave at once after the emergency checkpoint; peers see our sockets close."""
        if self._watcher is not None:
            self._watcher.stop()
        _leave(EXIT_EVICTED)

    def _resume(self, run: _Run) -> None:
        """Resume from the newest node-local snapshot a rank holds, else from the newest committed
        checkpoint; rank 0 chooses, so all ranks load the same state."""
        assert self.manager is not None
        mine = self._snapshot.read() if self._snapshot is not None else None
        held = self._gather_held(None if mine is None else mine[0])
        choice = torch.tensor([-1, -1], dtype=torch.long, device=self.device)  # [snapshot source, step]
        loaded = None
        if self.rank == 0:
            committed = self.manager.latest_step() if any(held) else None
            picked = choose_source(held, committed)
            if picked is not None:
                choice[0], choice[1] = picked[0], picked[1].step
                self.manager.last_committed = committed
            else:
                loaded = self.manager.load_latest()
                choice[1] = -1 if loaded is None else loaded.step
        dist.broadcast(choice, src=0)
        source, step = int(choice[0]), int(choice[1])
        if source >= 0:
            self._load(run, self._state_from(source, held, mine))
            self.resumed_from = "snapshot"
        elif step >= 0:
            if self.rank != 0:
                loaded = self.manager.load_step(step)
            if loaded is None:
                raise RuntimeError(f"rank {self.rank}: checkpoint step {step} chosen by rank 0 is not readable here")
            self._load(run, loaded.state)
            self.manager.last_committed = self.step
            self.resumed_from = "checkpoint"
        self._base = self.step

    def _gather_ints(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (the same length on all), by rank: one all-gather and one copy
        to the host (this runs after every step)."""
        mine = torch.tensor(row, dtype=torch.long, device=self.device)
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        gathered: list[list[int]] = torch.stack(rows).tolist()
        return gathered

    def _gather_held(self, mine: Held | None) -> list[Held | None]:
        """Every rank's snapshot (base and step), by rank."""
        rows = self._gather_ints([0, 0, 0] if mine is None else [1, mine.base, mine.step])
        return [Held(base, step) if has else None for has, base, step in rows]

    def _state_from(
        self, source: int, held: list[Held | None], mine: tuple[Held, dict[str, Any]] | None
    ) -> dict[str, Any]:
        """The chosen snapshot's state: this rank's own copy when it holds the same one, else the
        source's, sent over the process group (only when some rank lacks it: a joining node;
        every rank knows from `held` whether one does)."""
        chosen = held[source]
        state = mine[1] if mine is not None and mine[0] == chosen else None
        if any(h != chosen for h in held):
            box: list[Any] = [state if self.rank == source else None]
            dist.broadcast_object_list(box, src=source)
            state = state if state is not None else box[0]
        assert state is not None
        return state

    def _load(self, run: _Run, state: dict[str, Any]) -> None:
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])

    def _evaluate(self, model: nn.Module, test_set: Dataset[Any]) -> float:
        """Top-1 accuracy over the whole test set, each rank scoring every world-th sample."""
        model.eval()
        indices = list(range(self.rank, len(test_set), self.world))  # type: ignore[arg-type]
        correct = total = 0
        with torch.no_grad():
            for start in range(0, len(indices), 256):
                items = [test_set[i] for i in indices[start : start + 256]]
                inputs = torch.stack([x for x, _ in items]).to(self.device)
                labels = torch.tensor([y for _, y in items], device=self.device)
                correct += int((model(inputs).argmax(1) == labels).sum())
                total += len(items)
        counts = torch.tensor([correct, total], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        return float(counts[0] / counts[1])

    def _shutdown(self) -> None:
        if self._reporter is not None:
            self._reporter.close()
        if self._watcher is not None:
            self._watcher.stop()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if dist.is_initialized():
            dist.destroy_process_group()
