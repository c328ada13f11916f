"""The parts that keep recovery working on NCCL, tested where they run here (CPU, gloo): the
host copy a snapshot is written from, the state sent to a joiner as tensors, a node's one
notice, a ping that gives up on a frozen peer, the step watchdog, and the NCCL settings.

What only a GPU shows (the side-stream copy overlapping a step, a hung NCCL collective, the
communicator's abort) is not run here; README, "Recovery on GPUs", says which paths were
measured on which backend."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from torchspot_trainer.recovery.group import NCCL_ERROR_HANDLING_ENV, StepWatchdog, control_group, nccl_environment
from torchspot_trainer.recovery.hostcopy import HostCopy
from torchspot_trainer.recovery.notices import NOTICE_LEAVING, NOTICE_RESTART, emergency_saver, node_levels
from torchspot_trainer.recovery.wire import WireError, flatten, unflatten

WORKER = Path(__file__).with_name("group_worker.py")
sys.path.insert(0, str(WORKER.parent))
from group_worker import training_state  # type: ignore[import-not-found]  # noqa: E402


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal kinds, tensors by dtype, shape and content, NaN equal to NaN."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def test_a_training_state_goes_through_the_wire_unchanged() -> None:
    state = training_state()
    skeleton, tensors = flatten(state)
    assert "momentum_buffer" in skeleton
    buffers = {dtype: torch.cat([t.reshape(-1) for t in parts]) for dtype, parts in tensors.items()}
    assert set(buffers) >= {"float32", "int64", "uint8"}  # weights, BN's count and the RNG's bytes
    back = unflatten(skeleton, buffers)
    assert _same(state, back)
    assert list(back["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay int (JSON would make them str)


def test_what_a_checkpoint_cannot_hold_is_refused_naming_where() -> None:
    with pytest.raises(WireError, match=r"\.model\.w: a object cannot be sent"):
        flatten({"model": {"w": object()}})


def _group(tmp_path: Path, scenario: str, world: int) -> list[Path]:
    store = tmp_path / "store"
    outs = [tmp_path / f"out-{rank}" for rank in range(world)]
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), scenario, str(rank), str(world), str(store), str(out)])
        for rank, out in enumerate(outs)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0] * world
    return outs


def test_a_joiner_gets_the_state_as_tensors_over_a_real_group(tmp_path: Path) -> None:
    """Three gloo ranks; rank 1 holds the state (the source in resume.py's sense), 0 and 2 join."""
    got = [torch.load(out, weights_only=True) for out in _group(tmp_path, "broadcast", 3)]
    assert _same(got[1], got[0])
    assert _same(got[1], got[2])
    expected = training_state()  # the RNG states are the source process's own
    for key in ("model", "optimizer", "evaluated", "pair"):
        assert _same(expected[key], got[0][key]), key


def test_the_per_step_agreement_goes_through_the_control_group_never_the_device(tmp_path: Path) -> None:
    """On NCCL the boundary's all-gather runs in a gloo group beside it (group.control_group), so
    reading its result does not wait for the GPU's queue. Three gloo ranks whose Group device is
    `meta` (any tensor made there has no data to gather) agree through a second group."""
    outs = _group(tmp_path, "control", 3)
    assert [json.loads(out.read_text()) for out in outs] == [[[0, 0], [1, 10], [2, 20]]] * 3
    assert control_group("gloo", 10.0) is None  # gloo is host-side already: no second group


def test_a_ping_gives_up_on_a_frozen_peer_within_its_timeout(tmp_path: Path) -> None:
    """The notice hold's ping: a peer that never takes part makes it return False after its 1 s,
    where a plain NCCL all-reduce would return at once and a plain gloo one would block for the
    group's timeout (30 s here)."""
    out = _group(tmp_path, "ping", 2)[0]
    said = json.loads(out.read_text())
    assert said["done"] is False
    assert 1.0 <= said["seconds"] < 2.5


def test_the_host_copy_keeps_the_last_boundary_while_training_changes_the_live_state() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    copy = HostCopy(torch.device("cpu"), copy=True)
    assert copy.latest() is None

    def state(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}

    copy.capture(0, lambda: state(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.ones(4, 3)).sum().backward()
    copy.before_update()
    optimizer.step()  # changes the live parameters in place; the optimizer's state appears
    held = copy.latest()
    assert held is not None
    assert held["step"] == 0
    assert all(torch.equal(held["model"][k], before[k]) for k in before)
    assert not torch.equal(model.weight.detach(), before["weight"])
    copy.capture(1, lambda: state(1))
    held = copy.latest()
    assert held is not None
    assert held["step"] == 1
    assert torch.equal(held["model"]["weight"], model.weight.detach())
    assert torch.equal(
        held["optimizer"]["state"][0]["momentum_buffer"], optimizer.state[model.weight]["momentum_buffer"]
    )
    assert held["model"]["weight"].data_ptr() != model.weight.data_ptr()  # a copy, not the live tensor


def test_a_host_copy_every_k_steps_holds_the_last_multiple_of_k() -> None:
    weight = torch.zeros(2)
    copy = HostCopy(torch.device("cpu"), every=3, copy=True)
    built: list[int] = []

    def build(step: int) -> dict[str, Any]:
        built.append(step)
        return {"w": weight, "step": step}

    for step in range(1, 8):
        weight += 1
        copy.capture(step, partial(build, step))
    held = copy.latest()
    assert held is not None
    assert (held["step"], held["w"].tolist()) == (6, [6.0, 6.0])
    assert copy.copies == 2
    assert built == [3, 6]  # the state is built only when a copy is due
    with pytest.raises(ValueError, match="every 0 steps"):
        HostCopy(torch.device("cpu"), every=0)


def test_without_copies_a_cpu_snapshot_is_the_live_state_except_during_an_update() -> None:
    weight = torch.zeros(2)
    kept = HostCopy(torch.device("cpu"))
    assert not kept.copying
    kept.capture(4, lambda: {"w": weight, "step": 4})
    held = kept.latest()
    assert held is not None
    assert held["w"] is weight  # no copy, no cost per step
    kept.before_update()
    assert kept.latest() is None  # half-updated: no snapshot rather than a torn one
    weight += 1
    kept.capture(5, lambda: {"w": weight, "step": 5})
    assert kept.latest() == {"w": weight, "step": 5}


@pytest.mark.parametrize(
    ("rows", "levels", "saver"),
    [
        # Node 1's Scheduled Event is seen by its first local rank only (rank 2): ranks 2 and 3 both leave.
        ([[0, 0], [0, 0], [NOTICE_LEAVING, 1], [0, 1]], [0, 0, NOTICE_LEAVING, NOTICE_LEAVING], 2),
        ([[0, 0], [NOTICE_RESTART, 0], [0, 1], [0, 1]], [NOTICE_RESTART, NOTICE_RESTART, 0, 0], None),
        ([[0, 0], [0, 0]], [0, 0], None),
    ],
    ids=["scheduled-event-on-one-local-rank", "restart", "none"],
)
def test_a_notice_belongs_to_the_whole_node(rows: list[list[int]], levels: list[int], saver: int | None) -> None:
    assert node_levels(rows) == levels
    assert emergency_saver(levels) == saver


def test_the_step_watchdog_ends_a_worker_stuck_between_boundaries_only_while_armed() -> None:
    boundary = [time.monotonic()]
    broken = threading.Event()
    seen: list[float] = []

    def on_broken(since: float) -> None:
        seen.append(since)
        broken.set()

    dog = StepWatchdog(0.2, lambda: boundary[0], on_broken, interval=0.02)
    dog.start()
    try:
        assert not broken.wait(0.5)  # not armed (set-up): nothing happens however long it takes
        dog.armed = True
        boundary[0] = time.monotonic()
        assert broken.wait(5)
        assert seen[0] > 0.2
    finally:
        dog.stop()


def test_nccl_error_handling_is_ours_unless_the_user_chose() -> None:
    assert nccl_environment({}) == {NCCL_ERROR_HANDLING_ENV: "0"}
    assert nccl_environment({NCCL_ERROR_HANDLING_ENV: "3"}) == {}
