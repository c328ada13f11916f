"""The training program under torchspot-run: real etcd, real agents, Azurite checkpoints.

Correctness is judged on scikit-learn's bundled digits (real handwriting nobody
here wrote): the same seed, run once without interruption and once through an
eviction with notice (SIGTERM to the node's agent, as the kubelet sends) and a hard
one (SIGKILL of the whole tree), must end within one accuracy point, and the
notice eviction must not make any step run twice.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from torchspot.lab.azurite import Azurite
from torchspot.lab.etcd import EtcdServer
from torchspot.lab.imds import FakeImds
from torchspot.lab.local import JobConfig, LocalNode, NodeFactory, read_events, wait_for
from torchspot.trainer.checkpoint import read_latest
from torchspot.trainer.storage import open_storage

pytestmark = pytest.mark.slow

EPOCHS = 8


def _job(tmp: Path, etcd: EtcdServer, azurite: Azurite, run_id: str, *, nnodes: str = "1:3", **extra: str) -> JobConfig:
    events = tmp / "train-events.jsonl"
    program = [
        "-m", "torchspot.trainer", "--dataset", "digits", "--model", "small_cnn", "--data", "",
        "--epochs", str(EPOCHS), "--batch-size", "16", "--lr", "0.05", "--optimizer", "sgd",
        "--seed", "0", "--workers", "0", "--log-every", "1", "--checkpoint-every", "10",
        "--checkpoint-uri", f"az://ckpt/{run_id}", "--scheduled-events", "off",
        "--events-file", str(events), "--notice-hold", "60",
    ]  # fmt: skip
    for key, value in extra.items():
        program += [f"--{key.replace('_', '-')}", value]
    return JobConfig(
        workdir=tmp, backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, nnodes=nnodes,
        extra_env=azurite.env(), program=program,
    )  # fmt: skip


def _progress(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "progress"]


def _final(events: list[dict[str, Any]]) -> dict[str, Any]:
    done = [e for e in events if e.get("event") == "done"]
    assert done, "training did not finish"
    return done[-1]


def _wait_exit(nodes: list[LocalNode], timeout: float = 240) -> list[int]:
    codes = []
    for node in nodes:
        try:
            codes.append(node.wait(timeout))
        except Exception:
            pytest.fail(f"{node.name} did not finish:\n{node.log_tail(60)}")
    return codes


def test_digits_accuracy_survives_two_evictions_and_notice_loses_no_step(
    tmp_path: Path, etcd: EtcdServer, azurite: Azurite, run_id: str, nodes: NodeFactory
) -> None:
    baseline = _job(tmp_path / "baseline", etcd, azurite, run_id + "-base")
    assert _wait_exit(nodes(baseline, 3)) == [0, 0, 0]
    base_events = read_events(tmp_path / "baseline" / "train-events.jsonl")
    base_acc = _final(base_events)["test_accuracy"]
    assert base_acc > 0.9  # the model learned: the comparison below means something

    elastic = _job(tmp_path / "elastic", etcd, azurite, run_id + "-elastic")
    events_path = tmp_path / "elastic" / "train-events.jsonl"
    started = nodes(elastic, 3)
    wait_for(lambda: any(e["step"] >= 25 and e["world_size"] == 3 for e in _progress(read_events(events_path))),
             120, "25 steps at world size 3")  # fmt: skip

    # Eviction with notice: the kubelet's SIGTERM to the node, SIGKILL after 30 s.
    notice_at = time.time()
    started[2].terminate(grace=30)
    wait_for(lambda: any(e["world_size"] == 2 and e["t"] > notice_at for e in _progress(read_events(events_path))),
             90, "training at world size 2")  # fmt: skip
    # The leaving node writes it while the others re-form: it may come after their first step.
    emergency = wait_for(lambda: [e for e in read_events(events_path) if e.get("event") == "emergency_checkpoint"],
                         30, "the leaving node's emergency checkpoint")  # fmt: skip
    assert emergency[-1]["ok"]
    assert '"event": "emergency_checkpoint"' in started[2].log_path.read_text(errors="replace")  # written by it
    events = read_events(events_path)
    steps = Counter(e["step"] for e in _progress(events))
    assert [s for s, n in steps.items() if n > 1] == [], "a step ran twice after an eviction with notice"
    resumed = [e for e in events if e.get("event") == "start" and e["t"] > notice_at]
    assert resumed[0]["step"] == emergency[-1]["step"]
    # Its agent took itself out of the rendezvous (the others did not wait for its heartbeats).
    assert "left it (this node is going)" in started[2].log_path.read_text(errors="replace")

    # Hard eviction: the node vanishes with its workers.
    wait_for(lambda: max(e["step"] for e in _progress(read_events(events_path))) >= emergency[-1]["step"] + 20,
             120, "20 more steps")  # fmt: skip
    last_before = max(e["step"] for e in _progress(read_events(events_path)))
    hard_at = time.time()
    started[1].kill()
    assert _wait_exit([started[0]]) == [0]
    # The survivor resumed from its own copy of the state at its last completed step, not from
    # the last Blob checkpoint up to 10 steps back: at most the step in flight is redone.
    after_hard = [e for e in read_events(events_path) if e.get("event") == "start" and e["t"] > hard_at]
    assert after_hard[0]["resumed_from"] == "snapshot", after_hard
    assert after_hard[0]["step"] >= last_before
    elastic_acc = _final(read_events(events_path))["test_accuracy"]
    assert abs(elastic_acc - base_acc) <= 0.01, (base_acc, elastic_acc)

    latest = read_latest(open_storage(f"az://ckpt/{run_id}-elastic", azurite.env()))
    assert latest is not None
    assert latest["step"] == _final(read_events(events_path))["step"]


def test_blob_outage_during_training_does_not_stop_it(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """Azurite goes away mid-run: saves fail and are reported, training goes on, and
    once Blob is back the next checkpoint commits."""
    blob = Azurite(tmp_path / "azurite")
    blob.start()
    try:
        job = _job(tmp_path, etcd, blob, run_id, nnodes="1:1", checkpoint_retries="2", epochs="30")
        events_path = tmp_path / "train-events.jsonl"
        (node,) = nodes(job, 1)
        wait_for(lambda: any(e.get("event") == "checkpoint" and e["ok"] for e in read_events(events_path)), 120,
                 "a committed checkpoint")  # fmt: skip
        blob.stop()
        outage = time.time()
        wait_for(lambda: any(e.get("event") == "checkpoint" and not e["ok"] and e["t"] > outage
                             for e in read_events(events_path)), 120, "a failed save")  # fmt: skip
        failed_at = max(e["step"] for e in _progress(read_events(events_path)))
        wait_for(lambda: max(e["step"] for e in _progress(read_events(events_path))) >= failed_at + 15, 60,
                 "training to continue during the outage")  # fmt: skip
        errors = [e["checkpoint_error"] for e in _progress(read_events(events_path)) if e["t"] > outage]
        assert any(errors), "the progress line never reported the failing save"
        skipped = [
            e for e in read_events(events_path) if e.get("event") == "checkpoint" and "skipped" in (e["error"] or "")
        ]
        assert skipped, "training waited for saves that could not succeed instead of skipping them"
        blob.start()
        back = time.time()
        # The save in flight during the outage (an older step) may commit first; then newer ones do.
        wait_for(lambda: any(e.get("event") == "checkpoint" and e["ok"] and e["t"] > back and e["step"] > failed_at
                             for e in read_events(events_path)), 120, "a newer checkpoint")  # fmt: skip
        latest = read_latest(open_storage(f"az://ckpt/{run_id}", blob.env()))
        node.kill()
    finally:
        blob.stop()
    assert latest is not None
    assert latest["step"] > failed_at


def test_scheduled_preempt_triggers_emergency_checkpoint_then_approval(
    tmp_path: Path, etcd: EtcdServer, azurite: Azurite, run_id: str, nodes: NodeFactory
) -> None:
    """A Preempt event for this VM (from a stand-in metadata server: IMDS cannot run
    here) makes the trainer checkpoint at once and then approve the event."""
    imds = FakeImds()
    try:
        job = _job(tmp_path, etcd, azurite, run_id, nnodes="1:1", scheduled_events=imds.events_url,
                   vm_name="aks-spot-vmss_3", notice_hold="2", epochs="3",
                   tensorboard=str(tmp_path / "tb"))  # fmt: skip
        events_path = tmp_path / "train-events.jsonl"
        (node,) = nodes(job, 1)
        wait_for(lambda: any(e.get("event") == "progress" and e["step"] >= 15 for e in read_events(events_path)), 120,
                 "15 steps")  # fmt: skip
        imds.preempt("EV-7")
        wait_for(lambda: imds.posts, 60, "the approval of the event")
        assert node.wait(180) == 0  # nobody evicted the VM: after the hold, training finished
    finally:
        imds.close()
    events = read_events(events_path)
    emergency = [e for e in events if e.get("event") == "emergency_checkpoint"]
    assert len(emergency) == 1
    assert emergency[0]["ok"]
    assert imds.posts == [{"StartRequests": [{"EventId": "EV-7"}]}]
    approved_after = [e for e in events if e.get("event") == "notice_expired"]
    assert approved_after
    assert approved_after[0]["step"] == emergency[0]["step"]
    latest = read_latest(open_storage(f"az://ckpt/{run_id}", azurite.env()))
    assert latest is not None
    assert latest["step"] == _final(events)["step"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "--tensorboard wrote no event file"
