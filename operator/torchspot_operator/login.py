"""Credentials for the Kubernetes API, wherever the operator or the CLI runs.

kopf's own `login_with_kubeconfig` reads a kubeconfig's static fields only: it knows no
exec plugin (kubelogin, which AKS with Entra ID needs, and `az aks get-credentials`
writes), no `tokenFile`, and resolves no relative path. Both the operator (its kopf
login handler) and `torchspot evict` log in here instead, as kubectl would:

- in a pod, the service account: its token file is re-read at every login, and every
  login is given an expiry (`TOKEN_REREAD_SECONDS`) so kopf logs in again and picks up
  the token the kubelet rotates (bound tokens live an hour);
- outside, the kubeconfig (`KUBECONFIG`, several files merged, or ~/.kube/config): the
  current context's cluster (server, CA file or inline data, `insecure-skip-tls-verify`,
  `proxy-url`) and user (token, `tokenFile`, client certificate and key as files or
  inline data, basic auth, an `exec` plugin's ExecCredential, a legacy auth provider's
  cached access token). Relative paths are relative to the kubeconfig file.

The result is kopf's `ConnectionInfo`; `Kube.from_connection` builds the HTTP session
from it with kopf's own helpers (SSL context, headers), so inline CA data is decoded
once, the kopf way. Secrets (tokens, keys) are never logged.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import kopf
import yaml

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_SERVER: Final = "https://kubernetes.default.svc"
TOKEN_REREAD_SECONDS: Final = 300
"""How long a token read from a file is used before logging in again (re-reading it). The
kubelet rewrites a projected service-account token at 80% of its life (48 minutes of an
hour); five minutes keeps the operator well inside that."""
EXEC_TIMEOUT_SECONDS: Final = 60
"""How long an exec plugin may take (kubelogin may open a device-code flow; kubectl waits too)."""
EXEC_API_VERSIONS: Final = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")


class LoginError(RuntimeError):
    """The kubeconfig or service account cannot be used; the message says what and where."""


@dataclass(frozen=True)
class _Kubeconfig:
    """The merged kubeconfig's current context: cluster, user and namespace, with each file's folder."""

    cluster: Mapping[str, Any]
    cluster_dir: Path
    user: Mapping[str, Any]
    user_dir: Path
    namespace: str | None


def kubeconfig_paths(env: Mapping[str, str] | None = None) -> list[Path]:
    """The kubeconfig files kubectl would read: `KUBECONFIG` (os.pathsep-separated) or ~/.kube/config."""
    env = os.environ if env is None else env
    listed = [Path(p).expanduser() for p in env.get("KUBECONFIG", "").split(os.pathsep) if p.strip()]
    if listed:
        return listed
    default = Path("~/.kube/config").expanduser()
    return [default] if default.exists() else []


def _merged(paths: list[Path]) -> _Kubeconfig:
    """Merge as kubectl does (the first file to define a name wins) and pick the current context."""
    current: str | None = None
    named: dict[str, dict[str, tuple[Mapping[str, Any], Path]]] = {"contexts": {}, "clusters": {}, "users": {}}
    inner = {"contexts": "context", "clusters": "cluster", "users": "user"}
    for path in paths:
        if not path.exists():
            continue  # kubectl skips a listed file that does not exist
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise LoginError(f"kubeconfig {path}: cannot be read: {exc}") from exc
        current = current or config.get("current-context")
        for section, key in inner.items():
            for item in config.get(section) or []:
                named[section].setdefault(str(item.get("name")), (item.get(key) or {}, path.parent))
    if not current:
        raise LoginError(f"kubeconfig {os.pathsep.join(map(str, paths))}: no current-context")
    if current not in named["contexts"]:
        raise LoginError(f"kubeconfig: current-context {current!r} is not defined")
    context = named["contexts"][current][0]
    cluster_name, user_name = str(context.get("cluster")), str(context.get("user", ""))
    if cluster_name not in named["clusters"]:
        raise LoginError(f"kubeconfig: context {current!r} names cluster {cluster_name!r}, which is not defined")
    cluster, cluster_dir = named["clusters"][cluster_name]
    user, user_dir = named["users"].get(user_name, ({}, cluster_dir))
    return _Kubeconfig(cluster, cluster_dir, user, user_dir, context.get("namespace"))


def _path(value: Any, folder: Path) -> str | None:
    """A path from the kubeconfig, relative to the file that gave it."""
    return None if not value else str(folder / Path(str(value)).expanduser())


def exec_credential(spec: Mapping[str, Any], *, folder: Path, server: str) -> dict[str, Any]:
    """Run a kubeconfig's `exec` plugin (kubelogin, `aws eks get-token`, ...); its ExecCredential status.

    The plugin gets KUBERNETES_EXEC_INFO as kubectl gives it; its stderr goes to ours
    (a device-code prompt must reach the user); a failure or a malformed answer is a
    LoginError that names the command, never the credential.
    """
    command = str(spec.get("command", ""))
    if not command:
        raise LoginError("kubeconfig: the user's exec plugin has no command")
    api_version = str(spec.get("apiVersion", EXEC_API_VERSIONS[0]))
    if api_version not in EXEC_API_VERSIONS:
        raise LoginError(f"kubeconfig: exec plugin {command!r}: apiVersion {api_version!r} is not supported")
    if "/" in command and not Path(command).is_absolute():
        command = str(folder / command)  # kubectl: a relative path with a slash is relative to the file
    env = dict(os.environ)
    env.update({str(e["name"]): str(e["value"]) for e in spec.get("env") or []})
    info = {"apiVersion": api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
    if spec.get("provideClusterInfo"):
        info["spec"] = {"interactive": False, "cluster": {"server": server}}
    env["KUBERNETES_EXEC_INFO"] = json.dumps(info)
    try:
        done = subprocess.run(  # the kubeconfig's own command, as kubectl runs it
            [command, *map(str, spec.get("args") or [])],
            env=env,
            stdout=subprocess.PIPE,
            check=False,
            timeout=EXEC_TIMEOUT_SECONDS,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        hint = f" ({spec['installHint']})" if spec.get("installHint") else ""
        raise LoginError(f"kubeconfig: exec plugin {command!r} could not run: {exc}{hint}") from exc
    if done.returncode != 0:
        raise LoginError(f"kubeconfig: exec plugin {command!r} exited with {done.returncode}")
    try:
        answer = json.loads(done.stdout)
        status: dict[str, Any] = dict(answer["status"])
    except (ValueError, KeyError, TypeError) as exc:
        raise LoginError(f"kubeconfig: exec plugin {command!r} did not print an ExecCredential with a status") from exc
    if not status.get("token") and not (status.get("clientCertificateData") and status.get("clientKeyData")):
        raise LoginError(f"kubeconfig: exec plugin {command!r} gave neither a token nor a client certificate")
    return status


def _expiry(text: Any) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError as exc:
        raise LoginError(f"kubeconfig: exec plugin gave an unreadable expirationTimestamp {text!r}") from exc


def login_with_kubeconfig(
    env: Mapping[str, str] | None = None, *, trust_env: bool = False
) -> kopf.ConnectionInfo | None:
    """Credentials from the kubeconfig kubectl would use; None if there is none."""
    paths = kubeconfig_paths(env)
    if not paths:
        return None
    config = _merged(paths)
    cluster, user = config.cluster, config.user
    server = str(cluster.get("server", "")).rstrip("/")
    if not server:
        raise LoginError("kubeconfig: the current context's cluster has no server")
    token = user.get("token") or ((user.get("auth-provider") or {}).get("config") or {}).get("access-token")
    expiration: datetime | None = None
    cert_path = _path(user.get("client-certificate"), config.user_dir)
    key_path = _path(user.get("client-key"), config.user_dir)
    cert_data, key_data = user.get("client-certificate-data"), user.get("client-key-data")
    if not token and user.get("tokenFile"):
        token_file = Path(_path(user["tokenFile"], config.user_dir) or "")
        token = _read_token(token_file)
        expiration = datetime.now(UTC) + timedelta(seconds=TOKEN_REREAD_SECONDS)
    if user.get("exec"):
        status = exec_credential(user["exec"], folder=config.user_dir, server=server)
        token = status.get("token") or token
        if status.get("clientCertificateData"):
            cert_path, key_path = None, None
            cert_data, key_data = status["clientCertificateData"], status["clientKeyData"]
        expiration = _expiry(status.get("expirationTimestamp"))
    return kopf.ConnectionInfo(
        server=server,
        ca_path=_path(cluster.get("certificate-authority"), config.cluster_dir),
        ca_data=cluster.get("certificate-authority-data"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")) or None,
        certificate_path=cert_path,
        certificate_data=cert_data,
        private_key_path=key_path,
        private_key_data=key_data,
        username=user.get("username"),
        password=user.get("password"),
        token=token or None,
        default_namespace=config.namespace,
        proxy_url=cluster.get("proxy-url"),
        trust_env=trust_env,
        expiration=expiration,
    )


def _read_token(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise LoginError(f"token file {path}: cannot be read: {exc}") from exc


def login_with_service_account(
    folder: Path = SERVICE_ACCOUNT_DIR, *, trust_env: bool = False
) -> kopf.ConnectionInfo | None:
    """The pod's service account (None outside a pod), read afresh, valid for `TOKEN_REREAD_SECONDS`."""
    token_file = folder / "token"
    if not token_file.exists():
        return None
    namespace_file, ca_file = folder / "namespace", folder / "ca.crt"
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    server = IN_CLUSTER_SERVER
    if host:  # what the kubelet tells every pod (kubectl's in-cluster config reads the same)
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    return kopf.ConnectionInfo(
        server=server,
        ca_path=str(ca_file) if ca_file.exists() else None,
        token=_read_token(token_file) or None,
        default_namespace=namespace_file.read_text().strip() if namespace_file.exists() else None,
        trust_env=trust_env,
        expiration=datetime.now(UTC) + timedelta(seconds=TOKEN_REREAD_SECONDS),
    )


def login(*, trust_env: bool = False) -> kopf.ConnectionInfo | None:
    """The service account in a pod, else the kubeconfig; None if neither exists."""
    return login_with_service_account(trust_env=trust_env) or login_with_kubeconfig(trust_env=trust_env)
