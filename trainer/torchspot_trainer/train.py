"""The elastic training loop: DDP ResNet training that survives world-size changes.

One public method, `Trainer.train()`. The topology comes from torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK). This module keeps the loop, evaluation and the model's state; each other concern has its
own module:

- one step over a worker's micro-batches (gradient accumulation, the loss weighting): step.py; the
  batch rule and learning rate: optim.py; which samples each rank takes in each step, exact-once at any
  world size: data/sampler.py;
- what a run is built from (device, refusals, group, data, model, checkpoints): run.py; its records:
  progress.py; evaluation (sharded, interruptible by a notice): evaluate.py;
- the restart path's resume (a node's snapshot, or the newest checkpoint): recovery/resume.py;
- at a step boundary and as a worker leaves (notices and the emergency checkpoint, the checkpoint
  schedule, the host copy and the node's snapshot, the exit from a broken group): boundary.py, on
  elastic/leaving.py, with the rules in recovery/notices.py and recovery/signals.py;
- with `--in-place`, a membership change restarts nothing: in_place.py enters the next round and heals
  in it, and the loop plans its epoch again for the new world from the sampler, which never counted the
  interrupted step.

Rank 0 alone writes checkpoints (asynchronously every `checkpoint_every` steps). At an eviction notice
the group stops at the next step boundary: the lowest rank whose node leaves writes the emergency
checkpoint, and the others hold until the node is gone, so no step is run twice. With
`--global-batch-size` the run computes the same model whatever happens to its nodes, up to the order of
floating-point reductions.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchspot_trainer.boundary import Boundary
from torchspot_trainer.config import TrainConfig
from torchspot_trainer.data.datasets import SampleRandom
from torchspot_trainer.data.loader import (
    DeviceDecoder,
    gpu_decoder,
    loader_workers,
    usable_cpus,
)
from torchspot_trainer.data.sampler import ElasticSampler
from torchspot_trainer.elastic.settings import node_name
from torchspot_trainer.evaluate import evaluate
from torchspot_trainer.events import Events
from torchspot_trainer.handover import Assignment
from torchspot_trainer.in_place import InPlace
from torchspot_trainer.nccl import NCCL_ERROR_HANDLING_ENV, NCCL_RETHROW_ENV
from torchspot_trainer.optim import learning_rate
from torchspot_trainer.precision import Precision
from torchspot_trainer.progress import (
    Progress,
    Window,
    process_age,
    record_means,
    stopwatch,
    trained_samples,
)
from torchspot_trainer.recovery.group import (
    Group,
    StepWatchdog,
    peer_failure,
)
from torchspot_trainer.recovery.notices import (
    GroupBroken,
)
from torchspot_trainer.recovery.outcome import GroupChanged
from torchspot_trainer.recovery.resume import (
    find_state,
)
from torchspot_trainer.recovery.rng import rng_state, set_rng_state
from torchspot_trainer.run import (
    Run,
    build_model,
    build_run,
    choose_in_place,
    decode_refusal,
    form_default_group,
    in_place_refusal,
    load_datasets,
    node_device,
    sync_bn_refusal,
    warm_up_run,
)
from torchspot_trainer.step import model_inputs, train_step

log = logging.getLogger(__name__)
T = TypeVar("T")


class Trainer:
    """Trains `config.model` on `config.dataset` under torchrun; see the module docstring."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self._run: Run | None = None
        """Set once the state is whole (after the resume): from then on a snapshot may be taken.
        Kept after the run ends (fork_server.run_trainer says why)."""
        self._events = Events(config.events_file)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        usable = torch.cuda.is_available()
        self.device, self.backend = node_device(config.device, self.local_rank, usable)
        self.boundary = Boundary(config, self.device, emit=self._emit, state=lambda: self._state(self._whole()))
        """Notices, checkpoints, the host copy and the node's snapshot, and the exit (boundary.py)."""
        self.notice, self.stop = self.boundary.notice, self.boundary.stop
        refusal = in_place_refusal(config.in_place, os.environ, sync_bn=config.sync_bn)
        if refusal:
            raise SystemExit(refusal)
        in_place, why = choose_in_place(
            config.in_place, os.environ, sync_bn=config.sync_bn, nccl=self.backend == "nccl"
        )
        if self.rank == 0:  # said once per job
            log.info("torchspot: %s", why)
        self.precision = Precision(config.precision, self.device)
        self._in_place: InPlace | None = None
        if in_place:  # made at once: a round handed over during the set-up is acknowledged
            self._in_place = InPlace(
                self.device, rank=self.rank, world=self.world,
                collective_timeout=config.collective_timeout, scaled=self.precision.scaler is not None,
                state=self._state, load=self._load, trains_next=self._trains_next, emit=self._emit,
                leave=self.boundary.leave_broken_group, entered=self._entered,
            )  # fmt: skip
            self.stop.done_with_group = self._in_place.handover.agreed
        self.loader_workers = loader_workers(
            config.workers, cuda=self.device.type == "cuda", cpus=usable_cpus(),
            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )  # fmt: skip
        """--workers as a number for this node (torchrun's LOCAL_WORLD_SIZE: the processes sharing its cores)."""
        self.step = 0
        self.setup_seconds: dict[str, float] = {}
        """Where a (re)start's time went: process start-up to here, then each part of `_setup`; in place,
        after a re-form, where the re-form's went (`_reform`)."""
        self._watchdog = StepWatchdog(
            config.collective_timeout, lambda: self.notice.boundary, self._broken_group
        ).start()
        self._control: Any = None
        """The gloo group for the per-step agreements beside an NCCL group (group.control_group)."""
        self.resumed_from = "start"
        """`checkpoint` (Blob), `snapshot` (a node's local copy) or `start` (nothing to resume)."""

    @property
    def group(self) -> Group:
        if self._in_place is not None:
            return self._in_place.collectives()
        return Group(self.rank, self.world, self.device, self._control)

    # -- the loop -------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Run (or resume) training to the end; return the final summary (rank 0's view).

        If the loop raises (a collective failed because a peer left, or a bug), the
        worker leaves at once with EXIT_FAILED, after a line for a peer's failure
        (`peer_failure`) or the traceback of any other: a normal interpreter exit would
        wait on the process group and background threads, and every second spent here
        delays the agents' next round.
        """
        try:
            return self._train()
        except Exception as exc:
            peer = peer_failure(exc)
            if peer is None:
                log.exception("rank %d: training stopped at step %d", self.rank, self.step)
            else:
                log.warning("rank %d: training stopped at step %d: a collective failed at a peer (%s)",
                            self.rank, self.step, peer)  # fmt: skip
                log.debug("rank %d: the failed collective", self.rank, exc_info=True)
            self.boundary.leave_broken_group()

    def _train(self) -> dict[str, Any]:
        run = self._setup()
        if not self._receiving():  # (a receiver's comes with its state: `_sit_out`)
            self._started(run)
        self.notice.step_boundary()
        self._watchdog.armed = True
        place = self._in_place
        while True:
            try:
                if not self._train_on(run):
                    break
                continue
            except (GroupChanged, GroupBroken) as exc:
                if place is None:  # the restart path: train() leaves, the agents re-form
                    raise
                failed = isinstance(exc, GroupChanged) and exc.failed
            # Out of the handler: its traceback holds the broken step's frames, and they the group
            # being left (its buckets' collectives). Held through the re-form, that group outlived its
            # grave, and its sockets stayed open while its loop spun (live.py's module docstring).
            self._reform(run, place, failed=failed)
        self._watchdog.armed = False  # the final save is not a step
        self.boundary.finish(self.step, self.rank, self._meta(run.sampler))
        summary = {"event": "done", "step": self.step, "epoch": run.sampler.epoch, "world_size": self.world,
                   "test_accuracy": run.evaluated[1]}  # fmt: skip
        self._emit(summary)
        self._shutdown()
        return summary

    def _train_on(self, run: Run) -> bool:
        """Evaluate an epoch's end if due, then train the rest of the epoch; False once training is over
        (evaluated). In place, a membership change raises out of here and the loop comes back after the
        re-form: the epoch is planned again for the new world from the sampler, which counts only
        completed steps, so the interrupted step's samples are dealt again (exact-once)."""
        carried = None
        if self._in_place is not None and self._receiving():
            carried = self._sit_out(run, self._in_place)
        if self._evaluation_due(run):
            self._evaluate(run, epoch=run.sampler.epoch - 1)
        if self._training_over(run):
            if run.evaluated[0] != self.step:  # stopped mid-epoch (--max-steps)
                self._evaluate(run, epoch=run.sampler.epoch)
            return False
        # The sit-out step's window goes on as the trainers' does, unless it ended an epoch (theirs ended too).
        self._train_epoch(run, carried if run.sampler.consumed else None)
        return True

    def _started(self, run: Run) -> None:
        """The `start` event of a round (or, in place, of a generation), and in place each rank's
        `generation` event: its process id shows that no process was restarted."""
        record: dict[str, Any] = {
            "event": "start", "step": self.step, "epoch": run.sampler.epoch, "world_size": self.world,
            "resumed_samples": run.sampler.consumed, "trained_samples": trained_samples(run.sampler),
            "resumed_from": self.resumed_from, "step_samples": run.rule.step_batch(self.world),
            "loader_workers": self.loader_workers,
            "setup_s": {k: round(v, 2) for k, v in self.setup_seconds.items()},
            "nccl": {key: os.environ.get(key) for key in (NCCL_ERROR_HANDLING_ENV, NCCL_RETHROW_ENV)},
        }  # fmt: skip
        if self._in_place is not None:
            record["generation"] = self._in_place.generation
            self._emit({"event": "generation", "generation": self._in_place.generation, "rank": self.rank,
                        "world_size": self.world, "step": self.step, "pid": os.getpid(),
                        "node": node_name(),
                        "setup_s": record["setup_s"]}, any_rank=True)  # fmt: skip
        self._emit(record)

    def _receiving(self) -> bool:
        """In place, a heal's receiver whose state is still on its way (`_sit_out`): it holds no state of
        the run yet."""
        return self._in_place is not None and self._in_place.arriving is not None

    def _evaluation_due(self, run: Run) -> bool:
        """An epoch's end not evaluated yet (once: also when a notice interrupted its evaluation)."""
        return run.sampler.consumed == 0 and run.sampler.epoch > 0 and run.evaluated[0] != self.step

    def _training_over(self, run: Run) -> bool:
        return run.sampler.epoch >= self.config.epochs or self._step_limit_reached()

    def _trains_next(self, run: Run) -> bool:
        """The next thing the loop does is a training step: no evaluation is due, and training is not over."""
        return not (self._evaluation_due(run) or self._training_over(run))

    def _train_epoch(self, run: Run, window: Window | None = None) -> None:
        """Train on the rest of the current epoch (or until --max-steps): the step loop. `window`: the
        progress window to go on with (a heal's receiver's, after the step it sat out)."""
        sampler = run.sampler
        epoch = sampler.epoch
        plans = list(sampler.epoch_steps(self.rank, self.world))
        trainers = None if self._in_place is None else self._in_place.trainers
        if trainers is not None and plans:  # the heal's receivers sit this step out (InPlace.trainers)
            plans[0] = sampler.micro_batches(trainers.index(self.rank), self.world, among=len(trainers))
        batches = run.train_loader.epoch(epoch, [part for plan in plans for part in plan])
        window = window or Window(self.device)
        for plan in plans:
            lr = self._set_learning_rate(run)
            step_samples = sampler.next_step_samples(self.world)
            computed = sum(len(part) for part in plan)
            if self._in_place is not None:
                self._in_place.keep_boundary(run.model, self.step)
            loss, correct = train_step(
                run.ddp, run.optimizer, batches, passes=len(plan), step_samples=step_samples, world=self.world,
                device=self.device, before_update=partial(self._begin_update, window, computed),
                precision=self.precision, normalize=run.normalize, before_last_pass=self._arm_buckets,
            )  # fmt: skip
            window = self._finish_step(run, window, (loss, correct), step_samples, lr, computed=computed)
            if self._step_limit_reached():
                break

    def _finish_step(
        self,
        run: Run,
        window: Window,
        sums: tuple[torch.Tensor, torch.Tensor],
        step_samples: int,
        lr: float,
        *,
        computed: int,
    ) -> Window:
        """After a step's update: count it, copy it to the host, log it when due, then its boundary
        (notices, the checkpoint schedule). The window to go on with."""
        run.sampler.advance(self.world)
        self.step += 1
        if self._in_place is not None:
            self._in_place.stepped()
        self._capture(run)
        window.add(*sums, step_samples, computed)
        if self.step % self.config.log_every == 0:  # before a notice may end this round at this step
            self._log_progress(run, window, lr)
            window = Window(self.device)
        self._after_step(run)
        return window

    def _set_learning_rate(self, run: Run) -> float:
        """Set the scheduled learning rate for the next step (a function of samples consumed)."""
        progress = trained_samples(run.sampler) / run.total_samples
        lr = learning_rate(
            run.rule.peak_lr(self.world), schedule=self.config.schedule, warmup=self.config.warmup, progress=progress
        )
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _begin_update(self, window: Window, computed: int, loss: torch.Tensor, correct: torch.Tensor) -> None:
        """Between the step's last backward pass and its update (`loss`, `correct`: the step's sums over the
        `computed` samples of this rank, not yet in `window`). In place the gradients are averaged here:
        a failed average raises GroupChanged before anything of the step is applied."""
        self._average(self.step + 1, lambda: window.sums(loss, correct, computed))

    def _arm_buckets(self) -> None:
        """Before a step's last backward pass in place (InPlace.arm_buckets)."""
        if self._run is not None and self._in_place is not None:
            self._in_place.arm_buckets(self._run)

    def _average(self, step: int, window: Callable[[], list[torch.Tensor]]) -> None:
        """`_begin_update` for the update that makes `step`: in place, the gradient average, with the
        progress window's sums (`window()`, this step's included) where `step` is due a record
        (`_log_progress` reads them); then the host copy's moment before the update."""
        if self._run is not None and self._in_place is not None:
            due = step % self.config.log_every == 0
            self._in_place.before_update(self._run, step, row=self.stop.row, sums=window if due else None)
        self.boundary.host.before_update()

    def _step_limit_reached(self) -> bool:
        return bool(self.config.max_steps) and self.step >= self.config.max_steps

    def _log_progress(self, run: Run, window: Window, lr: float) -> None:
        """Sum the window's loss and accuracy over the group, and emit one progress record. In place the
        sums came with the step's gradients (`_average`): no collective here. A group that breaks before
        the sums leaves the step applied (in place it goes on from it; by the restart path the snapshot
        holds it): every rank this happened to emits its record all the same, with its share
        (`partial`), since rank 0 may be the one that is gone; then the break goes on to the re-form
        (GroupChanged in place; gloo's or NCCL's RuntimeError otherwise). A log then misses no step that
        was trained."""
        summed = None if self._in_place is None else self._in_place.summed_progress(self.step)
        if summed is not None:  # summed with the step's gradients (`_average`)
            self._emit_progress(run, window, lr, summed, partial=False)
            return
        try:
            sums = self.group.sums(window.sums())
        except RuntimeError:  # GroupChanged is one
            self._emit_progress(run, window, lr, [float(part) for part in window.sums()], partial=True)
            raise
        self._emit_progress(run, window, lr, sums, partial=False)

    def _emit_progress(self, run: Run, window: Window, lr: float, sums: list[float], *, partial: bool) -> None:
        """One progress record from `sums` (the group's, or this rank's where `partial`: `Window.sums`)."""
        loss, accuracy = record_means(*sums)
        checkpoints = self.boundary.checkpoints
        record = Progress(
            step=self.step,
            epoch=run.sampler.epoch,
            world_size=self.world,
            loss=loss,
            accuracy=accuracy,
            samples_per_s=window.samples / max(time.perf_counter() - window.started, 1e-9),
            lr=lr,
            checkpoint_step=checkpoints.last_committed if checkpoints else None,
            checkpoint_error=checkpoints.last_error if checkpoints else None,
            trained_samples=trained_samples(run.sampler),
            step_samples=run.rule.step_batch(self.world),
            partial=partial,
        )
        if partial:  # every rank whose sums broke: rank 0 may be the one that is gone
            self._emit({"event": "progress", **asdict(record), "rank": self.rank, **self._lineage()}, any_rank=True)
            return
        event = {"t": time.time(), "event": "progress", **asdict(record), **self._lineage()}
        self._emit(event)
        if self._in_place is not None:
            self._in_place.record_written(event)
        self._events.scalars(
            self.step, {key: getattr(record, key) for key in ("loss", "accuracy", "samples_per_s", "lr")}
        )

    def _lineage(self) -> dict[str, Any]:
        """In place, who wrote a progress record: the generation and the node (`whole_records`)."""
        return {} if self._in_place is None else self._in_place.lineage()

    def _evaluate(self, run: Run, *, epoch: int) -> None:
        """Evaluate on the test set (sharded; a notice between batches stops the group as after
        a step), record the result in the state and emit it."""
        accuracy = evaluate(
            run.model, len(run.test_set), self.group, batch_size=self.config.eval_batch_size,  # type: ignore[arg-type]
            load=partial(run.test_loader.epoch, 0),
            prepare=partial(model_inputs, device=self.device, precision=self.precision, normalize=run.normalize),
            between=partial(self._agree_on_notices, run), autocast=self.precision.autocast,
        )  # fmt: skip
        run.evaluated = (self.step, accuracy)
        self._emit({"event": "eval", "step": self.step, "epoch": epoch, "accuracy": accuracy})

    # -- set-up ---------------------------------------------------------------------

    def _setup(self) -> Run:
        """Process group, data, model, optimizer; then resume, and TensorBoard where asked."""
        config = self.config
        self.setup_seconds["process"] = process_age()
        lap = stopwatch(self.setup_seconds)
        refusal = sync_bn_refusal(config.sync_bn, self.device) or decode_refusal(config.decode, self.device)
        if refusal:
            raise ValueError(refusal)
        # --decode gpu: the batch's JPEGs are decoded, cropped and resized on the GPU (loader.py); without
        # torchvision this stops here, before the group forms.
        decoder = DeviceDecoder(gpu_decoder(), self.device, config.image_size) if config.decode == "gpu" else None
        if self._in_place is None:  # in place, the group is formed once data and model are ready
            self._control = form_default_group(self.backend, self.device, config.collective_timeout)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            lap("group")
        train_set, test_set, classes = load_datasets(config)
        if isinstance(train_set, SampleRandom):  # before the loader forks its workers, which keep it
            train_set.set_epoch(0, config.seed)
        lap("data")
        model = self.precision.prepare(build_model(config, classes, self.device))
        in_place = None if self._in_place is None else self._in_place.live.plane
        run = build_run(
            config, model, (train_set, test_set), world=self.world, device=self.device, local_rank=self.local_rank,
            loader_workers=self.loader_workers, decoder=decoder, in_place=in_place,
        )  # fmt: skip
        lap("model")
        if self._in_place is not None:
            if decoder is None:  # (with --decode gpu the data set holds encoded images: the first step stays cold)
                warm_up_run(run, rank=self.rank, world=self.world, device=self.device, precision=self.precision)
            lap("warm_up")
            self._in_place.enter()
            lap("group")
        self._resume(run, lap)
        if config.tensorboard and self.rank == 0:
            self._events.open_tensorboard(config.tensorboard)
        return run

    def _resume(self, run: Run, lap: Callable[[str], None]) -> None:
        """Open the checkpoints and the operator's milestones, then go on from the newest state: the group's
        (in place), a node's snapshot or a checkpoint (resume.find_state). The nodes' snapshots of the
        last round are read with or without a checkpoint URI: they were written at every loss."""
        checkpoints = self.boundary.open(self.rank)
        if self._in_place is not None:
            self._in_place.checkpoints = checkpoints
        lap("checkpoints")
        mine = self.boundary.leaving.read_snapshot()
        if self._in_place is not None:
            self.resumed_from = self._in_place.resume(run, mine, lap)
        else:
            self.resumed_from, state = find_state(self.group, checkpoints, mine)
            if state is not None:
                self._load(run, state)
        self.boundary.resumed(self.step)
        lap("resume")
        self._run = run
        self._capture(run)  # a snapshot of the resumed state, before any step

    # -- in place (--in-place) -------------------------------------------------------

    def _entered(self, assignment: Assignment) -> None:
        """In place, each round this worker enters: its rank, world size and node there."""
        self.rank, self.world, self.stop.node = assignment.rank, assignment.world, assignment.node

    def _sit_out(self, run: Run, place: InPlace) -> Window:
        """A heal's receiver in the step its trainers take without it (InPlace.receive): it loads the state
        once it arrived, the trainers meanwhile computing; then its gradients count zero in the step's
        all-reduce (the step's scale is the world's, so the average is the trainers' samples' mean),
        which also brings the step's BatchNorm buffers, and it applies the step as the others do and goes
        on with them. Returns its progress window: with --log-every above 1 the step's samples count in
        the next record, as on the trainers (rank 0 may be a receiver)."""
        step = place.receive(run)
        self.boundary.resumed(self.step)
        self._started(run)
        lr = self._set_learning_rate(run)
        step_samples = run.sampler.next_step_samples(self.world)
        run.optimizer.zero_grad(set_to_none=True)
        self._average(step + 1, Window(self.device).sums)  # (this rank computed nothing)
        self.precision.step(run.optimizer)
        nothing = torch.zeros((), device=self.device)
        return self._finish_step(run, Window(self.device), (nothing, nothing.long()), step_samples, lr, computed=0)

    def _reform(self, run: Run, place: InPlace, *, failed: bool) -> None:
        """In place, after a collective did not complete: enter the next round, heal, go on
        (InPlace.reform); the step watchdog rests meanwhile (REFORM_SECONDS bounds the wait)."""
        self._watchdog.armed = False
        self.notice.parked = False  # a hold for a leaving peer ends with the round it leaves
        self.setup_seconds = {}  # the start record of the next generation says where the re-form's time went
        self.resumed_from = place.reform(run, step=self.step, failed=failed, lap=stopwatch(self.setup_seconds))
        if not self._receiving():  # (a receiver's state is whole once it came: `_sit_out`)
            self.boundary.resumed(self.step)
        self.boundary.ranks_changed(self.rank)
        self._capture(run)
        if not self._receiving():  # (a receiver's comes with its state: `_sit_out`)
            self._started(run)
        self.notice.step_boundary()
        self._watchdog.armed = True

    # -- state ----------------------------------------------------------------------

    def _state(self, run: Run) -> dict[str, Any]:
        return {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "sampler": run.sampler.state_dict(),
            "step": self.step,
            "rng": rng_state(),
            "batch_rule": run.rule.state_dict(),
            "evaluated": {"step": run.evaluated[0], "accuracy": run.evaluated[1]},
            "grad_scaler": self.precision.state_dict(),
        }

    def _load(self, run: Run, state: dict[str, Any]) -> None:
        """Take over a resumed state. The batch and learning-rate rule it recorded wins over the
        flags: it is what makes the resumed run the same run (a changed flag is reported)."""
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.precision.load_state_dict(state.get("grad_scaler") or {})
        self.step = int(state["step"])
        run.rule, ignored = run.rule.resumed(state.get("batch_rule"))
        if ignored:
            self._emit({"event": "settings_from_checkpoint",
                        "kept": {key: recorded for key, (_, recorded) in ignored.items()},
                        "ignored_flags": {key: flag for key, (flag, _) in ignored.items()}})  # fmt: skip
        run.sampler.global_batch, run.sampler.batch_size = run.rule.global_batch_size, run.rule.batch_size
        evaluated = state.get("evaluated", {"step": self.step, "accuracy": math.nan})
        run.evaluated = (int(evaluated["step"]), float(evaluated["accuracy"]))

    def _meta(self, sampler: ElasticSampler) -> dict[str, Any]:
        return {
            "epoch": sampler.epoch,
            "world_size": self.world,
            "samples_in_epoch": sampler.consumed,
        }

    def _whole(self) -> Run:
        """The run, once its state is whole (after the resume): what a snapshot or checkpoint holds."""
        if self._run is None:
            raise RuntimeError("the run's state is not whole yet")
        return self._run

    def _capture(self, run: Run) -> None:
        """The host copy of this boundary's state (boundary.py); not by a heal's receiver before its state
        came."""
        if not self._receiving():
            self.boundary.capture(self.step, run.model)

    def _broken_group(self, _since: float) -> None:
        """The step watchdog's verdict: no boundary for --collective-timeout seconds."""
        self._emit({"event": "collective_timeout", "step": self.step, "limit_s": self.config.collective_timeout},
                   any_rank=True)  # fmt: skip
        self.boundary.leave_broken_group()

    # -- at a boundary --------------------------------------------------------------

    def _after_step(self, run: Run) -> None:
        """Notices, the operator's step report and the checkpoint schedule (boundary.py)."""
        self.boundary.after_step(self.step, self.rank, self._meta(run.sampler), lambda: self.group)

    def _agree_on_notices(self, run: Run) -> bool:
        """Between evaluation batches: a notice stops the group as after a step (boundary.py)."""
        return self.boundary.agree_on_notices(self.step, self._meta(run.sampler), self.group)

    # -- output ---------------------------------------------------------------------

    def _emit(self, record: dict[str, Any], *, any_rank: bool = False) -> None:
        """One record (events.py): rank 0's, or any rank's with `any_rank` (an event only that rank sees)."""
        if self.rank == 0 or any_rank:
            self._events.write(record)

    def _shutdown(self) -> None:
        self._watchdog.stop()
        if self._in_place is not None:
            self._in_place.close()
        if self._run is not None:
            self._run.train_loader.close()
            self._run.test_loader.close()
        self.boundary.close()
        self._events.close()
        if dist.is_initialized():
            dist.destroy_process_group()
