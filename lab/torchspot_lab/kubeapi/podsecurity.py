"""Kubernetes' Pod Security Standards, `restricted` profile (which includes `baseline`): a pod's violations. Pure.

The rules of https://kubernetes.io/docs/concepts/security/pod-security-standards/ as of
Kubernetes 1.30+ ("latest"), each checked over the pod and every container (init and
ephemeral ones included). The lab's API emulator applies them to pods created in a
namespace labelled `pod-security.kubernetes.io/enforce: restricted`, refusing such a pod
with the API server's kind of message; the operator's tests check every pod the
operator builds with them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

ENFORCE_LABEL: Final = "pod-security.kubernetes.io/enforce"
RESTRICTED_VOLUMES: Final = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
SAFE_SYSCTLS: Final = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES: Final = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _security(container: Mapping[str, Any]) -> Mapping[str, Any]:
    found: Mapping[str, Any] = container.get("securityContext") or {}
    return found


def restricted_violations(pod: Mapping[str, Any]) -> list[str]:
    """What keeps a pod from the `restricted` profile, one line per rule broken (empty: it passes)."""
    spec: Mapping[str, Any] = pod.get("spec") or {}
    pod_sc: Mapping[str, Any] = spec.get("securityContext") or {}
    found: list[str] = []
    containers = list(_containers(spec))

    def each(what: str, broken: list[str]) -> None:
        if broken:
            names = ", ".join(f'"{name}"' for name in broken)
            found.append(f"{what} (container{'s' if len(broken) > 1 else ''} {names})")

    # baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(f"host namespaces ({field}=true)")
    each("privileged", [c["name"] for c in containers if _security(c).get("privileged")])
    each(
        "hostProcess",
        [c["name"] for c in containers if (_security(c).get("windowsOptions") or {}).get("hostProcess")],
    )
    each("hostPort", [c["name"] for c in containers if any(p.get("hostPort") for p in c.get("ports") or [])])
    each(
        "procMount",
        [c["name"] for c in containers if _security(c).get("procMount") not in (None, "Default")],
    )
    selinux = [pod_sc.get("seLinuxOptions") or {}] + [_security(c).get("seLinuxOptions") or {} for c in containers]
    if any(o.get("type", "") not in SELINUX_TYPES or o.get("user") or o.get("role") for o in selinux):
        found.append("seLinuxOptions (a type beyond the container types, or a user or role)")
    unsafe = [s.get("name") for s in pod_sc.get("sysctls") or [] if s.get("name") not in SAFE_SYSCTLS]
    if unsafe:
        found.append(f"forbidden sysctls ({', '.join(map(str, unsafe))})")
    apparmor = [pod_sc.get("appArmorProfile") or {}] + [_security(c).get("appArmorProfile") or {} for c in containers]
    if any(p.get("type") not in (None, "RuntimeDefault", "Localhost") for p in apparmor):
        found.append("appArmorProfile (Unconfined)")
    # restricted
    volumes = [v.get("name", "?") for v in spec.get("volumes") or [] if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    if volumes:
        found.append(f"restricted volume types (volumes {', '.join(map(str, volumes))})")
    each(
        "allowPrivilegeEscalation != false",
        [c["name"] for c in containers if _security(c).get("allowPrivilegeEscalation") is not False],
    )
    non_root_pod = pod_sc.get("runAsNonRoot") is True

    def non_root(c: Mapping[str, Any]) -> bool:
        value = _security(c).get("runAsNonRoot")
        return value is True or (value is None and non_root_pod)

    each("runAsNonRoot != true", [c["name"] for c in containers if not non_root(c)])
    users = [pod_sc.get("runAsUser")] + [_security(c).get("runAsUser") for c in containers]
    if 0 in users:
        found.append("runAsUser=0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")

    def seccomp(c: Mapping[str, Any]) -> str | None:
        own = (_security(c).get("seccompProfile") or {}).get("type")
        return own if own is not None else pod_seccomp

    each(
        "seccompProfile (pod or container must set it to RuntimeDefault or Localhost)",
        [c["name"] for c in containers if seccomp(c) not in ("RuntimeDefault", "Localhost")],
    )

    def capabilities_ok(c: Mapping[str, Any]) -> bool:
        caps = _security(c).get("capabilities") or {}
        return "ALL" in (caps.get("drop") or []) and set(caps.get("add") or []) <= {"NET_BIND_SERVICE"}

    each(
        "capabilities (drop must include ALL, add only NET_BIND_SERVICE)",
        [c["name"] for c in containers if not capabilities_ok(c)],
    )
    return found
