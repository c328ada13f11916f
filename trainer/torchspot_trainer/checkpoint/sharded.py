"""A run's sharded checkpoints: every rank saves its own shards of the state (FSDP2's DTensors) through torch's
distributed checkpoint, and a resume at any world size loads the newest committed one as its world shards
the state (DCP reshards from the metadata).

- **One folder per step** under the run's URI (`step_dir`, as the replicated checkpoints: names sort by
  step), on Azure Blob (`az://container/prefix`, dcp.py's writer and reader, today's credentials) or in a
  local folder (a path or file://, read as storage.py reads `--checkpoint-uri`; torch's own file system
  writer, whose metadata is written under a temporary name and renamed).
- **Committed when its metadata is written**, last: a folder without it (a save that stopped) is never
  loaded, and a resume says so and takes the newest one that has it.
- **Saved beside training** (dcp.AsyncSaver): the copy to host memory runs on a thread into one buffer per
  rank, kept from save to save, and the upload on another. The loop waits only before its next update,
  until the copy is done (`staged`): a rank holds at most one extra copy of its shards.
- **The same step on every rank.** Every rank calls `save_async` at the same step and `load_latest` at its
  start: both are collectives of DCP over the group.
- **Retention**: after a save commits, the newest `keep` committed checkpoints stay, older ones go.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from torchspot_trainer.checkpoint import dcp
from torchspot_trainer.checkpoint.manager import SAVER_CALLER, SAVER_THREAD, SaveReport, parse_step, step_dir
from torchspot_trainer.checkpoint.storage import local_path

__all__ = ["ShardedCheckpoints"]

log = logging.getLogger(__name__)


class ShardedCheckpoints:
    """The sharded checkpoints of one run under `uri` (module docstring).

    :param uri: `az://container/prefix`, or a local folder (a path or file://), as `--checkpoint-uri`.
    :param keep: committed checkpoints kept; older ones are deleted after a save commits.
    :param env: where Blob's account and credentials come from (storage.py; default os.environ).
    :param process_group: the group DCP coordinates over (default: torch's default group). Give one used for
        nothing else where the loop runs collectives while a save uploads (dcp.AsyncSaver says why).
    :param on_report: told each save's outcome (rank 0's, on every rank: the same step committed everywhere).
    """

    def __init__(
        self,
        uri: str,
        *,
        keep: int = 3,
        env: Mapping[str, str] | None = None,
        process_group: dist.ProcessGroup | None = None,
        on_report: Callable[[SaveReport], None] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
        self._local = local_path(uri)
        """The folder of a local run's checkpoints; None on Blob."""
        self.uri, self.keep = uri.rstrip("/") if self._local is None else str(self._local), keep
        self._env, self._group, self._on_report = env, process_group, on_report
        self._saver = dcp.AsyncSaver(env=env, process_group=process_group)
        self._in_flight: tuple[int, float] | None = None
        self.last_committed: int | None = None
        self.last_error: str | None = None

    def use_group(self, group: dist.ProcessGroup) -> None:
        """Coordinate every save and load from now on over `group` (`process_group` above)."""
        self._group = self._saver.process_group = group

    # -- saving ---------------------------------------------------------------------

    @property
    def in_flight(self) -> int | None:
        """The step of the save uploading, if any."""
        return None if self._in_flight is None else self._in_flight[0]

    def save_async(self, step: int, state: dict[str, Any]) -> None:
        """Begin saving `state` as step `step`'s checkpoint, beside training (every rank, at the same step);
        the previous save waited for first. Call `staged()` before the state next changes."""
        self.wait()
        self._saver.save(state, self._step_uri(step))
        self._in_flight = (step, time.monotonic())

    def staged(self) -> None:
        """Wait until the save in flight has its copy of the state: from then on the state may change."""
        self._saver.staged()

    def save_sync(self, step: int, state: dict[str, Any]) -> SaveReport:
        """Save `state` as step `step`'s checkpoint now and return when it committed or failed (the final
        checkpoint, an emergency one)."""
        self.wait()
        started = time.monotonic()
        try:
            dcp_save(
                state, storage_writer=dcp.storage_writer(self._step_uri(step), env=self._env), process_group=self._group
            )
        except Exception as exc:  # (DCP's CheckpointException carries each rank's: reported, not raised)
            return self._done(SaveReport(step, False, time.monotonic() - started, error=str(exc), saver=SAVER_CALLER))
        return self._done(SaveReport(step, True, time.monotonic() - started, saver=SAVER_CALLER))

    def wait(self, timeout: float | None = None) -> SaveReport | None:
        """Wait for the save in flight, if any; its outcome (None where it is still uploading after `timeout`)."""
        if self._in_flight is None:
            return None
        step, started = self._in_flight
        try:
            self._saver.wait(timeout)
        except TimeoutError:
            return None
        except Exception as exc:  # the upload's error, reported as a failed save (training goes on)
            self._in_flight = None
            return self._done(SaveReport(step, False, time.monotonic() - started, error=str(exc), saver=SAVER_THREAD))
        self._in_flight = None
        return self._done(SaveReport(step, True, time.monotonic() - started, saver=SAVER_THREAD))

    def close(self) -> None:
        """Wait for the save in flight; free the host buffer."""
        self.wait()
        self._saver.close()

    def _done(self, report: SaveReport) -> SaveReport:
        if report.ok:
            self.last_committed, self.last_error = report.step, None
            if dist.get_rank(self._group) == 0:
                try:
                    self._prune()
                except Exception as exc:  # (storage's errors: the next commit prunes again; training goes on)
                    log.warning("old sharded checkpoints under %s not deleted: %s", self.uri, exc)
        else:
            self.last_error = f"step {report.step}: {report.error}"
            log.warning("sharded checkpoint of step %d failed: %s", report.step, report.error)
        if self._on_report is not None:
            self._on_report(report)
        return report

    # -- loading --------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest committed checkpoint's step, or None (one listing of the folders, on the calling rank)."""
        steps = [step for step, done in self._folders().items() if done]
        return steps[-1] if steps else None

    def load_latest(self, state: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
        """The newest committed checkpoint's step and state, loaded into the one `state()` builds (this
        world's shards of it, in place: DCP reshards); None where there is none. `state()` is called only
        where there is one: torch's `get_state_dict` gives an optimizer with no state yet a step of zeros
        (Adam's step count then starts at 1), which a fresh run must not take. A newer folder without
        metadata (a save that stopped) is said in one line and passed over. Every rank calls it."""
        found = self._folders()
        steps = [step for step, done in found.items() if done]
        if not steps:
            return None
        step = steps[-1]
        torn = [newer for newer, done in found.items() if not done and newer > step]
        if torn and dist.get_rank(self._group) == 0:
            log.warning("sharded checkpoints of steps %s have no metadata (their saves stopped before they "
                        "committed): not loaded; resuming from step %d", torn, step)  # fmt: skip
        uri, loaded = self._step_uri(step), state()
        if self._local is None:
            dcp.load(loaded, uri, env=self._env, process_group=self._group)
        else:
            dcp_load(loaded, storage_reader=FileSystemReader(uri), process_group=self._group)
        self.last_committed = step
        return step, loaded

    # -- the folders ----------------------------------------------------------------

    def _step_uri(self, step: int) -> str:
        return f"{self.uri}/{step_dir(step).rstrip('/')}"

    def _folders(self) -> dict[int, bool]:
        """Every checkpoint folder's step, oldest first, and whether it committed (its metadata written)."""
        if self._local is None:
            listed = dcp.folders(self.uri, env=self._env)
        else:
            root = self._local
            paths = [path for path in root.iterdir() if path.is_dir()] if root.is_dir() else []
            listed = {path.name: (path / dcp.METADATA).is_file() for path in paths}
        steps = {step: done for name, done in listed.items() if (step := parse_step(name)) is not None}
        return dict(sorted(steps.items()))

    def _prune(self) -> None:
        """Delete the committed checkpoints older than the newest `keep` (and, on Blob, older torn ones)."""
        if self._local is None:
            dcp.prune(self.uri, keep=self.keep, env=self._env)
            return
        for step in [step for step, done in self._folders().items() if done][: -self.keep]:
            folder = self._local / step_dir(step)
            os.remove(folder / dcp.METADATA)  # first: a reader never meets a committed one with shards missing
            shutil.rmtree(folder)
