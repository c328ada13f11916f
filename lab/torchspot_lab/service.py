"""A local server process (etcd, Azurite) that the lab starts, stops and restarts."""

from __future__ import annotations

import subprocess
from types import TracebackType
from typing import Self


class LocalService:
    """Owns one server process; subclasses implement `start()` and set `_proc`.

    Stopping sends SIGTERM, then SIGKILL after `stop_timeout` seconds, and waits, so a
    test or benchmark never leaves a server running behind it.
    """

    stop_timeout = 10.0
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (benchmarks account its CPU time)."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the server and return once it answers."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it to exit."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
