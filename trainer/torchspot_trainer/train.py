"""The built-in trainer: DDP ResNet training that survives world-size changes, on torchspot's recovery API.

One public method, `Trainer.train()`. The trainer is the recovery API's first user (torchspot.elastic): it
keeps the loop, evaluation and the model's state, and calls the `Manager` at the points any script does
(docs/own-script.md), so every recovery mechanism (groups and heals, the commit rule, eviction notices
and the emergency checkpoint, checkpoints, node snapshots, the operator's reports) is the manager's:

- `optimizer.zero_grad()` begins a step, in the next group where one is due; `optimizer.step()` applies
  it only where its gradients' all-reduce completed, and otherwise the manager has re-formed: the loop
  plans its epoch again for the new group from the sampler, which counts only committed steps, so the
  step's samples are dealt again (exact-once);
- the loop plans the rest of an epoch once and plans it again whenever the group or the position
  changed under the plan (a re-form, a heal's state);
- between steps, evaluation heeds eviction notices at each batch (`Manager.heed_notices`), and its
  result is a change of the state that a heal carries (`Manager.state_changed`);
- a worker whose state is on its way from a live peer takes the group's next step with the others
  before it reads its state to decide anything (`Manager.state_arriving`).

Each other concern has its own module: one step over a worker's micro-batches: step.py; the batch rule
and learning rate: optim.py; which samples each rank takes in each step: data/sampler.py; what a run is
built from: run.py; its records: progress.py; evaluation: evaluate.py.

With `--global-batch-size` the run computes the same model whatever happens to its nodes, up to the order
of floating-point reductions.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from torchspot_trainer.config import TrainConfig
from torchspot_trainer.data.datasets import SampleRandom
from torchspot_trainer.data.loader import DeviceDecoder, gpu_decoder, loader_workers, usable_cpus
from torchspot_trainer.elastic import DistributedDataParallel, GradScaler, Manager, OptimizerWrapper
from torchspot_trainer.elastic.settings import node_name
from torchspot_trainer.evaluate import evaluate
from torchspot_trainer.events import Events
from torchspot_trainer.nccl import NCCL_ERROR_HANDLING_ENV, NCCL_RETHROW_ENV
from torchspot_trainer.optim import learning_rate
from torchspot_trainer.precision import Precision
from torchspot_trainer.progress import Progress, Window, process_age, record_means, stopwatch
from torchspot_trainer.recovery.group import peer_failure
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


@dataclass
class _Plan:
    """The rest of an epoch as this rank takes it: its micro-batches' batches, loaded ahead in order."""

    at: tuple[int, int, int, int, tuple[int, int]]
    """Where the next step of the plan begins: (epoch, samples consumed, rank, world size, share)."""
    steps: list[list[list[int]]]
    batches: Any


class Trainer:
    """Trains `config.model` on `config.dataset` under torchrun; see the module docstring."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self._events = Events(config.events_file)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device, self.backend = node_device(config.device, self.local_rank, torch.cuda.is_available())
        refusal = in_place_refusal(config.in_place, os.environ, sync_bn=config.sync_bn)
        if refusal:
            raise SystemExit(refusal)
        in_place, why = choose_in_place(
            config.in_place, os.environ, sync_bn=config.sync_bn, nccl=self.backend == "nccl"
        )
        if os.environ.get("RANK", "0") == "0":  # said once per job
            log.info("torchspot: %s", why)
        self._run: Run | None = None
        """Set once the run is built. Kept after the run ends (fork_server.run_trainer says why)."""
        self.manager = Manager(
            self._state, self._load, checkpoint_uri=config.checkpoint_uri,
            checkpoint_every=config.checkpoint_every if config.checkpoint_uri else 0,  # (no URI: no checkpoints)
            keep_checkpoints=config.keep_checkpoints, in_place=in_place, device=self.device,
            commit_seconds=config.collective_timeout, events_file=config.events_file or None,
            notice_hold=config.notice_hold, scheduled_events=config.scheduled_events,
            snapshot_every=config.snapshot_every, checkpoint_saver=config.checkpoint_saver,
            checkpoint_retries=config.checkpoint_retries, progress_records=False,
        )  # fmt: skip
        """Made at once: in place, a round handed over during the set-up is acknowledged, and a notice that
        comes during it is heard."""
        scaler = GradScaler(self.manager, self.device.type) if config.precision == "fp16" else None
        self.precision = Precision(config.precision, self.device, scaler=scaler)
        self.loader_workers = loader_workers(
            config.workers, cuda=self.device.type == "cuda", cpus=usable_cpus(),
            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )  # fmt: skip
        """--workers as a number for this node (torchrun's LOCAL_WORLD_SIZE: the processes sharing its cores)."""
        self.setup_seconds: dict[str, float] = {}
        """Where the process's set-up time went: its start-up, then each part of `_setup`."""

    @property
    def rank(self) -> int:
        return self.manager.rank

    @property
    def world(self) -> int:
        return self.manager.world_size

    @property
    def step(self) -> int:
        return self.manager.current_step()

    # -- the loop -------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Run (or resume) training to the end; return the final summary (rank 0's view).

        If the loop raises (a collective of the restart path failed because a peer left, or a bug), the
        worker leaves at once by the restart path (`Manager.leave`), after a line for a peer's failure
        (`peer_failure`) or the traceback of any other: a normal interpreter exit would wait on the
        process group and background threads, and every second spent here delays the agents' next round.
        """
        try:
            return self._train()
        except Exception as exc:
            peer = peer_failure(exc)
            if peer is None:
                log.exception("rank %d: training stopped", self.rank)
            else:
                log.debug("rank %d: the failed collective", self.rank, exc_info=True)
            self._leave(f"a collective failed at a peer ({peer})" if peer else f"training stopped ({exc!r})")

    def _train(self) -> dict[str, Any]:
        run = self._setup()
        manager = self.manager
        window = Window(self.device)
        plan: _Plan | None = None
        while True:
            if not manager.state_arriving:  # (one that is takes the group's next step first)
                if self._evaluation_due(run) and not self._evaluate(run, epoch=run.sampler.epoch - 1):
                    continue  # the group changed meanwhile: evaluated again, in the next one
                if self._training_over(run):
                    if run.evaluated[0] != self.step and not self._evaluate(run, epoch=run.sampler.epoch):
                        continue  # stopped mid-epoch (--max-steps), and the group changed during the evaluation
                    break
            plan, window = self._take_step(run, plan, window)
        summary = {"event": "done", "step": self.step, "epoch": run.sampler.epoch, "world_size": self.world,
                   "test_accuracy": run.evaluated[1]}  # fmt: skip
        manager.close(epoch=run.sampler.epoch, test_accuracy=run.evaluated[1])
        self._shutdown()
        return summary

    def _take_step(self, run: Run, plan: _Plan | None, window: Window) -> tuple[_Plan | None, Window]:
        """One step: begun (the manager may re-form first), planned where the plan no longer holds, trained
        and, where its collectives completed, counted and logged. Returns the plan and the progress window
        to go on with (no plan after a step that was not applied: the next is planned again)."""
        manager, sampler = self.manager, run.sampler
        self._stepper.zero_grad(set_to_none=True)  # begins the step: a re-form here changes rank and world
        sits_out = manager.state_arriving  # its state comes during the step: its gradients count zero
        lr = self._set_learning_rate(run)
        at = (sampler.epoch, sampler.consumed, self.rank, self.world, manager.share())
        if plan is None or plan.at != at or not plan.steps:
            plan = self._plan(run, at)
        parts = plan.steps.pop(0)
        if not sits_out and parts != sampler.micro_batches(at[4][0], self.world, among=at[4][1]):
            plan, parts = self._plan_again(run, at, parts)
        step_samples = sampler.next_step_samples(self.world)
        loss, correct, applied = train_step(
            run.ddp, self._stepper, plan.batches, passes=len(parts), step_samples=step_samples,
            among=at[4][1], device=self.device, precision=self.precision, normalize=run.normalize,
        )  # fmt: skip
        if not applied:  # re-formed: the step is taken again by the next group, from the sampler
            return None, window
        computed = 0 if sits_out else sum(len(part) for part in parts)
        if sits_out:  # its plan was its old state's: the next step is planned from the state it took
            loss, correct, plan = torch.zeros_like(loss), torch.zeros_like(correct), None
        else:
            plan.at = (sampler.epoch, sampler.consumed, self.rank, self.world, (self.rank, self.world))
        window.add(loss, correct, step_samples, computed)
        if self.step % self.config.log_every == 0:
            self._log_progress(run, window, lr)
            window = Window(self.device)
        return plan, window

    def _plan(self, run: Run, at: tuple[int, int, int, int, tuple[int, int]]) -> _Plan:
        """The rest of the epoch from the sampler's position for this rank in this group; the first step's
        samples dealt over its share's ranks (`Manager.share`: after a heal beside it, its trainers)."""
        sampler = run.sampler
        steps = list(sampler.epoch_steps(self.rank, self.world))
        place, among = at[4]
        if steps and (place, among) != (self.rank, self.world):
            steps[0] = sampler.micro_batches(place, self.world, among=among)
        batches = run.train_loader.epoch(sampler.epoch, [part for step in steps for part in step])
        return _Plan(at, steps, batches)

    def _plan_again(
        self, run: Run, at: tuple[int, int, int, int, tuple[int, int]], parts: list[list[int]]
    ) -> tuple[_Plan, list[list[int]]]:
        """The plan's next samples are not the ones the sampler deals this rank now: a plan kept past a
        change of its state (a bug). Training them would take a sample twice in the epoch and skip
        another, silently; the step takes the sampler's instead, and a `plan_mismatch` record says so
        (the tests and the soak look for it)."""
        log.warning("rank %d: step %d's planned samples are not the sampler's: planned again", self.rank,
                    self.step + 1)  # fmt: skip
        self._emit({"event": "plan_mismatch", "step": self.step + 1, "rank": self.rank, "world_size": self.world,
                    "planned": parts}, any_rank=True)  # fmt: skip
        plan = self._plan(run, at)
        return plan, plan.steps.pop(0)

    def _evaluation_due(self, run: Run) -> bool:
        """An epoch's end not evaluated yet (once: also when a notice interrupted its evaluation)."""
        return run.sampler.consumed == 0 and run.sampler.epoch > 0 and run.evaluated[0] != self.step

    def _training_over(self, run: Run) -> bool:
        return run.sampler.epoch >= self.config.epochs or self._step_limit_reached()

    def _step_limit_reached(self) -> bool:
        return bool(self.config.max_steps) and self.step >= self.config.max_steps

    def _set_learning_rate(self, run: Run) -> float:
        """Set the scheduled learning rate for the next step (a function of samples consumed)."""
        progress = run.sampler.trained / run.total_samples
        lr = learning_rate(
            run.rule.peak_lr(self.world), schedule=self.config.schedule, warmup=self.config.warmup, progress=progress
        )
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _log_progress(self, run: Run, window: Window, lr: float) -> None:
        """Sum the window's loss and accuracy over the group, and emit one progress record. A group that
        broke after the step committed and before the sums leaves the step applied: every rank this
        happened to emits its record all the same, with its share (`partial`), since rank 0 may be the one
        that is gone (then, on the restart path, the failure goes on to the worker's exit). A log then misses
        no step that was trained."""
        sums = torch.stack([part.to(torch.float64) for part in window.sums()])
        try:
            summed = self.manager.all_reduce(sums)
        except RuntimeError:  # the restart path: a peer's socket closed; the worker then leaves
            summed = False
            raise
        finally:
            if summed:
                self._emit_progress(run, window, lr, sums.tolist(), partial=False)
            else:
                self._emit_progress(run, window, lr, [float(part) for part in window.sums()], partial=True)

    def _emit_progress(self, run: Run, window: Window, lr: float, sums: list[float], *, partial: bool) -> None:
        """One progress record from `sums` (the group's, or this rank's where `partial`: `Window.sums`)."""
        loss, accuracy = record_means(*sums)
        record = Progress(
            step=self.step,
            epoch=run.sampler.epoch,
            world_size=self.world,
            loss=loss,
            accuracy=accuracy,
            samples_per_s=window.samples / max(time.perf_counter() - window.started, 1e-9),
            lr=lr,
            checkpoint_step=self.manager.last_checkpoint,
            checkpoint_error=self.manager.checkpoint_error,
            trained_samples=run.sampler.trained,
            step_samples=run.rule.step_batch(self.world),
            partial=partial,
        )
        generation = self.manager.generation  # in place: the record's lineage (progress.whole_records)
        lineage = {"node": node_name(), **({} if generation is None else {"generation": generation})}
        if partial:  # every rank whose sums broke: rank 0 may be the one that is gone
            self._emit({"event": "progress", **asdict(record), "rank": self.rank, **lineage}, any_rank=True)
            return
        self._emit({"event": "progress", **asdict(record), **lineage})
        self._events.scalars(
            self.step, {key: getattr(record, key) for key in ("loss", "accuracy", "samples_per_s", "lr")}
        )

    def _evaluate(self, run: Run, *, epoch: int) -> bool:
        """Evaluate on the test set (sharded; the notices heeded at each batch), keep the result in the
        state and emit it. False where the group changed meanwhile: the loop decides again."""
        manager = self.manager
        accuracy = evaluate(
            run.model, len(run.test_set), rank=self.rank, world=self.world, device=self.device,  # type: ignore[arg-type]
            batch_size=self.config.eval_batch_size, load=partial(run.test_loader.epoch, 0),
            prepare=partial(model_inputs, device=self.device, precision=self.precision, normalize=run.normalize),
            between=manager.heed_notices, sums=manager.all_reduce, autocast=self.precision.autocast,
        )  # fmt: skip
        if accuracy is None:
            return False
        run.evaluated = (self.step, accuracy)
        manager.state_changed()
        self._emit({"event": "eval", "step": self.step, "epoch": epoch, "accuracy": accuracy})
        return True

    # -- set-up ---------------------------------------------------------------------

    def _setup(self) -> Run:
        """Process group (the restart path's), data, model, optimizer; then the first group and the resume,
        and TensorBoard where asked."""
        config = self.config
        self.setup_seconds["process"] = process_age()
        lap = stopwatch(self.setup_seconds)
        refusal = sync_bn_refusal(config.sync_bn, self.device) or decode_refusal(config.decode, self.device)
        if refusal:
            raise ValueError(refusal)
        # --decode gpu: the batch's JPEGs are decoded, cropped and resized on the GPU (loader.py); without
        # torchvision this stops here, before the group forms.
        decoder = DeviceDecoder(gpu_decoder(), self.device, config.image_size) if config.decode == "gpu" else None
        manager = self.manager
        if not manager.in_place:  # in place, the manager enters its first group once data and model are ready
            form_default_group(self.backend, self.device, config.collective_timeout)
            lap("group")
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        train_set, test_set, classes = load_datasets(config)
        if isinstance(train_set, SampleRandom):  # before the loader forks its workers, which keep it
            train_set.set_epoch(0, config.seed)
        lap("data")
        model = self.precision.prepare(build_model(config, classes, self.device))
        cuda = self.device.type == "cuda"
        run = build_run(
            config, model, (train_set, test_set), world=world, device=self.device, loader_workers=self.loader_workers,
            decoder=decoder, wrap=lambda module: DistributedDataParallel(
                manager, module, **({"device_ids": [self.local_rank]} if cuda and not manager.in_place else {})),
        )  # fmt: skip
        self._stepper = OptimizerWrapper(manager, run.optimizer)
        manager.add_position(run.sampler)
        lap("model")
        if manager.in_place and decoder is None:  # (with --decode gpu the data set holds encoded images)
            warm_up_run(run, rank=rank, world=world, device=self.device, precision=self.precision)
            lap("warm_up")
        self._run = run
        manager.current_step()  # the first group, and the resume: a joiner's state from a live peer
        lap("resume")
        self._emit({"event": "setup", "rank": self.rank, "node": node_name(), "pid": os.getpid(),
                    "setup_s": {k: round(v, 2) for k, v in self.setup_seconds.items()},
                    "loader_workers": self.loader_workers,
                    "nccl": {key: os.environ.get(key) for key in (NCCL_ERROR_HANDLING_ENV, NCCL_RETHROW_ENV)}},
                   any_rank=True)  # fmt: skip
        if config.tensorboard and self.rank == 0:
            self._events.open_tensorboard(config.tensorboard)
        return run

    # -- state ----------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """The loop's state (the manager keeps the step and the sampler's position beside it)."""
        run = self._whole()
        return {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "rng": rng_state(),
            "batch_rule": run.rule.state_dict(),
            "evaluated": {"step": run.evaluated[0], "accuracy": run.evaluated[1]},
            "grad_scaler": self.precision.state_dict(),
        }

    def _load(self, state: dict[str, Any]) -> None:
        """Take over a resumed or healed state (the manager has set the step and the sampler's position).
        The batch and learning-rate rule it recorded wins over the flags: it is what makes the resumed run
        the same run (a changed flag is reported). The learning rate is set for the step to come: a heal's
        receiver applies that step's update right after this."""
        run = self._whole()
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        self.precision.load_state_dict(state.get("grad_scaler") or {})
        run.rule, ignored = run.rule.resumed(state.get("batch_rule"))
        if ignored:
            self._emit({"event": "settings_from_checkpoint",
                        "kept": {key: recorded for key, (_, recorded) in ignored.items()},
                        "ignored_flags": {key: flag for key, (flag, _) in ignored.items()}})  # fmt: skip
        run.sampler.global_batch, run.sampler.batch_size = run.rule.global_batch_size, run.rule.batch_size
        evaluated = state.get("evaluated", {"step": self.step, "accuracy": math.nan})
        run.evaluated = (int(evaluated["step"]), float(evaluated["accuracy"]))
        self._set_learning_rate(run)

    def _whole(self) -> Run:
        if self._run is None:
            raise RuntimeError("the run is not built yet")
        return self._run

    # -- output and exit ------------------------------------------------------------

    def _emit(self, record: dict[str, Any], *, any_rank: bool = False) -> None:
        """One record (events.py): rank 0's, or any rank's with `any_rank` (an event only that rank sees)."""
        if self.rank == 0 or any_rank:
            self._events.write(record)

    def _leave(self, why: str) -> NoReturn:
        """Leave by the restart path (`Manager.leave`): this node's snapshot kept, then exit."""
        self.manager.leave(why)

    def _shutdown(self) -> None:
        if self._run is not None:
            self._run.train_loader.close()
            self._run.test_loader.close()
        self._events.close()
        if dist.is_initialized():
            dist.destroy_process_group()
