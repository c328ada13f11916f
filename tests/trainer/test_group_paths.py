"""The parts that keep recovery working on NCCL, tested where they run here (CPU, gloo): the
host copy a snapshot is written from, the state sent to a joiner as tensors, a node's one
notice, a ping that gives up on a frozen peer, the step watchdog, and the NCCL settings.

What only a GPU shows (the side-stream copy overlapping a step, a hung NCCL collective, the
communicator's abort) is not run here; README, "Recovery on GPUs", says which paths were
measured on which backend."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchspot_lab.etcd import free_port
from torchspot_trainer import ENV_PREFIX
from torchspot_trainer.evaluate import evaluate
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.nccl import (
    FLIGHT_RECORDER_DEFAULTS,
    FLIGHT_RECORDER_ENV,
    FORMER_NAMES,
    NCCL_ERROR_HANDLING_ENV,
    NCCL_RETHROW_ENV,
    WORKER_NCCL_DEFAULTS,
    worker_environment,
)
from torchspot_trainer.precision import Precision
from torchspot_trainer.recovery.group import (
    GLOO_TRANSPORT,
    Group,
    StepWatchdog,
    abort_group,
    control_group,
    group_device,
    group_timeout,
    nccl_environment,
    peer_failure,
)
from torchspot_trainer.recovery.hostcopy import BoundaryBuffers, HostCopy, with_frozen
from torchspot_trainer.recovery.notices import (
    NOTICE_LEAVING,
    NOTICE_RESTART,
    emergency_saver,
    node_levels,
    saves_emergency,
    waits_for_save,
)
from torchspot_trainer.recovery.resume import find_state
from torchspot_trainer.recovery.snapshot import Held
from torchspot_trainer.recovery.wire import ALIGN, WireError, flatten, layout, pack, unflatten, unpack

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


def test_each_dtype_has_an_aligned_section_of_the_one_buffer_after_the_skeleton() -> None:
    """One broadcast carries the skeleton and every tensor: each dtype's section starts on ALIGN bytes
    (a byte buffer's slice is viewed as that dtype), none overlaps the next, the buffer holds them all."""
    places, total = layout(37, {"uint8": 5, "float64": 3, "bool": 1, "float32": 0})
    assert list(places) == ["bool", "float32", "float64", "uint8"]  # the same order on every rank
    assert places == {"bool": (48, 1), "float32": (64, 0), "float64": (64, 3), "uint8": (96, 5)}
    assert total == 112
    assert all(offset % ALIGN == 0 for offset, _ in places.values())


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


def test_the_notice_barrier_ends_when_a_leaving_rank_has_exited(tmp_path: Path) -> None:
    """The staying ranks' barrier after an emergency checkpoint, with the leaving node's rank gone: it ends
    within its 1 s (False, or gloo's error for the closed socket) on the control group, never waiting
    on the device (whose group is `meta` here: any device work would fail)."""
    outs = _group(tmp_path, "agree", 2)
    said = json.loads(outs[0].read_text())
    assert said["done"] is False or str(said["done"]).startswith("raised")
    assert said["seconds"] < 5.0


def test_a_collective_that_failed_at_a_lost_peer_is_told_from_a_failure_of_the_program(tmp_path: Path) -> None:
    """A real gloo all-reduce whose peer exited: a line for the worker's log, gloo's own first line (where
    the restart path's survivors printed the traceback as for a crash); a shape error: None, so its
    traceback is printed."""
    said = json.loads(_group(tmp_path, "peer-gone", 2)[0].read_text())
    assert said["lost"] is not None
    assert GLOO_TRANSPORT in said["lost"]
    assert "\n" not in said["lost"]
    assert said["bug"] is None
    assert peer_failure(dist.DistNetworkError("the store's connection was reset")) == "the store's connection was reset"


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


class _Device:
    """A device whose copies finish when the test says: each fill returns an event (query, synchronize),
    as a CUDA copy on a side stream does; `block` makes the next fill itself block, as a copy does
    when a wedged collective has filled the launch queue."""

    def __init__(self) -> None:
        self.events: list[threading.Event] = []
        self.block: threading.Event | None = None

    def fill(self, buffers: list[torch.Tensor], live: list[torch.Tensor]) -> Any:
        if self.block is not None:
            self.block.wait()
        for buffer, tensor in zip(buffers, live, strict=True):
            buffer.copy_(tensor)
        done = threading.Event()
        self.events.append(done)
        return SimpleNamespace(query=done.is_set, synchronize=done.wait)


def _state_at(step: int) -> dict[str, Any]:
    return {"w": torch.full((2,), float(step)), "step": step}


def _steps(copy: HostCopy, steps: range) -> None:
    for step in steps:
        copy.capture(step, partial(_state_at, step))


def test_a_snapshot_is_written_while_a_capture_is_stuck_in_a_device_copy() -> None:
    """SIGTERM arrives while the training thread is blocked in a copy (a wedged NCCL collective filled the
    launch queue): the snapshot is the newest whole copy, written at once, not after the device."""
    device = _Device()
    copy = HostCopy(torch.device("cpu"), fill=device.fill)
    _steps(copy, range(1, 3))
    for done in device.events:
        done.set()  # the device finished steps 1 and 2
    device.block = threading.Event()
    stuck = threading.Thread(target=_steps, args=(copy, range(3, 4)), daemon=True)
    stuck.start()
    started = time.monotonic()
    written = copy.write_from(lambda state: None if state is None else state["step"])
    assert written == 2
    assert time.monotonic() - started < 1.0  # not the device's time (the old lock was held across the copy)
    assert stuck.is_alive()  # still blocked in the device
    device.block.set()
    stuck.join(5)


def test_the_ring_keeps_the_newest_whole_copy_when_the_device_stalls_behind_the_host() -> None:
    """The device finished step 1 and hangs in step 2 while the host runs on: the copy of step 1 is never
    overwritten (two slots lost it at step 3); the host waits, on the device, once the ring is full."""
    device = _Device()
    copy = HostCopy(torch.device("cpu"), fill=device.fill)
    _steps(copy, range(1, 2))
    device.events[0].set()
    _steps(copy, range(2, 4))  # steps 2 and 3 captured, never finished by the device
    held = copy.latest()
    assert held is not None
    assert held["step"] == 1
    ahead = threading.Thread(target=_steps, args=(copy, range(4, 5)), daemon=True)
    ahead.start()
    ahead.join(0.3)
    assert ahead.is_alive()  # the host's lead is bounded: it waits for the device
    held = copy.latest()
    assert held is not None
    assert held["step"] == 1
    assert copy.write_from(lambda state: None if state is None else state["step"]) == 1
    device.events[1].set()  # the device finishes step 2: the capture of step 4 goes on
    ahead.join(5)
    assert not ahead.is_alive()
    held = copy.latest()
    assert held is not None
    assert held["step"] == 2
    with pytest.raises(ValueError, match="at least 3"):
        HostCopy(torch.device("cpu"), slots=2)


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


class _Later:
    """A device whose copies run when the test says, as a side-stream copy runs while the host goes on."""

    def __init__(self) -> None:
        self.queued: list[tuple[list[torch.Tensor], list[torch.Tensor], threading.Event]] = []

    def fill(self, buffers: list[torch.Tensor], live: list[torch.Tensor]) -> Any:
        done = threading.Event()
        self.queued.append((buffers, live, done))
        return SimpleNamespace(query=done.is_set, synchronize=lambda: done.wait(30))

    def run(self) -> None:
        for buffers, live, done in self.queued:
            for buffer, tensor in zip(buffers, live, strict=True):
                buffer.copy_(tensor)
            done.set()
        self.queued.clear()


def _bn_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


@pytest.mark.parametrize("device", ["live", "side-stream"], ids=["cpu-live-state", "deferred-copy"])
def test_the_state_of_a_boundary_keeps_its_batchnorm_statistics_through_the_next_forward(device: str) -> None:
    """The next step's forward writes BatchNorm's running statistics before the update that
    before_update guards: the snapshot (CPU: the live state, built when written) and the copy (GPU:
    read on a side stream while the host goes on) still hold the boundary's statistics."""
    model = _bn_model()
    later = _Later()
    copy = HostCopy(torch.device("cpu"), fill=later.fill if device == "side-stream" else None)
    at_boundary = model.get_buffer("1.running_mean").clone()
    copy.capture(1, with_frozen(list(model.buffers()), lambda: {"model": model.state_dict(), "step": 1}))
    model.train()
    model(torch.randn(8, 4) + 5)  # the next step's forward
    assert not torch.equal(model.get_buffer("1.running_mean"), at_boundary)
    later.run()  # the side-stream copy runs only now
    held = copy.latest()
    assert held is not None
    assert torch.equal(held["model"]["1.running_mean"], at_boundary)
    assert int(held["model"]["1.num_batches_tracked"]) == 0
    assert torch.equal(held["model"]["0.weight"], model.get_parameter("0.weight").detach())  # no update happened


def test_a_step_that_breaks_before_its_update_leaves_no_batchnorm_statistics_behind() -> None:
    """In place, a step whose gradient all-reduce fails has run its forward passes: BatchNorm's running
    statistics and batch count moved with its samples. The re-form puts back the boundary's
    (`BoundaryBuffers`, kept by the manager as each step begins): a heal where every rank is live sends nothing over
    them, and the replayed step gave rank 0's contaminated statistics to everyone. A step that was
    applied keeps its statistics."""
    model = _bn_model()
    model.train()
    buffers = list(model.buffers())
    boundary = BoundaryBuffers()
    for step in (7, 8):  # the copy of the step before is reused
        boundary.keep(buffers, step)
        at_boundary = {name: buffer.clone() for name, buffer in model.named_buffers()}
        model(torch.randn(8, 4) + 5)  # the step's forward; its all-reduce then fails
        assert not torch.equal(model.get_buffer("1.running_mean"), at_boundary["1.running_mean"])
        assert boundary.restore(buffers, step)
        assert all(torch.equal(buffer, at_boundary[name]) for name, buffer in model.named_buffers())
    model(torch.randn(8, 4) + 5)  # step 9's forward, and its update: applied
    applied = model.get_buffer("1.running_mean").clone()
    assert not boundary.restore(buffers, 9)  # kept at 8: the model went on from 9
    assert torch.equal(model.get_buffer("1.running_mean"), applied)


def test_a_checkpoint_is_taken_from_the_rings_copy_of_its_step_once_whole() -> None:
    later = _Later()
    copy = HostCopy(torch.device("cpu"), fill=later.fill)
    weight = torch.zeros(2)
    for step in (1, 2):
        weight += 1
        copy.capture(step, partial(dict, w=weight, step=step))
    seen: list[Any] = []
    saver = threading.Thread(target=lambda: seen.append(copy.with_copy_of(2, lambda held: held)))
    saver.start()
    saver.join(0.3)
    assert saver.is_alive()  # the copy of step 2 is not whole: the save waits for the device
    later.run()
    saver.join(5)
    assert not saver.is_alive()
    held = seen[0]
    assert held["step"] == 2
    assert held["w"].tolist() == [2.0, 2.0]
    assert held["w"].data_ptr() != weight.data_ptr()  # the host copy, not the live tensor
    assert copy.with_copy_of(7, lambda held: held) is None  # no copy of that step: the caller takes the live state
    assert HostCopy(torch.device("cpu")).with_copy_of(2, lambda held: held) is None  # a CPU without copies


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


@pytest.mark.parametrize(
    ("rows", "leaving_now", "savers"),
    [
        ([[0, 0], [0, 0], [NOTICE_LEAVING, 1], [0, 1]], [False] * 4, [2]),  # agreed: the late look changes nothing
        (
            [[0, 0], [NOTICE_LEAVING, 0], [0, 1], [0, 1]],
            [False, False, True, True],
            [0],
        ),  # node 0 agreed (its first rank): one is enough
        ([[0, 0], [NOTICE_RESTART, 0], [0, 1], [0, 1]], [False, False, True, True], [2]),  # node 1 learned late
        ([[0, 0], [NOTICE_RESTART, 0], [0, 1], [0, 1]], [False, False, False, True], []),  # only node 1's first decides
        ([[0, 0], [NOTICE_RESTART, 0], [0, 1], [0, 1]], [False] * 4, []),  # a restart: the snapshots carry it
    ],
    ids=["agreed", "agreed-and-late", "late", "late-seen-by-a-second-rank", "restart"],
)
def test_a_node_that_learns_it_leaves_after_the_agreement_still_saves(
    rows: list[list[int]], leaving_now: list[bool], savers: list[int]
) -> None:
    assert [r for r in range(len(rows)) if saves_emergency(r, rows, leaving_now=leaving_now[r])] == savers


def test_a_group_stopped_before_the_leaving_node_knew_still_gets_its_emergency_checkpoint(tmp_path: Path) -> None:
    """Four gloo ranks, two nodes: node 0's agent restarts its workers (rank 1 has its SIGTERM), and node 1's
    leaving marker appears only while its ranks are in the boundary's all-gather, after they shared 0 (the
    timing of a CI run that lost the emergency checkpoint). Node 1's first rank writes it, once."""
    outs = _group(tmp_path, "late-leaving", 4)
    said = [out.read_text().split("\n")[:-1] for out in outs]
    assert said[0] == ["broken"]  # stays: its barrier fails once the others are gone
    assert said[1] == ["snapshot", "exit evicted"]  # its own SIGTERM: a restart, its snapshot carries it
    assert said[2] == ["save", "snapshot", "exit evicted"]
    assert said[3] == ["snapshot", "exit evicted"]


@pytest.mark.parametrize(
    ("in_flight", "kept", "leaving", "waits"),
    [
        (None, 7, False, False),  # nothing in flight
        (10, 12, False, False),  # a survivor whose snapshot is newer: the next round resumes from it
        (10, 10, False, False),
        (10, 12, True, True),  # its node leaves, and the snapshot with it: the save gets its chance
        (10, None, False, True),  # no snapshot was written
        (10, 8, False, True),  # the snapshot is older (--snapshot-every)
    ],
)
def test_a_survivor_leaves_its_save_in_flight_to_its_snapshot(
    in_flight: int | None, kept: int | None, leaving: bool, waits: bool
) -> None:
    assert waits_for_save(in_flight, kept, leaving=leaving) is waits


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


def test_a_gpu_rank_binds_its_group_to_its_device_and_a_cpu_rank_does_not() -> None:
    """device_id makes NCCL create its communicator in init_process_group (set-up), not at the
    first collective inside a step; gloo takes no device."""
    assert group_device(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert group_device(torch.device("cpu")) is None


def test_the_launcher_turns_nccls_teardown_off_for_our_trainer_only_unless_the_user_chose() -> None:
    """Our trainer ends a broken group itself; any other program keeps torch's watchdog (it has none of
    its own): only the flight recorder, evidence of a hang, is set for it."""
    assert worker_environment({}, ours=True) == dict(WORKER_NCCL_DEFAULTS)
    ours = worker_environment({NCCL_ERROR_HANDLING_ENV: "3"}, ours=True)
    assert ours.get(NCCL_ERROR_HANDLING_ENV) is None  # the user's stays
    assert WORKER_NCCL_DEFAULTS[NCCL_ERROR_HANDLING_ENV] == WORKER_NCCL_DEFAULTS[NCCL_RETHROW_ENV] == "0"
    assert worker_environment({}, ours=False) == dict(FLIGHT_RECORDER_DEFAULTS)
    assert NCCL_ERROR_HANDLING_ENV not in FLIGHT_RECORDER_DEFAULTS
    assert NCCL_RETHROW_ENV not in FLIGHT_RECORDER_DEFAULTS
    assert group_timeout(300).total_seconds() > 300  # the step watchdog (300 s) always acts first


def test_the_flight_recorders_size_is_set_by_its_current_name_unless_the_user_set_either() -> None:
    """torch 2.13 warns in every process that makes a group where the size comes by its former name."""
    for ours in (True, False):
        assert worker_environment({}, ours=ours)[FLIGHT_RECORDER_ENV] == "2000"
        (former,) = FORMER_NAMES[FLIGHT_RECORDER_ENV]
        assert FLIGHT_RECORDER_ENV not in worker_environment({former: "0"}, ours=ours)  # the user's, by the old name
        assert FLIGHT_RECORDER_ENV not in worker_environment({FLIGHT_RECORDER_ENV: "0"}, ours=ours)


def test_a_group_made_with_the_launchers_settings_draws_no_warning_from_torch(tmp_path: Path) -> None:
    """A real gloo group in a process with what the launcher gives its workers: torch says nothing of
    them (by the former name it warned in every worker's log)."""
    make_group = (
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "dist.destroy_process_group()\n"
        "print('formed')\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCH_")}
    done = subprocess.run([sys.executable, "-c", make_group], check=False, capture_output=True, text=True, timeout=60,
                          env={**env, **worker_environment(env, ours=True)})  # fmt: skip
    assert done.stdout.strip() == "formed", done.stderr
    assert "Warning" not in done.stderr, done.stderr


def test_an_armed_exit_deadline_ends_a_process_stuck_below_python() -> None:
    """A C call that never returns (here: a lock acquired twice, in C, with the GIL released) cannot keep
    a worker past its deadline; every thread's traceback is left on stderr."""
    stuck = (
        "import threading, sys\n"
        "from torchspot_trainer.recovery.group import arm_exit_deadline\n"
        "arm_exit_deadline(0.5)\n"
        "lock = threading.Lock(); lock.acquire(); lock.acquire()\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", stuck], check=False, capture_output=True, text=True, timeout=30)
    assert time.monotonic() - started < 20
    assert done.returncode == 1
    assert "Timeout" in done.stderr
    assert "lock.acquire" in done.stderr or "line 4" in done.stderr


def test_a_communicator_abort_that_never_returns_does_not_keep_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """`abort_group` gives an NCCL communicator's abort its deadline and goes on without it: a wedged
    driver's abort never returns. NCCL cannot run here (no GPU), so torch.distributed stands in for a
    worker whose default group is NCCL's and whose abort blocks for ever: the only calls the function
    makes. The abort itself is run on a GPU by bench/recovery/nccl_generations.py."""
    never = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", never.wait)
    started = time.monotonic()
    abort_group(deadline=0.2)
    assert time.monotonic() - started < 2.0
    never.set()


def test_without_a_checkpoint_uri_a_re_formed_group_resumes_from_the_nodes_snapshot(tmp_path: Path) -> None:
    """A run with no --checkpoint-uri wrote a snapshot at every loss and then started the next round from
    step 0 (the resume ran only with a checkpoint manager). Now the snapshot is the state; with none,
    the start."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = Group(0, 1, torch.device("cpu"))
        state = {"step": 25, "w": torch.ones(2)}
        found, resumed = find_state(group, None, (Held(base=0, step=25), state))
        assert found == "snapshot"
        assert resumed is not None
        assert resumed["step"] == 25
        assert find_state(group, None, None) == ("start", None)
    finally:
        dist.destroy_process_group()


def test_the_trainer_without_a_checkpoint_uri_trains_with_its_default_checkpoint_schedule(tmp_path: Path) -> None:
    """--checkpoint-every has a default (200) and --checkpoint-uri none: the recovery API refuses a schedule
    without a place, and the trainer once passed it its schedule all the same, so a run with no URI ended
    at its start (bench/recovery's trainer runs have none). With no URI the trainer keeps no checkpoints."""
    events = tmp_path / "events.jsonl"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k != PEER_LOST_ENV}
    env = {**inherited, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}  # fmt: skip  # (a plain launcher's, not ours)
    done = subprocess.run(
        [sys.executable, "-m", "torchspot_trainer", "--dataset", "digits", "--model", "small_cnn", "--data", "",
         "--max-steps", "3", "--workers", "0", "--scheduled-events", "off", "--events-file", str(events)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "done"] == [3]
    assert not [r for r in records if r["event"] == "checkpoint"]


def test_evaluation_runs_under_inference_mode_and_the_runs_autocast(tmp_path: Path) -> None:
    """Evaluation ran in fp32 with autograd's bookkeeping on a bf16 run; now each forward pass is under
    `inference_mode` and the precision's autocast (bf16 autocast runs on the CPU too)."""
    seen: list[tuple[bool, torch.dtype]] = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.linear(x)
            seen.append((torch.is_inference_mode_enabled(), out.dtype))
            return out

    data = [(torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(3)]
    cpu = torch.device("cpu")

    def run(between: Callable[[], bool], sums: Callable[[torch.Tensor], bool]) -> float | None:
        return evaluate(
            Probe(), 6, rank=0, world=1, device=cpu, batch_size=2, load=lambda _batches: iter(data),
            prepare=lambda x: x, between=between, sums=sums, autocast=Precision("bf16", cpu).autocast,
        )  # fmt: skip

    accuracy = run(lambda: False, lambda _counts: True)  # one rank: its counts are the group's
    assert seen == [(True, torch.bfloat16)] * 3
    assert accuracy is not None
    assert 0.0 <= accuracy <= 1.0
    # The group changed during it (a re-form at a batch, or sums that did not complete): no accuracy.
    batches = iter([False, True])
    assert run(lambda: next(batches), lambda _counts: True) is None
    assert len(seen) == 4  # it stopped at the batch where the group changed
    assert run(lambda: False, lambda _counts: False) is None


def test_a_packed_state_unpacks_unchanged_and_a_buffer_of_another_size_is_refused() -> None:
    """`pack` and `unpack`: the two tensors a heal in place sends to each rank that lacks the state."""
    state = training_state()
    sizes, buffer = pack(state, torch.device("cpu"))
    assert sizes.tolist()[1] == buffer.numel()
    assert _same(state, unpack(sizes, buffer))
    with pytest.raises(WireError, match="bytes came in a buffer of"):
        unpack(sizes, buffer[:-16])
