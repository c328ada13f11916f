"""The agent's hand-over of a new round to its live workers: the agent stays the membership authority, but
at a change it tells its running workers their new rank and store instead of stopping them; they rebuild
their process group (recovery/live.py) and go on.

Only workers that registered are handed a round: any other program's workers are restarted as torchrun's
are, with no wait. The exchange is files in the agent's own folder, beside its peer-lost marker
(markers.py), so the variable that names that marker names them too:

- `assignment.json`: written atomically after every rendezvous, before any worker starts or is told:
  the round (`generation`), the world, the round's store (its rank-0 agent's), each local worker's rank;
- `live-<local rank>`: a worker able to re-form in place writes its process id there at start (a stale
  file names another process and does not count);
- `ack-<local rank>`: the generation the worker's watcher thread saw, written at once, before the worker
  re-forms: "alive and on it", not "done";
- `failed-<local rank>`: one of the worker's collectives failed (a peer is likely gone). A live worker
  does not exit, so this tells its agent what an exit would: liveness's judge then uses its short timeout;
- `agreed-<local rank>`: a worker whose node leaves on notice has shared the notice with its group; its
  agent takes the node out then (`notice_agreed`), so the others re-form while the emergency checkpoint
  is written rather than after it;
- `stepped-<local rank>`: the generation of the worker's last completed step, the file's time that
  step's, moved ahead by the step before's duration: every member took part in it and is busy with the
  next, so the liveness judge counts it as a receipt from each until then (`last_step`);
- `standby-<local rank>`: the worker's process id while it stands by for its replica group to be whole (a
  sharded run's copy over several nodes: elastic/sharding.py). Where all of a node's workers stand by and
  the run has finished on the other nodes, its agent stops them and finishes too (`_finished_elsewhere`).

A worker that does not acknowledge within `ACK_SECONDS` (frozen, or holding the GIL) is restarted with
its node's others in a round after this one, which the other nodes' live workers re-form into in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch.distributed import DistStoreError
from torch.distributed.elastic.agent.server.api import (
    _TERMINAL_STATE_SYNC_ID,
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.utils.store import _NUM_MEMBERS

from torchspot_trainer import NODE_FAULT_EXIT, REPLICA_GROUP_ENV, REPLICA_GROUP_SIZE_ENV
from torchspot_trainer.activity import Activity
from torchspot_trainer.markers import PEER_LOST_ENV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    """What the agent hands a live worker at a membership change (one per round)."""

    generation: int
    """The rendezvous round: every group and store key of the round is named by it."""
    rank: int
    world: int
    store_host: str
    store_port: int
    """The round's store, started by its rank-0 agent before the round was published."""
    node: int = 0
    """The agent's place in the round (torchrun's GROUP_RANK): which ranks share a node."""
    grows: bool = False
    """The round follows the one before directly and keeps every member of it (its agent knows; the
    sizes alone cannot tell a pure growth from a round that lost a member and gained two): only such a
    round may be entered as a deferred join (live.py's `offer`)."""
    column: int = -1
    """A sharded run's column (`column_of`, `group_column_of`): this worker's place in its copy of the state
    (the local rank where a node holds one copy), whose workers, one per copy, form this worker's group; -1
    (the agent's assignments): the group is every worker of the round."""
    groups: tuple[str, ...] = ()
    """Every node's replica group by its place in the round, where the job's replica groups span nodes (the
    agents trade them as they set the round up: `InPlaceAgent`); empty otherwise."""


def column_of(assignment: Assignment, local_rank: int, per_node: int) -> Assignment:
    """`assignment` as its worker's column sees it (pure): in a sharded run each node holds one copy of the
    state, sharded over its `per_node` workers, so local rank i of every node holds the same shard and the
    workers that re-form together are column i's, one per node: rank the node's place in the round, world
    the number of nodes. Raises ValueError where the round's nodes do not all run `per_node` workers."""
    if per_node < 1 or assignment.world % per_node or not 0 <= local_rank < per_node:
        raise ValueError(
            f"a round of {assignment.world} workers does not make columns of nodes of {per_node} workers each "
            f"(local rank {local_rank})"
        )
    return dataclasses.replace(assignment, rank=assignment.node, world=assignment.world // per_node, column=local_rank)


def replica_group(environ: Mapping[str, str]) -> tuple[str, int]:
    """(this node's replica group, the nodes it spans) where the job's replica groups span nodes
    (REPLICA_GROUP_ENV named, REPLICA_GROUP_SIZE_ENV over 1: the operator sets both), else ("", 1): each
    node on its own (pure)."""
    name, size = environ.get(REPLICA_GROUP_ENV, ""), environ.get(REPLICA_GROUP_SIZE_ENV, "")
    return (name, int(size)) if name and size.isdigit() and int(size) > 1 else ("", 1)


def whole_groups(groups: Sequence[str], nodes: int) -> list[str]:
    """The replica groups that have all their `nodes` nodes in a round whose nodes' groups are `groups`, by
    name (pure): only a whole group holds a whole copy of a sharded state."""
    counted = Counter(groups)
    return sorted(name for name, count in counted.items() if name and count == nodes)


def group_column_of(assignment: Assignment, group: str, nodes: int, place: int) -> Assignment | None:
    """`assignment` as its worker's column sees it where a replica group of `nodes` nodes holds one copy of a
    sharded state (pure): the workers of one place in every whole group (`place`: this worker's rank in its
    group's process group) hold the same shard and re-form together; rank the group's place among the
    round's whole groups, world their number. None where this worker's group is not whole in the round (a
    member is gone, or has not come yet), or its place is not known yet (the group's process group has not
    formed): it holds no column then."""
    whole = whole_groups(assignment.groups, nodes)
    if group not in whole or place < 0:
        return None
    return dataclasses.replace(assignment, rank=whole.index(group), world=len(whole), column=place)


class Generations(Protocol):
    """What the worker's side needs of its group (recovery/live.py's LiveGroup): this module is the
    contract between an agent and its workers, and imports nothing of either side's internals."""

    def reconfigure(self, assignment: Assignment, deadline: float) -> bool: ...

    def supersede(self, generation: int) -> None: ...

    def offer(self, assignment: Assignment) -> None: ...


ASSIGNMENT_FILE = "assignment.json"
GROUPS_KEY = "torchspot/replica-group"
"""Under it, in the agents' store, each node's replica group by round and place (`_trade_groups`)."""
LIVE_PREFIX = "live-"
ACK_PREFIX = "ack-"
FAILED_PREFIX = "failed-"
AGREED_PREFIX = "agreed-"
STANDBY_PREFIX = "standby-"
STEPPED_PREFIX = "stepped-"
"""A live worker's last completed step: its generation in the file, the step's time (moved ahead by
up to STEP_CREDIT_SECONDS) as its modification time (`Handover.stepped`, `last_step`)."""
NO_STEP = -1
"""The generation in a stamp written before a worker's first step (`Handover.register` with
`stamps_steps`): no round is older, and its agent knows from the start that the worker trains on
while a joiner sets up (handler.py's `_defers_joins`)."""
STEP_CREDIT_SECONDS = 5.0
"""The most a step's stamp is moved ahead (`Handover.stepped`): a frozen member is found at most this
much later than by its puts alone."""
ACK_SECONDS = 3.0
"""How long an agent waits for its live workers to acknowledge a new round before it restarts them: a
watcher thread answers in milliseconds; only a worker that cannot run Python at all misses it."""
WATCH_SECONDS = 0.002
"""Between a watcher's looks at the assignment file: a `stat` costs microseconds, and every
millisecond here is a millisecond of the pause."""


def agent_folder(environ: Mapping[str, str] = os.environ) -> Path:
    """The folder of this agent's files: its peer-lost marker's (markers.py)."""
    return Path(environ[PEER_LOST_ENV]).parent


def assignment_record(
    generation: int,
    world: int,
    host: str,
    port: int,
    ranks: dict[int, int],
    *,
    node: int = 0,
    grows: bool = False,
    groups: Sequence[str] = (),
) -> dict[str, Any]:
    """The content of `assignment.json` (pure): `ranks` maps local rank to global rank."""
    return {
        "generation": generation,
        "world": world,
        "store_host": host,
        "store_port": port,
        "ranks": {str(local): rank for local, rank in ranks.items()},
        "node": node,
        "grows": grows,
        "groups": list(groups),
    }


def parse_assignment(record: dict[str, Any], local_rank: int) -> Assignment | None:
    """The assignment of local worker `local_rank` in `record` (pure); None if it names no such worker."""
    rank = record["ranks"].get(str(local_rank))
    if rank is None:
        return None
    return Assignment(
        record["generation"], int(rank), int(record["world"]), record["store_host"], int(record["store_port"]),
        int(record.get("node", 0)), bool(record.get("grows", False)),
        groups=tuple(str(name) for name in record.get("groups", ())),
    )  # fmt: skip


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):  # not there yet, or being replaced
        return None


def registered(folder: Path, pids: dict[int, int]) -> bool:
    """Whether every worker in `pids` (local rank to process id) registered as able to re-form in place."""
    return bool(pids) and all(_read_int(folder / f"{LIVE_PREFIX}{local}") == pid for local, pid in pids.items())


def _running(folder: Path) -> dict[str, int]:
    """Local rank to process id of the workers registered in `folder` whose process still runs (a stale
    file names a process that ended)."""
    return {
        path.name.removeprefix(LIVE_PREFIX): pid
        for path in folder.glob(f"{LIVE_PREFIX}*")
        if (pid := _read_int(path)) is not None and running(pid)
    }


def running_workers(folder: Path) -> list[int]:
    """The process ids of the workers registered in `folder` that still run."""
    return list(_running(folder).values())


def standing_by(folder: Path, pids: dict[int, int]) -> bool:
    """Whether every worker in `pids` (local rank to process id) stands by for its replica group."""
    return bool(pids) and all(_read_int(folder / f"{STANDBY_PREFIX}{local}") == pid for local, pid in pids.items())


def live_workers(folder: Path) -> bool:
    """Whether a worker registered in `folder` still runs."""
    return bool(_running(folder))


def notice_agreed(folder: Path) -> bool:
    """Whether every worker registered in `folder` that still runs has shared its node's notice with its
    group (`agreed-`): true too once none runs."""
    return all((folder / f"{AGREED_PREFIX}{local}").exists() for local in _running(folder))


def acknowledged(folder: Path, local_ranks: Iterable[int], generation: int) -> bool:
    """Whether every one of `local_ranks` acknowledged `generation` (or a newer one)."""
    return all((_read_int(folder / f"{ACK_PREFIX}{local}") or -1) >= generation for local in local_ranks)


def _generation(worker_group: WorkerGroup) -> int:
    """The round the group's handler last joined (handler.py's `current_round`)."""
    round_: int = worker_group.spec.rdzv_handler.current_round  # type: ignore[attr-defined]
    return round_


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (an ended child stays a zombie until its parent
    reaps it, which torch's monitoring does; Linux's /proc says which)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def last_step(folder: Path, generation: int) -> float | None:
    """The wall-clock time of the newest step a local live worker completed in `generation`, moved
    ahead by the step before's duration, so possibly in the future (`Handover.stepped`); None: none.
    Its gradient all-reduce completed, so every member of that generation was alive then: the
    agent's liveness judge counts it as a receipt from each, now until that time (handler.py's
    `_proven`).

    No later than a local worker's failure in `generation` (`failed_in`): the step that the credit
    counts on did not complete, and a collective that failed says a member is likely gone: a node
    killed during a long step would otherwise be kept by the credit until that step's due time, and
    taken out later than the failure allows."""
    newest: float | None = None
    for path in folder.glob(f"{STEPPED_PREFIX}*"):
        try:
            stamp = path.stat().st_mtime
        except OSError:  # being replaced
            continue
        if _read_int(path) == generation and (newest is None or stamp > newest):
            newest = stamp
    if newest is None:
        return None
    failed = failed_in(folder, generation)
    return newest if failed is None else min(newest, failed)


def stepped_generation(folder: Path) -> int | None:
    """The newest generation a local worker completed a step in (`Handover.stepped`); `NO_STEP`: a worker
    that stamps its steps has taken none yet; None: no stamp here (a program that does not stamp its
    steps)."""
    generations = [_read_int(path) for path in folder.glob(f"{STEPPED_PREFIX}*")]
    return max((g for g in generations if g is not None), default=None)


def failed_in(folder: Path, generation: int) -> float | None:
    """When (wall-clock seconds) the first local worker that entered `generation` (acknowledged it) and
    failed in it since did so: it waits for a next round (`Handover.report_failure`). None: none
    did (a failure before it entered is an older round's)."""
    found: list[float] = []
    for ack in folder.glob(f"{ACK_PREFIX}*"):
        failed = folder / f"{FAILED_PREFIX}{ack.name.removeprefix(ACK_PREFIX)}"
        try:
            entered, failed_at = ack.stat().st_mtime_ns, failed.stat().st_mtime_ns
        except OSError:  # no failure of this rank (or a file being replaced)
            continue
        if _read_int(ack) == generation and failed_at > entered:
            found.append(failed_at / 1e9)
    return min(found, default=None)


def latest_failure(folder: Path) -> int:
    """The newest `failed-*` file's modification time in nanoseconds (0: none)."""
    return max((path.stat().st_mtime_ns for path in folder.glob(f"{FAILED_PREFIX}*")), default=0)


class InPlaceAgent(LocalElasticAgent):
    """torch's local agent, whose membership changes re-form registered workers in place (module
    docstring). Needs a rendezvous handler with a `current_round` (etcd-v3's): every agent of a round
    must name its generation alike."""

    def __init__(self, spec: WorkerSpec, *args: Any, **kwargs: Any) -> None:
        """torch's agent sleeps `monitor_interval` between looks; this one waits at most as long for a
        write of the rendezvous state (handler.py's `wait_for_change`) and looks at once after one."""
        self._tick = spec.monitor_interval
        self._activity = Activity()
        self._groups: tuple[str, ...] = ()
        """Every node's replica group in the round last joined (`_trade_groups`)."""
        self._wait_for_change: Callable[[float], None] | None = getattr(spec.rdzv_handler, "wait_for_change", None)
        if self._wait_for_change is not None:
            spec.monitor_interval = WATCH_SECONDS  # torch's sleep; the wait is in _monitor_workers
        super().__init__(spec, *args, **kwargs)

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """torch's run. Where the agent itself fails (an exception: its workers' failure is a result,
        a signal is the node going), the handler is told to leave at its shutdown rather than close
        the rendezvous for every node (`keep_open`)."""
        try:
            result: RunResult = super().run(role)
        except SignalException:
            raise
        except Exception:
            keep_open: Callable[[], None] | None = getattr(self._worker_group.spec.rdzv_handler, "keep_open", None)
            if keep_open is not None:
                keep_open()
            raise
        return result

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous, joined again when the round lost a member or moved on before its set-up
        was done (the handler's `setting_up`: a store read that waited for the gone member's keys gave
        up); then the round's assignment for the workers."""
        setting_up: Callable[[], Any] = getattr(worker_group.spec.rdzv_handler, "setting_up", contextlib.nullcontext)
        while True:
            with setting_up() as set_up:
                try:
                    super()._rendezvous(worker_group)
                    self._groups = _trade_groups(worker_group, os.environ)
                except DistStoreError:
                    if set_up is None or set_up.abandoned is None:
                        raise
                    log.warning("rendezvous: the round was abandoned during its set-up (%s); joining the next one",
                                set_up.abandoned)  # fmt: skip
                    continue
            break
        self._write_assignment(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torch's monitoring after the tick (or a state write). (A live worker's failed collective
        reaches liveness through the handler's judge, whatever the agent is doing.) A failure is then
        weighed before torch's agent charges it to --max-restarts (`_weigh_failure`)."""
        if self._wait_for_change is not None:
            self._wait_for_change(self._tick)
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY and self._finished_elsewhere(worker_group):
            log.warning("the run finished on the other nodes while this node's workers stood by for their replica "
                        "group: they stop, and the node finishes too")  # fmt: skip
            assert self._pcontext is not None
            self._pcontext.close(signal.SIGKILL)  # (standing by, they hold nothing)
            done = {worker.global_rank: None for worker in worker_group.workers}
            return RunResult(state=WorkerState.SUCCEEDED, return_values=done)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._weigh_failure(worker_group, result)
        elif result.state == WorkerState.HEALTHY and self._pcontext is not None:
            report: Callable[[], None] | None = getattr(worker_group.spec.rdzv_handler, "report_activity", None)
            if report is not None and self._activity.look(self._pcontext.pids().values()):
                report()  # the operator's stall rule for a program that reports no steps (activity.py)
        return result

    def _finished_elsewhere(self, worker_group: WorkerGroup) -> bool:
        """Whether every worker of this node stands by for its replica group (`standby-` files) while another
        node's agent has reached torch's exit barrier of the round: its workers finished the run, so no
        group will form for these to join, and the others' agents wait in that barrier for this one."""
        pids = self._pcontext.pids() if self._pcontext is not None else {}
        if not self._groups or not standing_by(agent_folder(), pids):  # (no groups: nobody stands by)
            return False
        store: Any = worker_group.store  # (the round's: its type says None)
        finished: int = store.add(f"{_TERMINAL_STATE_SYNC_ID}{_NUM_MEMBERS}", 0)
        return finished > 0

    def _weigh_failure(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """Before torch's agent charges the failure in `result` against --max-restarts and restarts the
        workers: a worker that exited with NODE_FAULT_EXIT (this node cannot run the program) gets no
        restart here, and the node leaves the rendezvous rather than closing it (`keep_open`): the
        launcher exits with that code, and the pod is replaced elsewhere. A failure that a peer's loss
        explains (the handler's `explains_failure`) is not charged: torch's agent counts membership
        changes as no retry, but the survivors' workers of a hard loss fail before their agent sees
        the change."""
        handler = worker_group.spec.rdzv_handler
        codes = sorted({failure.exitcode for failure in result.failures.values()})
        if NODE_FAULT_EXIT in codes:
            log.warning("a worker exited with %d: this node cannot run the program; it leaves the job", NODE_FAULT_EXIT)
            self._remaining_restarts = 0
            keep_open: Callable[[], None] | None = getattr(handler, "keep_open", None)
            if keep_open is not None:
                keep_open()
            return
        explains: Callable[[], bool] | None = getattr(handler, "explains_failure", None)
        if explains is not None and explains():
            self._remaining_restarts += 1  # torch's agent takes it back as it restarts them
            log.warning("the workers failed (exit %s) as a peer was lost: not counted against --max-restarts",
                        ", ".join(map(str, codes)))  # fmt: skip

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """A change while every worker runs and is registered: hand them the next round; otherwise, or
        when one does not acknowledge in time, torch's restart."""
        folder = agent_folder()
        pids = self._pcontext.pids() if self._pcontext is not None else {}
        if worker_group.state != WorkerState.HEALTHY or not registered(folder, pids):
            super()._restart_workers(worker_group)
            return
        started = time.monotonic()
        self._rendezvous(worker_group)
        for worker in worker_group.workers:  # the round's Worker records are new: they run in these processes
            worker.id = pids[worker.local_rank]
        generation = _generation(worker_group)
        deadline = time.monotonic() + ACK_SECONDS
        while time.monotonic() < deadline:
            if not all(map(running, pids.values())):  # one ended meanwhile (done, or failed): torch's
                worker_group.state = WorkerState.HEALTHY  # monitoring takes it from here
                return
            if acknowledged(folder, pids, generation):
                log.warning(
                    "round %d: %d workers re-form in place (hand-over %.2f s after the change was seen)",
                    generation, len(pids), time.monotonic() - started,
                )  # fmt: skip
                worker_group.state = WorkerState.HEALTHY
                return
            time.sleep(WATCH_SECONDS)
        log.warning("round %d: a worker did not acknowledge within %.1f s; restarting them", generation, ACK_SECONDS)
        # In a round of their own: the live workers of the other nodes are in this one's group already,
        # and a worker restarted into it would break it under them; a new round re-forms them again.
        super()._restart_workers(worker_group)

    def _write_assignment(self, worker_group: WorkerGroup) -> None:
        generation = _generation(worker_group)
        ranks = {worker.local_rank: worker.global_rank for worker in worker_group.workers}
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        grows: bool = getattr(worker_group.spec.rdzv_handler, "grows_only", False)
        record = assignment_record(
            generation, world, str(worker_group.master_addr), int(worker_group.master_port or 0), ranks,
            node=int(worker_group.group_rank or 0), grows=grows, groups=self._groups,
        )  # fmt: skip
        _write_atomically(agent_folder() / ASSIGNMENT_FILE, json.dumps(record))


def _trade_groups(worker_group: WorkerGroup, environ: Mapping[str, str]) -> tuple[str, ...]:
    """Every node's replica group in the round just joined, by its place there, where the job's replica
    groups span nodes (`replica_group`): each agent
    writes its own to the round's store and reads the others'. A sharded run's workers read their columns
    by them (`group_column_of`). () otherwise. Called during the round's set-up, whose store reads give up
    where the round loses a member meanwhile (`InPlaceAgent._rendezvous`)."""
    mine, _nodes = replica_group(environ)
    if not mine:
        return ()
    store: Any = worker_group.store  # (torch's rendezvous just set it; its type says None)
    prefix = f"{GROUPS_KEY}/{_generation(worker_group)}"
    store.set(f"{prefix}/{worker_group.group_rank}", mine)
    nodes = int(worker_group.group_world_size or 0)
    return tuple(bytes(store.get(f"{prefix}/{node}")).decode() for node in range(nodes))


class Handover:
    """A worker's side of the hand-over: register, read its assignment, acknowledge a newer one and
    break the current generation's collectives (`Generations.offer`: at once, or once joiners are
    ready) the moment it appears.

    :param folder: the agent's folder (`agent_folder`).
    :param local_rank: this worker's LOCAL_RANK.
    :param clock: the wall clock the stamps are written by (`stepped`).
    :param view: how this worker reads each assignment: a sharded run in place as its column's (`column_of`,
        `group_column_of`), None where it holds no column in that round; None: as the agent wrote it.
    :param on_lost: told, on the watcher's thread, of each round in which `view` gives this worker no column
        (its replica group is not whole there): the worker's own rule for that (elastic/sharding.py).
    """

    def __init__(
        self,
        folder: Path,
        local_rank: int,
        *,
        clock: Callable[[], float] = time.time,
        view: Callable[[Assignment], Assignment | None] | None = None,
        on_lost: Callable[[Assignment], None] | None = None,
    ) -> None:
        self.folder = folder
        self.local_rank = local_rank
        self._view, self._on_lost = view, on_lost
        self._clock = clock
        self._seen: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._acked = -1
        self._ack_lock = threading.Lock()
        self._stepped = -1
        """The generation `stepped` last wrote."""
        self._stepped_at = 0.0
        """When `stepped` was last called (by `clock`)."""

    @classmethod
    def from_environment(
        cls,
        *,
        view: Callable[[Assignment], Assignment | None] | None = None,
        on_lost: Callable[[Assignment], None] | None = None,
    ) -> Handover:
        """For a worker started by `InPlaceAgent` (its agent's folder and LOCAL_RANK); `view` and `on_lost` as
        the class says."""
        return cls(agent_folder(), int(os.environ.get("LOCAL_RANK", "0")), view=view, on_lost=on_lost)

    def register(self, *, stamps_steps: bool = False) -> None:
        """Say this process can re-form in place (module docstring). `stamps_steps`: it stamps each step it
        completes (`stepped`) and trains on while a joiner sets up; said now with a stamp of `NO_STEP`
        where no stamp is here yet, so its agent knows before the first step. Without it a joiner's agent
        whose first round lost a member before it trained completed the next round as a program nothing
        is known of: it let in another joiner still starting, and the survivors waited in the new group
        for its start-up (1.0 s of a soak's 2.17 s freeze).

        A previous worker's `agreed-` file of this local rank goes: touched for any SIGTERM (the agent's
        restart too), it told a later notice that this worker had shared it already, and the agent left
        the rendezvous before the group agreed on the boundary: the emergency checkpoint was lost when
        the whole job stopped (a suspend, a whole-pool reclaim)."""
        (self.folder / f"{AGREED_PREFIX}{self.local_rank}").unlink(missing_ok=True)
        _write_atomically(self.folder / f"{LIVE_PREFIX}{self.local_rank}", str(os.getpid()))
        stamp = self.folder / f"{STEPPED_PREFIX}{self.local_rank}"
        if stamps_steps and not stamp.exists():
            _write_atomically(stamp, str(NO_STEP))

    def read(self) -> Assignment | None:
        """This worker's assignment in the agent's newest round, as its `view` reads it (None before the
        first, where the round does not name this worker, the agent stopping it, or where the view gives
        this worker no column there)."""
        assignment = self.read_as_written()
        if assignment is None or self._view is None:
            return assignment
        return self._view(assignment)

    def read_as_written(self) -> Assignment | None:
        """This worker's assignment in the agent's newest round as the agent wrote it (None before the first,
        or where the round does not name this worker)."""
        try:
            record = json.loads((self.folder / ASSIGNMENT_FILE).read_text())
        except (OSError, ValueError):
            return None
        return parse_assignment(record, self.local_rank)

    def agreed(self) -> None:
        """This worker's node leaves and its group has shared the notice (module docstring)."""
        (self.folder / f"{AGREED_PREFIX}{self.local_rank}").touch()

    def stepped(self, generation: int) -> None:
        """A step of `generation` completed (its all-reduce did): the file's time says when (`last_step`),
        moved ahead by the duration of the step before it in the generation (at most
        STEP_CREDIT_SECONDS): every member is busy with the next step, which is likely to take as
        long, and its agent may get no CPU meanwhile: without the credit, a node whose agent is starved
        for a second after a long step's stamp is taken out while it trains, and the step's training is
        lost. The generation's first step has no credit (the time before it was the re-form's).
        Written when the generation changes, else only its times set: a `utime` a step, microseconds."""
        path = self.folder / f"{STEPPED_PREFIX}{self.local_rank}"
        now = self._clock()
        if generation != self._stepped:
            _write_atomically(path, str(generation))
            os.utime(path, (now, now))
            self._stepped = generation
        else:
            credit = min(max(0.0, now - self._stepped_at), STEP_CREDIT_SECONDS)
            os.utime(path, (now, now + credit))
        self._stepped_at = now

    def stand_by(self, waiting: bool) -> None:
        """This worker stands by for its replica group to be whole (`waiting`), or no longer (module docstring)."""
        path = self.folder / f"{STANDBY_PREFIX}{self.local_rank}"
        if waiting:
            _write_atomically(path, str(os.getpid()))
        else:
            path.unlink(missing_ok=True)

    def report_failure(self) -> None:
        """A collective of this worker failed (a peer is likely gone): tell the agent (module docstring)."""
        (self.folder / f"{FAILED_PREFIX}{self.local_rank}").write_text(str(time.time()))

    def enter(self, live: Generations, assignment: Assignment, deadline: float) -> bool:
        """Acknowledge `assignment`, then `live.reconfigure(assignment, deadline)` (which gives it up
        at once if the watcher saw a newer round already). False when the group did not form (the
        caller waits for the next round)."""
        self._acknowledge(assignment.generation)
        return live.reconfigure(assignment, deadline)

    def watch(self, live: Generations) -> None:
        """Start the watcher thread: a newer round is acknowledged and breaks `live`'s generation."""
        threading.Thread(target=self._watch, args=(live,), name="torchspot-handover", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _acknowledge(self, generation: int) -> None:
        with self._ack_lock:  # the watcher and the main thread: the newest generation wins
            if generation > self._acked:
                self._acked = generation
                _write_atomically(self.folder / f"{ACK_PREFIX}{self.local_rank}", str(generation))

    def _watch(self, live: Generations) -> None:
        path = self.folder / ASSIGNMENT_FILE
        while not self._stop.wait(WATCH_SECONDS):
            try:
                stat = path.stat()
            except OSError:
                continue
            if (stat.st_mtime_ns, stat.st_ino) == self._seen:
                continue
            self._seen = (stat.st_mtime_ns, stat.st_ino)
            found = self.read_as_written()
            if found is None:
                continue
            self._acknowledge(found.generation)  # also one the main thread entered first
            seen = found if self._view is None else self._view(found)
            if seen is not None:
                live.offer(seen)
            elif self._on_lost is not None:
                self._on_lost(found)
