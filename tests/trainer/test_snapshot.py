"""Node-local snapshots: which rank's copy a round resumes from, and the file itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torchspot_trainer.elastic.leaving import Leaving
from torchspot_trainer.recovery.snapshot import Held, LocalSnapshot, choose_source, default_path, snapshot_path

CHOICES = [
    ("nobody holds one", [None, None], 40, None),
    ("a survivor's newer step beats the checkpoint", [Held(40, 47), None], 40, (0, Held(40, 47))),
    ("equal to the checkpoint: the local copy (no Blob read)", [None, Held(40, 40)], 40, (1, Held(40, 40))),
    ("older than the checkpoint: Blob", [Held(20, 30), None], 40, None),
    ("no checkpoint yet", [None, Held(0, 9)], None, (1, Held(0, 9))),
    ("the lowest rank among equals", [None, Held(40, 47), Held(40, 47)], 40, (1, Held(40, 47))),
    ("the newest step among one round's survivors", [Held(40, 46), Held(40, 47)], 40, (1, Held(40, 47))),
    # A node cut off from its group trained on alone from an older round: its higher step loses.
    ("a stale line loses to the newer round", [Held(30, 58), Held(45, 50)], 45, (1, Held(45, 50))),
]


@pytest.mark.parametrize(("case", "held", "committed", "expected"), CHOICES, ids=[c[0] for c in CHOICES])
def test_choose_source(
    case: str, held: list[Held | None], committed: int | None, expected: tuple[int, Held] | None
) -> None:
    assert choose_source(held, committed) == expected


def _state(step: int) -> dict[str, object]:
    return {"model": {"w": torch.arange(4.0)}, "step": step, "rng": {"torch": torch.zeros(2, dtype=torch.uint8)}}


def test_write_read_remove(tmp_path: Path) -> None:
    snapshot = LocalSnapshot(tmp_path / "node" / "snap.pt")
    assert snapshot.read() is None
    assert snapshot.write(_state(12), base=10) is not None
    read = snapshot.read()
    assert read is not None
    held, state = read
    assert held == Held(10, 12)
    assert torch.equal(state["model"]["w"], torch.arange(4.0))
    assert not list((tmp_path / "node").glob("*.partial"))
    snapshot.remove()
    assert snapshot.read() is None


def test_a_corrupt_snapshot_is_skipped_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "snap.pt"
    snapshot = LocalSnapshot(path)
    snapshot.write(_state(5), base=0)
    path.write_bytes(path.read_bytes()[:100])  # cut short, as by a crash mid-write without the rename
    assert snapshot.read() is None


def test_an_unwritable_folder_costs_the_snapshot_only(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert LocalSnapshot(blocker / "snap.pt").write(_state(5), base=0) is None


def test_paths_differ_per_agent_and_run_and_take_the_folder_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert snapshot_path(tmp_path, "job-a", 100) != snapshot_path(tmp_path, "job-a", 101)
    assert snapshot_path(tmp_path, "job-a", 100) != snapshot_path(tmp_path, "job-b", 100)
    assert snapshot_path(tmp_path, "../x", 1).parent == tmp_path  # a run id cannot leave the folder
    environ = {"TORCHSPOT_SNAPSHOT_DIR": str(tmp_path), "TORCHELASTIC_RUN_ID": "r1"}
    assert default_path(environ).parent == tmp_path


def test_a_node_keeps_one_copy_written_by_the_first_of_its_local_ranks(tmp_path: Path) -> None:
    """Eight local ranks stopping at once (threads: `flock` locks of separate opens exclude each
    other as processes' do) write one file, once; the next round's ranks write it anew."""
    path = tmp_path / "node.pt"
    round_started = time.time()
    ranks = [LocalSnapshot(path, round_started=round_started) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        took = list(pool.map(lambda s: s[1].write(_state(30 + s[0]), base=20), enumerate(ranks)))
    assert sum(t is not None for t in took) == 1
    assert all(rank.written_this_round() for rank in ranks)  # what each may leave its save in flight to
    written = next(i for i, t in enumerate(took) if t is not None)
    read = ranks[5].read()  # every local rank reads the node's one file
    assert read is not None
    assert read[0] == Held(20, 30 + written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.pt", "node.pt.lock"]
    next_round = LocalSnapshot(path, round_started=time.time() + 1)
    assert not next_round.written_this_round()  # the file is the last round's
    assert next_round.write(_state(44), base=30) is not None
    again = next_round.read()
    assert again is not None
    assert again[0] == Held(30, 44)
    next_round.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_second_way_out_waits_for_the_first_ones_snapshot_write(tmp_path: Path) -> None:
    """A worker's main thread leaving (a collective failed) and its SIGTERM watcher's stuck exit may both keep
    the snapshot: the second waits for the first one's write rather than return to an exit that ends the
    process mid-write (a bench's join, where a peer was also judged lost, resumed 21 steps back so)."""
    building = threading.Event()

    def write_from(writer: Callable[[dict[str, object] | None], float | None]) -> float | None:
        building.set()
        time.sleep(0.5)  # (the state built and saved)
        return writer({"torchspot": {"step": 7}, "weights": torch.ones(3)})

    path = tmp_path / "snapshot.pt"
    leaving = Leaving(hold=1.0, events_at=None, emit=lambda *_a, **_k: None, kept=lambda: (7, write_from),
                      before_exit=lambda: None, snapshot=LocalSnapshot(path),
                      step_of=lambda state: int(state["torchspot"]["step"]))  # fmt: skip
    try:
        first = threading.Thread(target=leaving.keep_snapshot)
        first.start()
        assert building.wait(10)
        leaving.keep_snapshot()  # the second way out
        written = LocalSnapshot(path).read()
        assert written is not None
        assert written[0] == Held(7, 7)
        first.join(10)
    finally:
        leaving.close()
