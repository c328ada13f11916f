"""What the operator knows of the nodes between reconciles: the node watch's cache, the nodes it does not
show (read by a GET), the NotReady nodes the cluster-wide rate let the plans act on, and which jobs'
workers were on which node. The controller reads it for each job's `Observed`; the node watch's handlers
(handlers.py) feed it. The rules a node is judged by are nodes.py's; what is kept here is state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from torchspot_operator import conditions, constants, nodes
from torchspot_operator.kube import Kube
from torchspot_operator.nodes import NodePolicy, RateLimiter

__all__ = ["NodeView"]

log = logging.getLogger(__name__)


class NodeView:
    """The operator's nodes (module docstring).

    :param api: where a node the watch does not show is read.
    :param policy: the operator's node settings (the grace, cordons, the full-disruption share, the rate).
    :param now: the clock a Ready condition without a transition time is stamped by.
    """

    def __init__(self, api: Kube, policy: NodePolicy, now: Callable[[], datetime]) -> None:
        self.api, self.policy, self.now = api, policy, now
        self.nodes: dict[str, Mapping[str, Any]] = {}
        """Nodes as the node watch last saw them (reconciles read these instead of asking each time); a
        Ready condition without a transition time gets the time the operator first saw its status."""
        self.read_nodes: dict[str, tuple[Mapping[str, Any] | None, float]] = {}
        """Nodes of workers that the node watch does not show (outside `constants.NODE_SELECTOR_ENV`), as a
        GET last found them (None: gone), and when (monotonic)."""
        self._limiter = RateLimiter(policy.eviction_rate)
        self._admitted: set[str] = set()
        """NotReady nodes the rate limiter let through (until they are Ready again or gone: `observe`)."""
        self._of_job: dict[tuple[str, str], set[str]] = {}

    def get(self, name: str) -> Mapping[str, Any] | None:
        """A node as the watch last showed it, if it did."""
        return self.nodes.get(name)

    async def read(self, name: str) -> Mapping[str, Any] | None:
        """A worker's node the node watch has not shown (not yet, gone, or outside its selector): asked,
        never guessed gone, at most every `UNWATCHED_NODE_SECONDS` per node."""
        found, at = self.read_nodes.get(name, (None, -1.0))
        if at < 0 or time.monotonic() - at > constants.UNWATCHED_NODE_SECONDS:
            body = await self.api.get("v1", "Node", None, name)
            found = None if body is None else self._stamped(nodes.project(body), found)
            self.read_nodes[name] = (found, time.monotonic())
        return found

    def admit(
        self, pods: Iterable[Mapping[str, Any]], bound: Mapping[str, Mapping[str, Any]], now: datetime
    ) -> set[str]:
        """The NotReady (or cordoned) nodes of these pods the plan may act on (nodes.py): none in a full
        disruption; a node whose grace is over for one of its pods only if the cluster-wide rate allows."""
        policy = self.policy
        troubled = {name for name, node in bound.items() if nodes.soft(node, policy) is not None}
        if not troubled:
            return set()
        if nodes.full_disruption(self.nodes.values(), policy.full_disruption_share):
            bad = sum(nodes.ready_status(n)[0] != "True" for n in self.nodes.values())
            log.warning(
                "%d of %d nodes NotReady: no worker is moved off a NotReady node meanwhile", bad, len(self.nodes)
            )
            return set()
        for pod in pods:
            name = str(pod.get("spec", {}).get("nodeName") or "")
            if name in troubled and name not in self._admitted and nodes.due(pod, bound[name], policy, now):
                if self._limiter.admit():
                    self._admitted.add(name)
                else:
                    log.info("node %s: NotReady past the grace; waiting for the node eviction rate", name)
        return troubled & self._admitted

    def observe(self, node: Mapping[str, Any], *, deleted: bool) -> None:
        """Keep the node cache that reconciles read (fed by the node watch).

        A Ready condition that says no transition time (some test clusters, older kubelets) gets
        the time the operator first saw that status, so a NotReady node's grace counts from there."""
        node = nodes.project(node)
        name = node["metadata"].get("name", "")
        self.read_nodes.pop(name, None)  # the watch shows it now
        if deleted or nodes.soft(node, self.policy) is None:  # admitted again only after a new fault
            self._admitted.discard(name)
        if deleted:
            self.nodes.pop(name, None)
            return
        self.nodes[name] = self._stamped(node, self.nodes.get(name))

    def relisted(self, uids: set[str]) -> set[str]:
        """The node watch listed the nodes (at its start, or again after its watch failed): a kept node the
        listing lacks was deleted meanwhile. Forgets those; returns their names (their jobs are due now).
        Nothing else changes the node cache during a listing, so the listing is the whole truth."""
        gone = {name for name, node in self.nodes.items() if node["metadata"].get("uid") not in uids}
        for name in gone:
            self.observe({"metadata": {"name": name}}, deleted=True)
        return gone

    def bind(self, job: tuple[str, str], names: set[str]) -> None:
        """The nodes `job`'s workers are on, as its reconcile found them (`jobs_on`)."""
        self._of_job[job] = names

    def forget(self, job: tuple[str, str]) -> None:
        self._of_job.pop(job, None)

    def jobs_on(self, name: str) -> set[tuple[str, str]]:
        """(namespace, job) of the jobs whose workers were on a node when last reconciled.

        An index kept by reconcile rather than a cluster-wide pod list: it needs no
        API call and no permission beyond the watched namespaces.
        """
        return {job for job, names in self._of_job.items() if name in names}

    def _stamped(self, node: dict[str, Any], before: Mapping[str, Any] | None) -> dict[str, Any]:
        """The node with a Ready transition time: its own, or the one the operator gave the same status
        before (`before`: the node as last kept), or now."""
        status, since = nodes.ready_status(node)
        if since is not None:
            return node
        known = nodes.ready_status(before) if before is not None else None
        stamp = known[1] if known is not None and known[0] == status and known[1] else None
        stamp = stamp or conditions.timestamp(self.now())
        conds = [
            {**c, "lastTransitionTime": stamp} if c.get("type") == "Ready" else c
            for c in node.get("status", {}).get("conditions") or []
        ]
        if not any(c.get("type") == "Ready" for c in conds):
            conds.append({"type": "Ready", "status": status, "lastTransitionTime": stamp})
        return {**node, "status": {**(node.get("status") or {}), "conditions": conds}}
