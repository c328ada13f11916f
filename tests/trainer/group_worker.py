"""One rank of a small real gloo group for test_group_paths.py: `group_worker.py SCENARIO RANK WORLD STORE OUT`.

- broadcast: rank 1 holds a training state (a model and an SGD optimizer after one step, RNG
  states, a NaN); it is sent to every rank with wire.broadcast_state; each rank saves what it
  got to OUT.
- control: every rank makes a second (gloo) group with group.control_group's call and gathers
  [rank, 10 x rank] through it from a Group whose device is `meta` (no memory at all): the
  per-step agreement must not touch the device. Each rank writes what it gathered to OUT.
- agree: rank 1 exits (a leaving node's rank) before rank 0 reaches the notice's barrier
  (Group.agree, through a control group, device `meta`); rank 0 writes what it returned and
  the seconds it took.
- late-leaving: two nodes of two ranks (node = rank // 2), markers under STORE's folder as each node's
  agent writes them (markers.py). Node 0's agent restarts its workers (its restart marker; rank 1
  has its SIGTERM already); node 1 leaves, and its agent's leaving marker appears only while its
  ranks are in the boundary's all-gather, after they shared level 0. Every rank appends to OUT what
  NoticeStop did (`save`, `snapshot`, `exit <code>`; rank 0, which stays, `broken` once the others
  are gone).
- ping: rank 0 pings with a 1 s timeout while rank 1 (a frozen peer) never joins the
  collective; rank 0 writes the ping's result and the seconds it took to OUT.
- peer-gone: rank 1 exits once both are connected; rank 0's all-reduce raises, and rank 0 writes what
  group.peer_failure makes of that error and of a shape error raised by a matrix product.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from torchspot_trainer.checkpoint.manager import SaveReport
from torchspot_trainer.markers import LEAVING_MARKER, PEER_LOST_ENV, RESTART_MARKER, marker_beside
from torchspot_trainer.recovery.group import Group, peer_failure
from torchspot_trainer.recovery.notices import GroupBroken, NoticeStop
from torchspot_trainer.recovery.rng import rng_state
from torchspot_trainer.recovery.signals import EvictionNotice
from torchspot_trainer.recovery.wire import broadcast_state


def training_state() -> dict[str, Any]:
    """What the trainer checkpoints, small: model, optimizer (int-keyed state), RNG, a NaN."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 7,
        "rng": rng_state(),
        "evaluated": {"step": -1, "accuracy": float("nan")},
        "pair": (1, "two"),
    }


class _MarkedDuringGather(Group):
    """A real group whose all-gather, once done, leaves `marker` (the agent marking the node leaving
    while its ranks were in the collective: the timing a CI run met by chance)."""

    def __init__(self, rank: int, world: int, marker: str | None) -> None:
        super().__init__(rank, world, torch.device("cpu"))
        self.marker = marker

    def gather_ints(self, row: list[int]) -> list[list[int]]:
        rows = super().gather_ints(row)
        if self.marker is not None:
            open(self.marker, "a").close()
        return rows


def _late_leaving(rank: int, world: int, store: str, out: str) -> None:
    """The late-leaving scenario (module docstring)."""
    node = rank // 2
    folder = os.path.join(os.path.dirname(store), f"node-{node}")
    os.makedirs(folder, exist_ok=True)
    os.environ[PEER_LOST_ENV] = os.path.join(folder, "peer-lost")
    if node == 0:
        open(marker_beside(os.environ[PEER_LOST_ENV], RESTART_MARKER), "a").close()
    group = _MarkedDuringGather(rank, world, marker_beside(os.environ[PEER_LOST_ENV], LEAVING_MARKER) if node else None)

    def said(what: str) -> None:
        with open(out, "a") as file:
            file.write(what + "\n")

    def save() -> SaveReport:
        said("save")
        return SaveReport(step=3, ok=True, seconds=0.0)

    notice = EvictionNotice()
    if rank == 1:
        notice.set("SIGTERM", "its agent restarts it")
    stop = NoticeStop(notice, hold=5.0, emit=lambda *_a, **_k: None, keep_snapshot=lambda: said("snapshot"),
                      node=node, ping_timeout=1.0)  # fmt: skip

    def exit_evicted() -> NoReturn:  # the trainer's exit code would fail _group's check: 0, said
        said("exit evicted")
        os._exit(0)

    stop.exit_evicted = exit_evicted  # type: ignore[method-assign]
    dist.barrier()  # every rank connected before any can go
    try:
        said(f"stopped {stop.at_boundary(group, step=3, save=save)}")
    except (GroupBroken, RuntimeError):  # gloo's error for a closed socket, or the barrier's timeout
        said("broken")


def _peer_gone(rank: int, out: str) -> None:
    dist.barrier()  # both connected, as a trainer's group is long before a loss
    if rank == 1:
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(1024))
        lost: str | None = "no error"
    except RuntimeError as exc:
        lost = peer_failure(exc)
    try:
        torch.ones(2, 3) @ torch.ones(2, 3)
        bug: str | None = "no error"
    except RuntimeError as exc:
        bug = peer_failure(exc)
    with open(out, "w") as file:
        json.dump({"lost": lost, "bug": bug}, file)


def main(scenario: str, rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    group = Group(rank, world, torch.device("cpu"))
    if scenario == "broadcast":
        state = broadcast_state(training_state() if rank == 1 else None, 1, rank, group.device)
        torch.save(state, out)
    elif scenario == "control":
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        agreed = Group(rank, world, torch.device("meta"), control).gather_ints([rank, 10 * rank])
        with open(out, "w") as file:
            json.dump(agreed, file)
    elif scenario == "agree":
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        # Both ends of the control group connected before rank 1 goes, as in a trainer (whose groups
        # formed long before a notice): a CI run saw rank 1 leave while rank 0 was still connecting.
        dist.barrier()
        if rank == 0:
            started = time.monotonic()
            try:
                done: Any = Group(rank, world, torch.device("meta"), control).agree(1.0)
            except RuntimeError as exc:  # gloo: the peer's socket closed
                done = f"raised: {exc}"[:200]
            with open(out, "w") as file:
                json.dump({"done": done, "seconds": time.monotonic() - started}, file)
        else:
            os._exit(0)  # the leaving node's rank: gone before the barrier
    elif scenario == "late-leaving":
        _late_leaving(rank, world, store, out)
    elif scenario == "ping":
        if rank == 0:
            started = time.monotonic()
            done = group.ping(1.0)
            with open(out, "w") as file:
                json.dump({"done": done, "seconds": time.monotonic() - started}, file)
        else:
            time.sleep(3)  # frozen: never joins the ping
    elif scenario == "peer-gone":
        _peer_gone(rank, out)
    sys.stdout.flush()
    os._exit(0)  # no shutdown handshake with a peer that may have gone


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
