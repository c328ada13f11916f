"""Where the trainer's records go (progress.py builds them): one JSON line each on stdout and appended to
`--events-file`, a readable line on a terminal's stderr, and the progress figures to TensorBoard where
`--tensorboard` opened it. The operator's sandbox, the benchmarks and the tests read the JSON lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchspot_trainer.elastic.records import write_record
from torchspot_trainer.progress import format_progress

__all__ = ["Events"]


class Events:
    """The trainer's record output. `events_file`: appends every record there too (empty: not)."""

    def __init__(self, events_file: str) -> None:
        self._file = Path(events_file) if events_file else None
        self._tensorboard: Any = None

    def write(self, record: dict[str, Any]) -> None:
        """One record (elastic/records.py's `write_record`), a progress record readable on a terminal."""
        write_record(record, events=self._file, stdout=True, readable=_readable)

    def open_tensorboard(self, folder: str) -> None:
        """Write the progress figures to TensorBoard in `folder` too (`scalars`); stops the worker with the
        reason where the tensorboard package is not installed."""
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
        except ImportError as exc:
            raise SystemExit(f"--tensorboard {folder}: install the tensorboard package") from exc
        self._tensorboard = SummaryWriter(folder)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """A step's figures to TensorBoard, where it is open."""
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


def _readable(record: dict[str, Any]) -> str | None:
    """A progress record as a terminal shows it (its figures); None for any other (its JSON line)."""
    return format_progress(record) if record.get("event") == "progress" else None
