"""Atomic, asynchronous checkpoints on any `CheckpointStorage`.

Layout under the checkpoint root::

    step-0000001200/state-<id>.pt   torch.save of the whole training state (<id>: one per save)
    step-0000001200/COMMIT          JSON: step, metadata, and each object's name, size and sha256
    latest.json                     JSON: the newest committed step and its URI (for the operator)

Why this shape:
- A checkpoint counts only once its COMMIT marker exists, written after every object it lists: a reader
  that races a writer, or finds a dead upload's remains, sees no marker and takes an older step.
- The marker carries checksums: a truncated or corrupted object is skipped with a warning, never loaded.
- `save_async` copies the state to host memory at a step boundary (the only stall) and serializes and
  uploads it in the background, in a saver process where the storage can be reopened there (saver.py),
  else on a thread. A new save waits for the previous one; while storage is failing, a save that finds
  one in flight is skipped and reported instead, so a Blob outage never stalls training.
- Failed uploads are retried with backoff; when all fail the error is reported and training goes on.
  Older committed checkpoints are deleted only after a newer one committed.
- Two writers may share a prefix (an emergency save beside rank 0's saver, an old rank 0's saver after a
  re-form). Each save's object has a name of its own and COMMIT is written only where none exists, so a
  step's COMMIT names the object it checks; `latest.json` moves forwards only, by a conditional write;
  pruning leaves every step from the oldest kept committed one on, where a partial step may be in flight.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

import torch

from torchspot_trainer.checkpoint.saver import RetryHook, SaverProcess, map_nested
from torchspot_trainer.checkpoint.storage import CheckpointStorage, ObjectNotFoundError, StorageError

log = logging.getLogger(__name__)

COMMIT_OBJECT = "COMMIT"
LATEST_OBJECT = "latest.json"
FORMAT_VERSION = 1
GIVE_UP_CHECK_SECONDS = 0.1
"""How often a save waiting for the previous one checks its `give_up` (a notice): a tenth of a
second is nothing next to the SIGTERM watcher's seconds, and costs nothing while it waits."""


LATEST_ATTEMPTS = 5
"""Conditional writes of `latest.json` in a row that may lose to another writer's before a save gives up
moving it (its step is committed all the same)."""


def state_object() -> str:
    """A new save's state object name: its own, so two writers of one step never share an object."""
    return f"state-{uuid.uuid4().hex[:12]}.pt"


def step_dir(step: int) -> str:
    """The folder of one checkpoint; zero-padded so names sort by step."""
    return f"step-{step:010d}/"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint's folder (`step_dir`), from a name under it or the folder's own; None for
    anything else."""
    head = name.split("/", 1)[0]
    if head.startswith("step-") and head[5:].isdigit():
        return int(head[5:])
    return None


def committed_steps(names: Iterable[str]) -> list[int]:
    """The steps, oldest first, whose COMMIT marker is among an object listing `names` (pure)."""
    return sorted({s for n in names if n.endswith("/" + COMMIT_OBJECT) and (s := parse_step(n)) is not None})


def snapshot(obj: Any) -> Any:
    """Copy a nested state (dicts, lists, tuples, tensors) to host memory.

    Tensors are cloned (GPU tensors copied to CPU), so training may modify the
    originals while the copy is serialized and uploaded.
    """
    return map_nested(obj, lambda leaf: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else leaf)


CHECKPOINT_RETRIES = 5
"""Attempts per save before it is reported failed, by default (the trainer's --checkpoint-retries)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """How often and how durably to checkpoint."""

    keep: int = 3
    """Committed checkpoints to keep; older ones are deleted after a new one commits."""
    retries: int = CHECKPOINT_RETRIES
    """Attempts per save before it is reported failed (training goes on)."""
    backoff: float = 1.0
    """Seconds before the first retry; doubles each time, capped at `max_backoff`."""
    max_backoff: float = 30.0
    """Longest wait between two attempts."""

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"--keep-checkpoints {self.keep}: keep at least 1 checkpoint")
        if self.retries < 1:
            raise ValueError(f"--checkpoint-retries {self.retries}: must be at least 1")
        if self.backoff < 0 or self.max_backoff < self.backoff:
            raise ValueError("checkpoint backoff must be >= 0 and <= max_backoff")


@dataclass
class SaveReport:
    """The outcome of one save."""

    step: int
    ok: bool
    seconds: float
    nbytes: int = 0
    attempts: int = 0
    error: str | None = None
    saver: str = ""
    """Where it was serialized and uploaded: SAVER_PROCESS (saver.py's child), SAVER_THREAD (a thread
    of the training process, which takes the step's GIL: saver.py says why that is the fallback), or
    SAVER_CALLER (`save_sync`'s, on the caller's thread: the emergency checkpoint); empty for a save
    skipped before it began."""


SAVER_PROCESS, SAVER_THREAD, SAVER_CALLER = "process", "thread", "caller"
"""`SaveReport.saver`'s values."""


@dataclass
class Loaded:
    """A checkpoint read back: its step, the state, and its metadata."""

    step: int
    state: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)


class CheckpointWriter:
    """Serializes one state, uploads it, commits it and prunes old ones: the one path of every save.

    It runs on the trainer's thread (emergency checkpoints), on the manager's
    background thread, or in the saver process; the outcome is the same.
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        config: CheckpointConfig,
        sleep: Callable[[float], None] = time.sleep,
        on_retry: RetryHook | None = None,
    ) -> None:
        self.storage = storage
        self.config = config
        self._sleep = sleep
        self._on_retry = on_retry

    def __call__(self, step: int, state: Any, meta: dict[str, Any]) -> SaveReport:
        """Write `state` as checkpoint `step`; retry with backoff; never raise a storage error.

        `latest.json` is moved only forwards: a periodic save retried past a newer emergency save
        (or a saver process finishing late) commits its step but leaves the newer record, which the
        operator and a restarted job read."""
        started = time.perf_counter()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        name = state_object()
        commit = {
            "format": FORMAT_VERSION,
            "step": step,
            "saved_at": datetime.now(UTC).isoformat(),
            "meta": meta,
            "objects": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
        }
        folder = step_dir(step)
        latest = {
            "step": step,
            "path": folder,
            "uri": f"{self.storage.describe().rstrip('/')}/{folder}",
            "saved_at": commit["saved_at"],
        }
        delay = self.config.backoff
        error = ""
        for attempt in range(1, self.config.retries + 1):
            try:
                self.storage.put(folder + name, data)
                if not self.storage.put_new(folder + COMMIT_OBJECT, json.dumps(commit).encode()):
                    self._lost_commit(step, folder, name)
                advance_latest(self.storage, latest)
            except StorageError as exc:
                error = str(exc)
                log.warning(
                    "checkpoint step %d: attempt %d/%d failed: %s",
                    step,
                    attempt,
                    self.config.retries,
                    error,
                )
                if attempt < self.config.retries:
                    if self._on_retry is not None:
                        self._on_retry(step, error)
                    self._sleep(delay)
                    delay = min(max(delay * 2, 0.1), self.config.max_backoff)
                continue
            self._prune()
            return SaveReport(step, True, time.perf_counter() - started, len(data), attempt)
        return SaveReport(step, False, time.perf_counter() - started, len(data), self.config.retries, error)

    def _lost_commit(self, step: int, folder: str, name: str) -> None:
        """Another writer committed `step` first (or this save's own earlier attempt did): its COMMIT
        stands, naming its own object. This save's object is then nobody's, unless that COMMIT is
        ours."""
        try:
            theirs = json.loads(self.storage.get(folder + COMMIT_OBJECT)).get("objects", {})
        except (ObjectNotFoundError, ValueError):
            theirs = {}
        if name not in theirs:
            log.warning("checkpoint step %d: another writer committed it first; its checkpoint stands", step)
            self.storage.delete_prefix(folder + name)

    def _prune(self) -> None:
        """Keep the newest `keep` committed checkpoints; drop every step older than the oldest of them,
        stale partials included. A partial step from the oldest kept one on stays: it may be another
        writer's upload still in flight, whose COMMIT would then name nothing."""
        try:
            names = self.storage.list("step-")
        except StorageError as exc:
            log.warning("checkpoint pruning skipped: %s", exc)
            return
        committed = committed_steps(names)
        if not committed:
            return
        oldest_kept = committed[-self.config.keep :][0]
        for step in sorted({s for n in names if (s := parse_step(n)) is not None}):
            if step >= oldest_kept:
                continue
            try:
                self.storage.delete_prefix(step_dir(step))
            except StorageError as exc:
                log.warning("could not delete old checkpoint %s: %s", step_dir(step), exc)


def open_writer(
    reopen: Callable[[], CheckpointStorage], config: CheckpointConfig, on_retry: RetryHook
) -> Callable[[int, Any, dict[str, Any]], SaveReport]:
    """A writer on storage opened anew (in the saver process, which cannot share the parent's clients),
    its reports saying so (`SaveReport.saver`)."""
    writer = CheckpointWriter(reopen(), config, on_retry=on_retry)
    return lambda step, state, meta: replace(writer(step, state, meta), saver=SAVER_PROCESS)


class CheckpointManager:
    """Saves and loads checkpoints on one storage. Only one process should save.

    :param storage: where checkpoints live.
    :param config: retention and retry settings.
    :param on_report: called (on a background thread for asynchronous saves) with
        every save's outcome.
    :param reopen: a picklable callable that opens this same storage. With it,
        asynchronous saves are serialized and uploaded in a child process (see
        `saver.py`: it keeps a CPU-bound training step's GIL and cores free); without
        it, on a background thread of this process.
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        config: CheckpointConfig | None = None,
        *,
        on_report: Callable[[SaveReport], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        reopen: Callable[[], CheckpointStorage] | None = None,
    ) -> None:
        self.storage = storage
        self.config = config or CheckpointConfig()
        self._writer = CheckpointWriter(storage, self.config, sleep, on_retry=self._retrying)
        self._on_report = on_report
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._saver = self._new_saver(reopen) if reopen else None
        self._saver_later: Callable[[], CheckpointStorage] | None = None
        """The storage's `reopen` for a saver process started at the next save (`save_in_child`)."""
        self._pending: Future[SaveReport] | None = None
        self._pending_step = -1
        self._pending_in_child = False
        """Whether the save in flight went to a saver process (whose death fails its future)."""
        self._pending_retrying = False
        self._lock = threading.Lock()
        self.last_committed: int | None = None
        self.last_error: str | None = None

    def _new_saver(self, reopen: Callable[[], CheckpointStorage]) -> SaverProcess:
        return SaverProcess(partial(open_writer, reopen, self.config), self._done, self._retrying)

    def save_in_child(self, reopen: Callable[[], CheckpointStorage]) -> None:
        """Save in a saver process from the next save on, where saves run on a thread (a manager made
        without `reopen`). For a process that becomes the saving one after its manager was made: in place,
        a rank 0 whose predecessor was lost, which otherwise saved on a thread for the rest of the run,
        its CPU-bound steps slowed by every save (saver.py says why). Started at that save rather than
        now, so a re-form does not wait for it (forked from the warm server it takes milliseconds, as
        a new interpreter seconds). A saver that runs is kept; after one died, this starts another."""
        with self._lock:
            if self._saver is None:
                self._saver_later = reopen

    def save_on_thread(self) -> None:
        """Stop the saver process, if one runs, and save on a thread from now on: for a process that is no
        longer the saving one (in place, a rank 0 that became another rank where a joiner's address sorts
        first), so its idle child and the shared buffer the size of the state are not kept for the rest
        of the run. The child stops in the background once a save in flight is done (`SaverProcess.close`):
        the caller's training does not wait for it."""
        with self._lock:
            saver, self._saver, self._saver_later = self._saver, None, None
        if saver is not None:
            threading.Thread(target=saver.close, name="torchspot-saver-stop", daemon=True).start()

    @property
    def saver_pid(self) -> int | None:
        """The saver process's id while one runs (None: saves run on a thread of this process)."""
        return self._saver.pid if self._saver is not None and self._saver.alive else None

    @property
    def in_flight(self) -> int | None:
        """The step of the save still running, if any."""
        with self._lock:
            running = self._pending is not None and not self._pending.done()
            return self._pending_step if running else None

    # -- saving ---------------------------------------------------------------------

    def save_async(
        self,
        step: int,
        state: Mapping[str, Any],
        meta: Mapping[str, Any],
        *,
        give_up: Callable[[], bool] = lambda: False,
    ) -> float:
        """Snapshot `state` and upload it in the background; return the stall in seconds.

        The stall is the time spent waiting for the previous save plus the copy to
        host (shared) memory; serialization and upload happen in the background.
        When storage is known to be failing (the save in flight is retrying, or the
        last save failed) and a save is still in flight, this one is skipped and
        reported rather than waited for: a stalled training loop would turn an outage
        of the checkpoint store into lost training.

        :param give_up: checked before and while waiting for the previous save; once true, this
            save is skipped (logged, not reported as a failure). The trainer passes its eviction
            notice: the next step boundary writes the emergency checkpoint, which supersedes this
            one, and a loop kept waiting here past the SIGTERM watcher's limit would be ended as
            stuck, without any checkpoint (a loaded CI run's suspension lost its emergency
            checkpoint, most likely that way).
        """
        started = time.perf_counter()
        if give_up():
            log.info("checkpoint step %d skipped: a notice came first", step)
            return time.perf_counter() - started
        with self._lock:
            in_flight = self._pending is not None and not self._pending.done()
            failing = self._pending_retrying or self.last_error is not None
            previous = self._pending_step
        if in_flight and failing:
            reason = f"skipped: storage is failing and step {previous} is still saving"
            log.warning("checkpoint step %d %s", step, reason)
            if self._on_report is not None:
                self._on_report(SaveReport(step, False, 0.0, error=reason))
            return time.perf_counter() - started
        while self.wait(GIVE_UP_CHECK_SECONDS) is None and self.in_flight is not None:
            if give_up():
                log.info("checkpoint step %d skipped: a notice came while step %d was saving", step, previous)
                return time.perf_counter() - started
        with self._lock:
            if self._saver is None and self._saver_later is not None:
                reopen, self._saver_later = self._saver_later, None
                try:
                    self._saver = self._new_saver(reopen)
                except OSError as exc:  # (out of processes or memory): the thread still saves
                    log.warning("checkpoint saver process did not start (%s); saving on a thread", exc)
            if self._saver is not None and not self._saver.alive:
                log.warning("checkpoint saver process is gone; saving on a thread from now on")
                self._saver.close()
                self._saver = None
            self._pending_step = step
            self._pending_retrying = False
            self._pending_in_child = self._saver is not None
            if self._saver is not None:
                try:
                    self._pending = self._saver.submit(step, state, dict(meta))
                except (OSError, ValueError) as exc:  # it died between the check and the hand-over
                    log.warning("checkpoint saver process is gone (%s); saving on a thread from now on", exc)
                    self._saver.close()
                    self._saver = None
                    self._pending_in_child = False
            if self._saver is None:
                self._pending = self._executor.submit(self._save, step, snapshot(state), dict(meta), SAVER_THREAD)
        return time.perf_counter() - started

    def save_sync(self, step: int, state: Mapping[str, Any], meta: Mapping[str, Any]) -> SaveReport:
        """Save now, on this thread, and return when committed (or failed): for evictions."""
        self.wait()
        return self._save(step, snapshot(state), dict(meta), SAVER_CALLER)

    def wait(self, timeout: float | None = None) -> SaveReport | None:
        """Block until the save in flight (if any) finished; return its outcome.

        With a `timeout`, give up after that many seconds and return None, the save
        still in flight (a worker that must leave gives its last save a bounded chance).
        A saver process that died mid-save yields a failed report, not an exception.
        """
        with self._lock:
            pending = self._pending
        if pending is None:
            return None
        try:
            result: SaveReport = pending.result(timeout)
        except TimeoutError:
            return None
        except RuntimeError as exc:
            if not self._pending_in_child:
                raise
            report = SaveReport(self._pending_step, False, 0.0, error=str(exc), saver=SAVER_PROCESS)
            self._done(report)
            return report
        finally:
            with self._lock:
                if pending.done() and self._pending is pending:
                    self._pending = None
        return result

    def close(self) -> None:
        """Finish the save in flight and stop the background thread and saver process."""
        self.wait()
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        self._executor.shutdown(wait=True)

    def _save(self, step: int, state: Any, meta: dict[str, Any], where: str) -> SaveReport:
        report = replace(self._writer(step, state, meta), saver=where)
        self._done(report)
        return report

    def _retrying(self, step: int, error: str) -> None:
        """An attempt of the save in flight failed and will be retried: say so on the progress line."""
        with self._lock:
            self._pending_retrying = True
        self.last_error = f"step {step}: {error} (retrying)"

    def _done(self, report: SaveReport) -> None:
        """Record a save's outcome (for the progress line) and pass it on."""
        if report.ok:
            self.last_committed = report.step
            self.last_error = None
        else:
            self.last_error = f"step {report.step}: {report.error}"
        if self._on_report is not None:
            self._on_report(report)

    # -- loading --------------------------------------------------------------------

    def load_latest(self) -> Loaded | None:
        """The newest committed checkpoint whose objects match their checksums, or None.

        Partial (no COMMIT) and corrupt steps are skipped with a warning naming them.
        """
        names = self.storage.list("step-")
        steps = sorted({s for n in names if (s := parse_step(n)) is not None}, reverse=True)
        for step in steps:
            folder = step_dir(step)
            if folder + COMMIT_OBJECT not in names:
                log.warning("skipping checkpoint %s: no commit marker (partial upload)", folder)
                continue
            loaded = self._read(step, folder)
            if loaded is not None:
                return loaded
        return None

    def latest_step(self) -> int | None:
        """The newest step with a commit marker, from one listing (not read or verified)."""
        steps = committed_steps(self.storage.list("step-"))
        return steps[-1] if steps else None

    def load_step(self, step: int) -> Loaded | None:
        """One specific committed checkpoint (None if missing or corrupt)."""
        return self._read(step, step_dir(step))

    def _read(self, step: int, folder: str) -> Loaded | None:
        try:
            commit = json.loads(self.storage.get(folder + COMMIT_OBJECT))
            ((name, expected),) = commit["objects"].items()  # the one state object the COMMIT names
            data = self.storage.get(folder + name)
        except (ObjectNotFoundError, KeyError, ValueError, TypeError, AttributeError) as exc:
            log.warning("skipping checkpoint %s: unreadable commit or object (%s)", folder, exc)
            return None
        if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            log.warning("skipping checkpoint %s: %s does not match its checksum (corrupt)", folder, name)
            return None
        try:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            log.warning("skipping checkpoint %s: cannot deserialize (%s)", folder, exc)
            return None
        return Loaded(step, state, dict(commit.get("meta", {})))


def advance_latest(storage: CheckpointStorage, record: dict[str, Any]) -> bool:
    """Write `record` as `latest.json` unless it holds a newer step, by a write conditional on the
    version read: a slower writer cannot move it backwards between its read and its write. Whether it
    wrote it; past LATEST_ATTEMPTS lost races it leaves it (its step is committed all the same)."""
    data = json.dumps(record).encode()
    for _ in range(LATEST_ATTEMPTS):
        found = storage.read_versioned(LATEST_OBJECT)
        if found is not None:
            try:
                newer = int(json.loads(found[0]).get("step", -1))
            except (ValueError, TypeError, AttributeError):  # unreadable: written over
                newer = -1
            if newer > record["step"]:  # never backwards (a periodic save retried past an emergency one)
                return False
        if storage.put_if(LATEST_OBJECT, data, None if found is None else found[1]):
            return True
    log.warning(
        "latest.json not moved to step %d: it changed under %d writes in a row", record["step"], LATEST_ATTEMPTS
    )
    return False


def read_latest(storage: CheckpointStorage) -> dict[str, Any] | None:
    """The `latest.json` record (newest committed step), or None if there is none yet."""
    try:
        record: dict[str, Any] = json.loads(storage.get(LATEST_OBJECT))
    except (ObjectNotFoundError, ValueError):
        return None
    return record
