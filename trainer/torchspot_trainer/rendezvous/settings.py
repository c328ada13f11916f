"""Settings of the `etcd-v3` rendezvous backend, parsed from torchrun's flags.

Pure functions only: the launcher calls them before it starts anything, so a bad
flag stops it with a message that names the flag, and the backend factory calls
them again for the same values when torch builds the handler.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

BACKEND_NAME = "etcd-v3"
"""The name passed to `--rdzv-backend`."""

KEY_ROOT = "/torchspot/rdzv"
"""All rendezvous keys live under KEY_ROOT/<run id>/ so one run never sees another's."""

DEFAULT_ETCD_PORT = 2379
"""etcd's registered client port, used when `--rdzv-endpoint` names only a host."""

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$|^\[[0-9A-Fa-f:.]+\]$")

# torchrun always adds `timeout` (its --rdzv-timeout, 900 s by default) for the
# legacy backends; we accept it as the join timeout when join_timeout is not set.
_TORCHRUN_INJECTED = frozenset({"timeout"})


@dataclass(frozen=True)
class EtcdV3Settings:
    """Everything the backend needs; each field is a `--rdzv-conf` key of the same name."""

    host: str
    port: int
    run_id: str
    connect_timeout: float = 10.0
    """Seconds to wait for etcd at start-up before failing with an error that names it."""
    request_timeout: float = 5.0
    """Seconds one etcd request may take, so a hung etcd cannot hang the agent."""
    keep_alive_interval: float = 1.0
    """Seconds between heartbeats. torch's default is 5; a frozen node is detected after
    keep_alive_interval x keep_alive_max_attempt, so we default to 3 s instead of 15 s."""
    keep_alive_max_attempt: int = 3
    """Missed heartbeats after which a node is considered dead and the group re-forms. The
    backstop: liveness_timeout judges sooner."""
    liveness_interval: float = 0.2
    """Seconds between puts of each agent's own liveness key (liveness.py), which every agent
    watches. Each put is one etcd revision: 5 a second per node."""
    liveness_timeout: float = 1.0
    """Seconds without a node's liveness put after which it is taken out of the round (liveness.py);
    0 leaves detection to torch's heartbeat alone (dead_after)."""
    join_timeout: float = 900.0
    """Seconds a node waits to join a round before giving up (torchrun's --rdzv-timeout)."""
    last_call_timeout: float = 2.0
    """Seconds to wait for more nodes once min_nodes have joined. torch's default of 30 s
    is added to every recovery; late nodes join the next round anyway."""
    close_timeout: float = 30.0
    """Seconds allowed to mark the rendezvous closed at shutdown."""
    heartbeat_timeout: float = 5.0
    """Seconds one heartbeat write may take."""
    lease_ttl: int = 600
    """Seconds after the last live agent stops refreshing it that a run's keys expire.
    Abandoned runs (every agent killed) clean themselves up after this long."""
    store_poll_interval: float = 0.02
    """Seconds between polls while the key-value store waits for a key."""
    cacert: str = ""
    """PEM file of the CA that signed etcd's server certificate: set, the backend speaks TLS
    (torch's etcd backends use the same key names)."""
    cert: str = ""
    """PEM file of this client's certificate, for an etcd that demands one (`--client-cert-auth`)."""
    key: str = ""
    """PEM file of that certificate's private key."""
    state_poll_interval: float = 0.25
    """Seconds between reads of the rendezvous state while an agent waits for other nodes,
    and the longest it serves a cached state. torch reads every 1 s, and a round takes
    several of those waits in a row; each agent reads one small key 4 times a second here."""

    @property
    def endpoint(self) -> str:
        """`host:port`, as users wrote it."""
        return f"{self.host}:{self.port}"

    @property
    def run_prefix(self) -> str:
        """The etcd prefix that holds this run's state and store (with a trailing slash)."""
        return f"{KEY_ROOT}/{self.run_id}/"

    @property
    def dead_after(self) -> float:
        """Seconds without a heartbeat after which a node counts as gone."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


def parse_endpoint(text: str) -> tuple[str, int]:
    """Split `host[:port]`, raising ValueError that names `--rdzv-endpoint`."""
    text = text.strip()
    if not text:
        raise ValueError("--rdzv-endpoint is required for the etcd-v3 backend (host:port of etcd)")
    if "://" in text:
        raise ValueError(f"--rdzv-endpoint {text!r}: give host:port without a scheme")
    host, sep, port_text = text.rpartition(":")
    if not sep or host.endswith(":"):
        host, port_text = text, str(DEFAULT_ETCD_PORT)
    if not _HOST.match(host):
        raise ValueError(f"--rdzv-endpoint {text!r}: {host!r} is not a valid host name")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"--rdzv-endpoint {text!r}: port must be a number from 1 to 65535")
    return host, int(port_text)


def _number(key: str, raw: object, kind: type[float] | type[int], minimum: float) -> float | int:
    try:
        value = kind(str(raw))
    except ValueError:
        name = "an integer" if kind is int else "a number"
        raise ValueError(f"--rdzv-conf {key}={raw!r}: must be {name}") from None
    if value < minimum:
        raise ValueError(f"--rdzv-conf {key}={raw!r}: must be at least {minimum:g}")
    return value


_FILES = ("cacert", "cert", "key")
"""The `--rdzv-conf` keys that name files (TLS), not numbers."""
_MINIMUMS: dict[str, float] = {
    "connect_timeout": 0.1,
    "request_timeout": 0.1,
    "keep_alive_interval": 0.1,
    "keep_alive_max_attempt": 1,
    "liveness_interval": 0.05,
    "liveness_timeout": 0,
    "join_timeout": 1,
    "last_call_timeout": 0,
    "close_timeout": 1,
    "heartbeat_timeout": 0.1,
    "lease_ttl": 2,
    "store_poll_interval": 0.001,
    "state_poll_interval": 0.01,
}


def parse_settings(endpoint: str, run_id: str, conf: Mapping[str, object]) -> EtcdV3Settings:
    """Build settings from `--rdzv-endpoint`, `--rdzv-id` and `--rdzv-conf`.

    Raises ValueError with a message that names the offending flag or key.
    """
    host, port = parse_endpoint(endpoint)
    if not _RUN_ID.match(run_id or ""):
        raise ValueError(
            f"--rdzv-id {run_id!r}: use 1-253 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    known = {f.name: f for f in fields(EtcdV3Settings)} | dict.fromkeys(_TORCHRUN_INJECTED)
    values: dict[str, float | int] = {}
    texts: dict[str, str] = {}
    for key, raw in conf.items():
        if key not in known or key in ("host", "port", "run_id"):
            allowed = ", ".join(sorted([*_MINIMUMS, *_FILES]))
            raise ValueError(f"--rdzv-conf {key}: unknown key for etcd-v3 (known: {allowed})")
        if key == "timeout":
            continue
        if key in _FILES:
            texts[key] = str(raw)
            continue
        kind: type[float] | type[int] = int if key in ("keep_alive_max_attempt", "lease_ttl") else float
        values[key] = _number(key, raw, kind, _MINIMUMS[key])
    if "join_timeout" not in values and "timeout" in conf:
        values["join_timeout"] = _number("timeout", conf["timeout"], float, _MINIMUMS["join_timeout"])
    settings = EtcdV3Settings(host=host, port=port, run_id=run_id, **values, **texts)  # type: ignore[arg-type]
    if (settings.cert or settings.key) and not settings.cacert:
        raise ValueError("--rdzv-conf cert and key need cacert (the CA that signed etcd's certificate)")
    if bool(settings.cert) != bool(settings.key):
        raise ValueError("--rdzv-conf cert and key: give both (the client certificate and its key) or neither")
    if settings.liveness_timeout and settings.liveness_timeout < 3 * settings.liveness_interval:
        raise ValueError(
            f"--rdzv-conf liveness_timeout={settings.liveness_timeout:g}: must be 0 (off) or at least "
            f"three liveness_interval ({3 * settings.liveness_interval:g} s), or one late put drops a live node"
        )
    if settings.lease_ttl < 2 * settings.dead_after:
        raise ValueError(
            f"--rdzv-conf lease_ttl={settings.lease_ttl}: must be at least twice "
            f"keep_alive_interval x keep_alive_max_attempt ({settings.dead_after:g} s), "
            "or live runs would lose their keys"
        )
    return settings
