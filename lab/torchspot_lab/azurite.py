"""Azurite, Microsoft's Azure Storage emulator, serving Blob on loopback.

Installed from npm into the repository's `node_modules/` by the Makefile. The account
and key are Azurite's documented development credentials (public, and accepted only
by the emulator), so tests and the sandbox can use real Azure Blob API calls.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from torchspot_lab.etcd import free_port
from torchspot_lab.service import LocalService

ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development key (published in its README; not a secret)."""

CHECKOUT_ROOT = Path(__file__).resolve().parents[2]
"""The repository root when this runs from a checkout (azurite.py)."""


def azurite_binary() -> str:
    """The `azurite-blob` launcher from a checkout's node_modules (`make venv` runs npm install there),
    the current folder's (an installed wheel run from a checkout), or PATH."""
    for root in (CHECKOUT_ROOT, Path.cwd()):
        local = root / "node_modules" / ".bin" / "azurite-blob"
        if local.exists():
            return str(local)
    found = shutil.which("azurite-blob")
    if found is None:
        raise FileNotFoundError("azurite-blob not found: run `make venv` (it runs npm install)")
    return found


class Azurite(LocalService):
    """An Azurite Blob server with its data in `location`.

    :param location: folder for Azurite's data and its log.
    """

    def __init__(self, location: Path) -> None:
        self.location = location
        self.port = free_port()

    @property
    def account_url(self) -> str:
        """The Blob endpoint of the development account."""
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        """A connection string for azure-storage-blob (AZURE_STORAGE_CONNECTION_STRING)."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={DEV_KEY};BlobEndpoint={self.account_url};"
        )

    def env(self) -> dict[str, str]:
        """Environment variables that point torchspot's Blob storage here."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def start(self, timeout: float = 30.0) -> None:
        """Start Azurite and wait until it answers HTTP."""
        self.location.mkdir(parents=True, exist_ok=True)
        cmd = [
            azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--location", str(self.location), "--skipApiVersionCheck", "--loose", "--disableTelemetry",
        ]  # fmt: skip
        with (self.location / "azurite.log").open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"azurite exited with {self._proc.returncode}; see {self.location}/azurite.log")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=1)
            except urllib.error.HTTPError:
                return  # it answered (400 for a bare GET): up
            except OSError:
                time.sleep(0.1)
                continue
            return
        self.stop()
        raise TimeoutError(f"azurite did not answer on port {self.port} within {timeout:g} s")
