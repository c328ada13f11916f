"""The Azure side of the lab: a real spot eviction of an AKS node, and GPU spot node pools.

- `torchspot evict aks --resource-group RG --cluster NAME --node NODE`: the node's
  Kubernetes provider ID names its scale set instance
  (`azure:///subscriptions/S/resourceGroups/MC_.../providers/Microsoft.Compute/
  virtualMachineScaleSets/VMSS/virtualMachines/ID`); after checking that the instance
  lies in the cluster's node resource group, it calls the compute API's
  simulate-eviction, which behaves like a real spot eviction (a Scheduled Events
  `Preempt` notice about 30 s ahead, then the VM goes per the pool's eviction policy).
- `torchspot aks spot-pool create|scale`: a GPU spot node pool (priority Spot, eviction
  policy, max price, autoscaler limits, labels, taints) through the AKS API.

Builders are pure; the SDK clients (azure-mgmt-compute, azure-mgmt-containerservice,
with `DefaultAzureCredential` on the command line) do the I/O. The API versions are
pinned here so that what we send does not drift with SDK upgrades.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COMPUTE_API_VERSION = "2024-07-01"
"""Microsoft.Compute API version for simulateEviction (available since 2019-12-01)."""
AKS_API_VERSION = "2025-01-01"
"""Microsoft.ContainerService API version for managed clusters and agent pools."""
SPOT_MAX_PRICE_ANY = -1.0
"""Pay up to the on-demand price; never evicted for price, only for capacity."""
EVICTION_POLICIES = ("Delete", "Deallocate")

_PROVIDER_ID = re.compile(
    r"^azure:///subscriptions/(?P<subscription>[^/]+)/resourceGroups/(?P<group>[^/]+)/providers/"
    r"Microsoft\.Compute/virtualMachineScaleSets/(?P<vmss>[^/]+)/virtualMachines/(?P<instance>[^/]+)$",
    re.IGNORECASE,
)
_POOL_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class AzureInputError(ValueError):
    """An argument the Azure commands cannot use, with the reason."""


@dataclass(frozen=True)
class ScaleSetInstance:
    """One VM of a virtual machine scale set (an AKS node)."""

    subscription: str
    resource_group: str
    scale_set: str
    instance_id: str


def parse_provider_id(provider_id: str) -> ScaleSetInstance:
    """The scale set instance behind an AKS node's `spec.providerID` (pure)."""
    match = _PROVIDER_ID.match(provider_id)
    if match is None:
        raise AzureInputError(
            f"provider ID {provider_id!r} is not a VM scale set instance "
            "(azure:///subscriptions/.../virtualMachineScaleSets/NAME/virtualMachines/ID): spot pools use scale sets"
        )
    return ScaleSetInstance(match["subscription"], match["group"], match["vmss"], match["instance"])


@dataclass(frozen=True)
class SpotPool:
    """A GPU spot node pool as `torchspot aks spot-pool create` makes it."""

    name: str
    vm_size: str
    min_count: int
    max_count: int
    count: int | None = None
    max_price: float = SPOT_MAX_PRICE_ANY
    eviction_policy: str = "Delete"
    labels: Mapping[str, str] | None = None
    taints: tuple[str, ...] = ()

    def check(self) -> None:
        """Raise AzureInputError naming the first bad field."""
        if not _POOL_NAME.match(self.name):
            raise AzureInputError(f"--name {self.name!r}: 1-12 lowercase letters and digits, starting with a letter")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise AzureInputError(f"--eviction-policy {self.eviction_policy!r}: use {' or '.join(EVICTION_POLICIES)}")
        if not 0 <= self.min_count <= self.max_count:
            raise AzureInputError(f"--min {self.min_count} / --max {self.max_count}: need 0 <= min <= max")
        if self.count is not None and not self.min_count <= self.count <= self.max_count:
            raise AzureInputError(f"--count {self.count}: must lie between --min and --max")
        if self.max_price != SPOT_MAX_PRICE_ANY and (self.max_price <= 0 or round(self.max_price, 5) != self.max_price):
            raise AzureInputError(f"--max-price {self.max_price}: -1, or a positive price with at most 5 decimals")
        for taint in self.taints:
            if not re.fullmatch(r"[^=:\s]+=[^=:\s]*:(NoSchedule|PreferNoSchedule|NoExecute)", taint):
                raise AzureInputError(f"--taint {taint!r}: expected KEY=VALUE:EFFECT")


def agent_pool_body(pool: SpotPool) -> dict[str, Any]:
    """The ARM body of a spot agent pool (pure). AKS adds the spot label and taint itself."""
    pool.check()
    properties: dict[str, Any] = {
        "type": "VirtualMachineScaleSets",
        "mode": "User",
        "osType": "Linux",
        "vmSize": pool.vm_size,
        "scaleSetPriority": "Spot",
        "scaleSetEvictionPolicy": pool.eviction_policy,
        "spotMaxPrice": pool.max_price,
        "enableAutoScaling": True,
        "minCount": pool.min_count,
        "maxCount": pool.max_count,
        "count": pool.count if pool.count is not None else max(pool.min_count, 1 if pool.max_count else 0),
    }
    if pool.labels:
        properties["nodeLabels"] = dict(pool.labels)
    if pool.taints:
        properties["nodeTaints"] = list(pool.taints)
    return {"properties": properties}


def scale_body(current: Mapping[str, Any], *, min_count: int, max_count: int, count: int | None) -> dict[str, Any]:
    """The agent pool as it is, with new autoscaler limits (and count) (pure)."""
    if not 0 <= min_count <= max_count:
        raise AzureInputError(f"--min {min_count} / --max {max_count}: need 0 <= min <= max")
    properties = dict(current.get("properties") or {})
    if properties.get("scaleSetPriority") != "Spot":
        raise AzureInputError(f"agent pool {current.get('name')!r} is not a spot pool")
    properties.update(enableAutoScaling=True, minCount=min_count, maxCount=max_count)
    now = int(properties.get("count") or 0)
    properties["count"] = count if count is not None else min(max(now, min_count), max_count)
    for read_only in ("provisioningState", "powerState", "nodeImageVersion", "currentOrchestratorVersion"):
        properties.pop(read_only, None)
    return {"properties": properties}


def simulate_eviction(
    compute: Any, aks: Any, *, resource_group: str, cluster: str, provider_id: str
) -> ScaleSetInstance:
    """Evict the node's VM through the compute API, after checking it belongs to the cluster."""
    instance = parse_provider_id(provider_id)
    managed = aks.managed_clusters.get(resource_group, cluster)
    node_group = str((managed.get("properties") or {}).get("nodeResourceGroup", ""))
    if node_group.lower() != instance.resource_group.lower():
        raise AzureInputError(
            f"the node's VM is in resource group {instance.resource_group}, "
            f"but cluster {cluster}'s nodes are in {node_group or '(unknown)'}"
        )
    compute.virtual_machine_scale_set_vms.simulate_eviction(
        instance.resource_group, instance.scale_set, instance.instance_id, api_version=COMPUTE_API_VERSION
    )
    return instance


def create_spot_pool(aks: Any, *, resource_group: str, cluster: str, pool: SpotPool) -> dict[str, Any]:
    """Create (or update) the spot pool and wait until AKS reports it done."""
    body = agent_pool_body(pool)
    poller = aks.agent_pools.begin_create_or_update(resource_group, cluster, pool.name, body)
    return dict(poller.result())


def scale_spot_pool(
    aks: Any, *, resource_group: str, cluster: str, name: str, min_count: int, max_count: int, count: int | None
) -> dict[str, Any]:
    """Change a spot pool's autoscaler limits (and node count) and wait until done."""
    current = dict(aks.agent_pools.get(resource_group, cluster, name))
    body = scale_body(current, min_count=min_count, max_count=max_count, count=count)
    poller = aks.agent_pools.begin_create_or_update(resource_group, cluster, name, body)
    return dict(poller.result())


def clients(credential: Any, subscription: str, base_url: str | None = None, **options: Any) -> tuple[Any, Any]:
    """The compute and AKS SDK clients, with the API versions pinned above.

    :param base_url: the Azure Resource Manager endpoint (default: the public cloud's).
    :param options: passed to both clients (for example `connection_verify`).
    """
    from azure.mgmt.compute import ComputeManagementClient  # noqa: PLC0415 - the `azure` extra
    from azure.mgmt.containerservice import ContainerServiceClient  # noqa: PLC0415

    compute = ComputeManagementClient(credential, subscription, base_url, **options)
    aks = ContainerServiceClient(credential, subscription, base_url, api_version=AKS_API_VERSION, **options)
    return compute, aks
