"""The sandbox report's arithmetic on a made-up run (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from torchspot_lab.report import build_report


def _progress(t: float, step: int, world: int = 2) -> dict[str, Any]:
    return {"t": t, "event": "progress", "step": step, "world_size": world, "samples_per_s": 10.0 * world}


def test_steps_lost_and_goodput_count_only_redone_work() -> None:
    events = [
        {"t": 10.0, "event": "start", "step": 0, "world_size": 2},
        *[_progress(10.0 + s, s) for s in range(1, 11)],  # steps 1-10, one per second
        # hard loss: the next group resumes from the checkpoint at step 8; steps 9 and 10 are redone
        {"t": 30.0, "event": "start", "step": 8, "world_size": 1},
        *[_progress(30.0 + s, 8 + s, 1) for s in range(1, 5)],  # steps 9-12
        # notice: resumes exactly where it stopped (12): nothing redone
        {"t": 40.0, "event": "start", "step": 12, "world_size": 2},
        {"t": 40.0, "event": "emergency_checkpoint", "step": 12, "ok": True},
        *[_progress(40.0 + s, 12 + s) for s in range(1, 9)],  # steps 13-20
        {"t": 49.0, "event": "done", "step": 20, "world_size": 2},
    ]
    report = build_report(job="j", submitted=0.0, status={"phase": "Succeeded"}, timeline=[], api_events=[],
                          trainer_events=events, checkpoints=[20], agent_errors=[])  # fmt: skip
    assert [r["lost"] for r in report.restarts] == [0, 2, 0]
    assert report.steps_lost == 2
    assert report.final_step == 20
    assert "samples per step     -" in report.summary()  # the starts here predate step_samples
    # Kept: steps 2-8 of the first group (7 s; step 1 has no earlier line to time it), 10-12 and 14-20 (3 s + 7 s).
    assert report.useful_seconds == pytest.approx(17.0)
    assert report.wall_seconds == 49.0
    assert report.goodput == pytest.approx(17.0 / 49.0, abs=1e-4)
    assert any("emergency checkpoint at step 12 (ok)" in e["text"] for e in report.timeline)
    assert any("2 steps redone" in e["text"] for e in report.timeline)


def test_operator_events_are_placed_on_the_runs_clock() -> None:
    event = {"type": "Warning", "reason": "Evicted", "message": "worker pod w-1 on spot-2: node is gone",
             "lastTimestamp": "2026-11-22T10:00:30Z"}  # fmt: skip
    submitted = 1795341600.0  # 2026-11-22T10:00:00Z
    report = build_report(job="j", submitted=submitted, status={}, timeline=[], api_events=[event],
                          trainer_events=[], checkpoints=[], agent_errors=[])  # fmt: skip
    assert report.timeline == [
        {"t": 30.0, "kind": "k8s", "text": "Warning Evicted: worker pod w-1 on spot-2: node is gone"}
    ]


def test_the_report_says_what_a_step_was() -> None:
    def starts(*sizes: int) -> list[dict[str, Any]]:
        return [{"t": 10.0 * i, "event": "start", "step": i, "world_size": 2, "step_samples": size}
                for i, size in enumerate(sizes)]  # fmt: skip

    def line(events: list[dict[str, Any]]) -> str:
        report = build_report(job="j", submitted=0.0, status={"phase": "Running"}, timeline=[], api_events=[],
                              trainer_events=events, checkpoints=[], agent_errors=[])  # fmt: skip
        return next(x for x in report.summary().splitlines() if x.startswith("samples per step"))

    assert line(starts(48, 48, 48)).endswith("48 (the same at every world size)")
    assert line(starts(48, 32, 48)).endswith("48 -> 32 -> 48 (per-worker batches: changed with the world size)")


def test_the_report_says_which_path_each_resumption_took() -> None:
    """The trainer names the generation of a group it re-formed in place; a restarted group has none."""
    events = [
        {"t": 1.0, "event": "start", "step": 0, "world_size": 3},
        {"t": 5.0, "event": "start", "step": 9, "world_size": 2, "generation": 1, "resumed_from": "live"},
        {"t": 9.0, "event": "start", "step": 20, "world_size": 2, "resumed_from": "snapshot"},
    ]
    report = build_report(job="j", submitted=0.0, status={"phase": "Running"}, timeline=[], api_events=[],
                          trainer_events=events, checkpoints=[], agent_errors=[])  # fmt: skip
    assert [r["path"] for r in report.restarts] == ["restart", "in place", "restart"]
    rounds = [e["text"] for e in report.timeline if e["kind"] == "round"]
    assert rounds == [
        "worker group of 3 training from step 0",
        "worker group of 2 training from step 9, re-formed in place (no process restarted)",
        "worker group of 2 training from step 20, every worker restarted (a node's local snapshot)",
    ]
    assert "resumptions          1 in place (no process restarted), 1 by restarting every worker" in report.summary()
