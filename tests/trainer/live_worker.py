"""One worker of test_live.py: `live_worker.py NODE FOLDER [PARTIAL_STEP [PLANE]]`.

It trains a toy weight through recovery/live.py's LiveGroup: each step takes a local step of
`0.01 x (rank + 1)` and averages the ranks' weights with one all-reduce of the weight itself (the
buffer a thawed peer's abandoned collective would write into, were it not staged). Its assignments
are files the test writes, `FOLDER/assign-<generation>.json` ({"generation", "ranks": {node: rank},
"store_port"}); a thread sets the group's `broken` event as soon as a newer one appears (what the
agent's hand-over does).
When a step fails it waits for the next assignment, re-forms, and the ranks agree on the newest
committed step; a rank behind it receives the weight and the per-generation step counts from the
lowest rank that holds it (healing). `PARTIAL_STEP`: at that committed step this node drops its
update after the all-reduce (a fault between the all-reduce and the optimizer step, where its peers
committed) and waits for a new assignment. `PLANE`: `host` (the gloo group carries everything, as on
CPU) or `separate` (`SeparateGloo`: the data on a group of its own, as NCCL's on a GPU).

It writes `FOLDER/progress-<node>.json` after each step (generation, committed steps by generation,
old groups held, gloo event loops alive) and, when it has committed the number of steps
`FOLDER/stop` names or it is left out of an assignment, `FOLDER/result-<node>.json`:
the weight, the counts, and each re-form's seconds from the verdict (the new assignment's file) to
the first step done in the new generation, and the plane's counts (data groups retired, device probes).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchspot_trainer.handover import Assignment
from torchspot_trainer.recovery.live import LiveGroup, wait_for_assignment
from torchspot_trainer.recovery.outcome import Outcome
from torchspot_trainer.recovery.planes import HostPlane, Parent

GENERATIONS = 4
DEADLINE = 20.0


class SeparateGloo(HostPlane):
    """Stands in for planes.NcclPlane, which cannot run here (no GPU): each generation's data on a gloo
    group of its own beside its control group, the old one retired with gloo's abort while the next
    forms, and a probe that passes. What it exercises is ours: the two groups of a generation, the
    data's staging, the retirement overlapped with the build, the graves kept until it returned, the
    probe owed after work abandoned in flight. NCCL's own semantics (get_error, eager non-blocking
    init, shrink) are not."""

    separate = True

    def make(
        self,
        store: Any,
        control: Any,
        *,
        timeout: timedelta,
        parent: Parent | None,
        abandoned: threading.Event,
        made: Callable[[Any], None] = lambda _group: None,
    ) -> Any:
        if parent is not None:
            parent.retire()
        data = dist.ProcessGroupGloo(store, control.rank(), control.size(), timeout)
        made(data)
        return data

    def abort(self, group: Any) -> None:
        group.abort()


def on_threads(target: Callable[[int], object], *ranks: int) -> None:
    """`target(rank)` for each of `ranks` on a thread of its own, all started, then each waited for (20 s
    at most): the ranks of one process's groups entering a collective or a re-form together (the inline
    scripts of test_live.py)."""
    threads = [threading.Thread(target=target, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)


def gloo_loops() -> int:
    """This process's gloo event-loop threads: one per gloo group alive (each has a device of its own),
    gone when the group is freed and its sockets closed."""
    tasks = Path("/proc/self/task")
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that ended meanwhile
            continue
    return names.count("gloo_tcp_loop")


def read_assignment(folder: Path, node: str) -> Assignment | None:
    """The newest assignment file that names this node (None if the newest leaves it out)."""
    files = sorted(folder.glob("assign-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        return None
    data = json.loads(files[-1].read_text())
    if node not in data["ranks"]:
        return Assignment(data["generation"], -1, len(data["ranks"]), "127.0.0.1", data["store_port"])
    return Assignment(data["generation"], data["ranks"][node], len(data["ranks"]), "127.0.0.1", data["store_port"])


def _stopping(folder: Path, committed: int) -> bool:
    """Whether this worker has reached the step the test's `stop` file names: every rank stops at the
    same step, so none leaves while a peer is still in a collective with it."""
    try:
        return committed >= int((folder / "stop").read_text())
    except (OSError, ValueError):
        return False


def main(node: str, folder_text: str, partial: str = "-1", plane: str = "host") -> None:
    folder = Path(folder_text)
    live = LiveGroup(plane=SeparateGloo() if plane == "separate" else HostPlane())
    first = wait_for_assignment(lambda: read_assignment(folder, node), -1, time.monotonic() + 60)
    assert first is not None
    assert live.reconfigure(first, time.monotonic() + DEADLINE)

    def watch() -> None:  # the hand-over: a newer assignment breaks the current generation at once
        while True:
            found = read_assignment(folder, node)
            if found is not None and live.assignment is not None and found.generation > live.assignment.generation:
                live.broken.set()
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()
    w = torch.zeros(8, dtype=torch.float64)  # exact enough that only a lost or stray update shows
    counts = torch.zeros(GENERATIONS, dtype=torch.float64)
    reforms: list[float] = []
    verdict: float | None = None
    dropped = False
    while not _stopping(folder, int(counts.sum())):
        generation = live.assignment.generation if live.assignment else 0
        before = w.clone()
        w.sub_(0.01 * (live.rank + 1))  # a local step, then the ranks' weights averaged: the model
        outcome = live.all_reduce(w, time.monotonic() + DEADLINE)  # itself is the collective's buffer
        if outcome is Outcome.DONE and int(counts.sum()) + 1 == int(partial) and not dropped:
            dropped = True  # the update lost between the all-reduce and the optimizer's step
            outcome = Outcome.FAILED
        if outcome is Outcome.DONE:
            w.div_(live.world)
            counts[generation] += 1
            if verdict is not None:
                reforms.append(time.monotonic() - verdict)
                verdict = None
            (folder / f"progress-{node}.json").write_text(
                json.dumps({"generation": generation, "counts": counts.tolist(), "graves": live.graves(),
                            "loops": gloo_loops()})
            )  # fmt: skip
            time.sleep(0.01)
            continue
        w.copy_(before)
        new = wait_for_assignment(lambda: read_assignment(folder, node), generation, time.monotonic() + DEADLINE)
        if new is None:
            sys.exit(3)  # no hand-over in time: the restart path
        verdict = (folder / f"assign-{new.generation}.json").stat().st_mtime - time.time() + time.monotonic()
        if new.rank < 0:  # left out: this node is gone from the job; its process lingers a moment, so
            time.sleep(3.0)  # that the collective it was frozen in can complete at its peers
            break
        assert live.reconfigure(new, time.monotonic() + DEADLINE), "the new generation did not form"
        state = torch.cat([w, counts])
        assert live.heal(int(counts.sum()), state, time.monotonic() + DEADLINE) is not None, "the new generation failed"
        w, counts = state[:8].clone(), state[8:].clone()
    (folder / f"result-{node}.json").write_text(
        json.dumps(
            {
                "w": w.tolist(),
                "counts": counts.tolist(),
                "reforms": reforms,
                "graves": live.graves(),
                "retirements": live.retirements,
                "probes": live.probes,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
