"""The training program with two hooks a test turns on through the environment; nothing
else about the trainer changes, and neither hook changes what it computes.

- STEP_PACE (seconds): each optimizer step takes at least this long, the wait taken
  before the step begins (the state is whole then). Steps at one node take 40 ms here,
  a joining node 10-20 s: paced, a run lasts long enough for a test's schedule of
  failures and joins to happen inside it.
- NOTICE_AT_SAMPLE and NOTICE_MARK: when the test set's sample NOTICE_AT_SAMPLE is loaded
  (by the rank whose share holds it), write the node's name to NOTICE_MARK and wait (60 s
  at most) for the SIGTERM the test then sends the node's agent, as the kubelet does on
  eviction: a notice that arrives in the middle of an evaluation at a point the test
  chooses, instead of one raced against a clock. Only the first evaluation is held: the
  mark stays, and later ones pass.
- HOLD_REQUEST and HOLD_MARK: once HOLD_REQUEST (a file) names this node, its worker holds at its
  next step after the step's update, before its progress record: it writes the step and its rank
  to HOLD_MARK and waits (60 s at most) for the test to kill the node. The others wait in the record's
  sums over the group (the restart path: the step is applied everywhere, its record can only be a
  survivor's share) or, in place, where those sums came with the gradients, in the next step's
  all-reduce; so the loss lands at a step the test knows, instead of wherever a kill happens to fall.
- EMERGENCY_SAVE_DELAY (seconds): a synchronous save on a node that leaves (the emergency
  checkpoint of its notice) starts this much later, as a large model's would take longer:
  whether the other nodes wait for it shows. The run's final save is not delayed.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from torch.utils.data import Dataset

from torchspot_trainer import train
from torchspot_trainer.__main__ import main
from torchspot_trainer.checkpoint.manager import CheckpointManager
from torchspot_trainer.data import datasets
from torchspot_trainer.data.datasets import TensorImages, load_digits
from torchspot_trainer.markers import node_leaving


class NoticeAt(Dataset[Any]):
    """`inner`, holding at sample `index` until this process gets SIGTERM (see the module)."""

    def __init__(self, inner: TensorImages, index: int, mark: Path) -> None:
        self.inner, self.index, self.mark = inner, index, mark

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if index == self.index and not self.mark.exists():
            got: list[int] = []
            previous = signal.getsignal(signal.SIGTERM)

            def chained(signum: int, frame: FrameType | None) -> None:
                got.append(signum)
                if callable(previous):
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, chained)
            self.mark.write_text(os.environ.get("TORCHSPOT_NODE", "?"))
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)  # interrupted by the signal, whose handler fills `got`
        return self.inner[index]


def _digits(test_fraction: float = 0.25, seed: int = 0) -> tuple[TensorImages, Dataset[Any]]:
    train_set, test_set = load_digits(test_fraction, seed)
    return train_set, NoticeAt(test_set, int(os.environ["NOTICE_AT_SAMPLE"]), Path(os.environ["NOTICE_MARK"]))


def _paced(step: Callable[..., Any], pace: float) -> Callable[..., Any]:
    """`step`, started no sooner than `pace` seconds after the previous one started."""
    last = [0.0]

    @functools.wraps(step)
    def paced(*args: Any, **kwargs: Any) -> Any:
        wait = last[0] + pace - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # pacing the workload, not waiting for a condition
        last[0] = time.monotonic()
        return step(*args, **kwargs)

    return paced


def _held_before_sums(log_progress: Callable[..., None], request: Path, mark: Path) -> Callable[..., None]:
    """`Trainer._log_progress` (the record, its sums over the group first unless they came with the
    gradients), held on the node HOLD_REQUEST names (see the module docstring)."""

    @functools.wraps(log_progress)
    def held(trainer: Any, *args: Any, **kwargs: Any) -> None:
        node = os.environ.get("TORCHSPOT_NODE", "?")
        if not mark.exists() and request.exists() and request.read_text().strip() == node:
            mark.write_text(f"{trainer.step} {trainer.rank}")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.05)  # held until the test's SIGKILL ends this process
        log_progress(trainer, *args, **kwargs)

    return held


def _delayed(save_sync: Callable[..., Any], delay: float) -> Callable[..., Any]:
    """`save_sync`, started `delay` seconds late on a node that leaves."""

    @functools.wraps(save_sync)
    def delayed(*args: Any, **kwargs: Any) -> Any:
        if node_leaving():
            time.sleep(delay)  # standing in for a longer upload, not waiting for a condition
        return save_sync(*args, **kwargs)

    return delayed


if __name__ == "__main__":
    if "NOTICE_AT_SAMPLE" in os.environ:
        datasets.load_digits = _digits  # type: ignore[assignment]  # where DATA_SETS["digits"] reads it
    if "STEP_PACE" in os.environ:
        train.train_step = _paced(train.train_step, float(os.environ["STEP_PACE"]))  # type: ignore[attr-defined]
    if "HOLD_REQUEST" in os.environ:
        hold = _held_before_sums(
            train.Trainer._log_progress, Path(os.environ["HOLD_REQUEST"]), Path(os.environ["HOLD_MARK"])
        )
        train.Trainer._log_progress = hold  # type: ignore[method-assign]
    if "EMERGENCY_SAVE_DELAY" in os.environ:
        manager = CheckpointManager
        manager.save_sync = _delayed(manager.save_sync, float(os.environ["EMERGENCY_SAVE_DELAY"]))  # type: ignore[method-assign]
    sys.exit(main())
