"""The caches keep projections of pods and nodes (`verdicts.project`, `nodes.project`): every decision
made from a projection is the one made from the whole object, for AKS-sized bodies in each state that
matters, and a projection is a small part of the whole.

The bodies are bench/operator/fixtures/ (an AKS H100 spot node and a worker pod with a sidecar, at the
sizes a cluster's have; how they were built is in make.py there).
"""

from __future__ import annotations

import copy
import json
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from torchspot_operator import constants, nodes, verdicts
from torchspot_operator.nodes import NodePolicy

FIXTURES = Path(__file__).resolve().parents[2] / "bench" / "operator" / "fixtures"
NOW = datetime(2026, 11, 20, 8, 30, tzinfo=UTC)


def _fixture(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return body


def _pod(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    pod = _fixture("aks-worker-pod.json")
    change(pod)
    return pod


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = pod["status"]["containerStatuses"][0]
    return found


POD_STATES: dict[str, Callable[[dict[str, Any]], None]] = {
    "running": lambda pod: None,
    "evicted": lambda pod: pod["status"].update(
        phase="Failed",
        reason="Evicted",
        conditions=[
            *pod["status"]["conditions"],
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "lastTransitionTime": "x",
            },
        ],
    ),
    "limit-evicted": lambda pod: pod["status"].update(phase="Failed", reason="Evicted", message="memory limit"),
    "oom-killed": lambda pod: _trainer(pod).update(
        state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}, ready=False
    ),
    "sidecar-ended": lambda pod: pod["status"]["containerStatuses"][1].update(
        state={"terminated": {"exitCode": 1, "reason": "Error"}}
    ),
    "bad-image": lambda pod: _trainer(pod).update(
        state={"waiting": {"reason": "InvalidImageName", "message": "bad name"}}, ready=False
    ),
    "deleting": lambda pod: pod["metadata"].update(deletionTimestamp="2026-11-20T08:20:00Z"),
    "kept": lambda pod: pod["metadata"]["annotations"].update({constants.ANNOTATION_ACCOUNTED: "failure"}),
    "unscheduled": lambda pod: pod["status"].update(
        phase="Pending",
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/9 nodes"}],
    ),
}


@pytest.mark.parametrize("state", sorted(POD_STATES))
def test_every_pod_decision_is_the_same_on_the_projection(state: str) -> None:
    whole = _pod(POD_STATES[state])
    part = verdicts.project(copy.deepcopy(whole))
    for decide in (
        verdicts.classify,
        verdicts.permanent_wait,
        verdicts.waiting_since,
        verdicts.is_ready,
        verdicts.pod_index,
        verdicts.kept,
        verdicts.pod_name,
        verdicts.pod_uid,
        verdicts.waiting_reason,
        verdicts.disruption_target,
    ):
        assert decide(part) == decide(whole), (state, decide.__name__)


NODE_STATES: dict[str, Callable[[dict[str, Any]], None]] = {
    "ready": lambda node: None,
    "not-ready": lambda node: _ready(node, "False"),
    "unknown": lambda node: _ready(node, "Unknown"),
    "drained": lambda node: node["spec"]["taints"].append({"key": min(constants.DRAIN_TAINTS), "effect": "NoSchedule"}),
    "deleting": lambda node: node["metadata"].update(deletionTimestamp="2026-11-20T08:20:00Z"),
    "cordoned": lambda node: node["spec"].update(unschedulable=True),
}


def _ready(node: dict[str, Any], status: str) -> None:
    for condition in node["status"]["conditions"]:
        if condition["type"] == "Ready":
            condition.update(status=status, lastTransitionTime="2026-11-20T08:25:00Z")


@pytest.mark.parametrize("state", sorted(NODE_STATES))
def test_every_node_decision_is_the_same_on_the_projection(state: str) -> None:
    whole = _fixture("aks-node.json")
    NODE_STATES[state](whole)
    part = nodes.project(copy.deepcopy(whole))
    pod = _fixture("aks-worker-pod.json")
    for policy in (NodePolicy(), NodePolicy(cordon=True), NodePolicy(grace_seconds=60)):
        assert nodes.definite(part) == nodes.definite(whole)
        assert nodes.soft(part, policy) == nodes.soft(whole, policy)
        assert nodes.grace(verdicts.project(pod), part, policy) == nodes.grace(pod, whole, policy)
        assert nodes.due(verdicts.project(pod), part, policy, NOW) == nodes.due(pod, whole, policy, NOW)
    assert nodes.full_disruption([part] * 3, 0.55) == nodes.full_disruption([whole] * 3, 0.55)


@pytest.mark.parametrize(
    ("name", "project", "share"),
    [("aks-node.json", nodes.project, 0.05), ("aks-worker-pod.json", verdicts.project, 0.2)],
)
def test_a_projection_holds_a_small_part_of_the_whole(name: str, project: Callable[..., Any], share: float) -> None:
    text = (FIXTURES / name).read_text()
    tracemalloc.start()
    try:
        wholes = [json.loads(text) for _ in range(20)]
        held_whole = tracemalloc.get_traced_memory()[0]
        del wholes
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        parts = [project(json.loads(text)) for _ in range(20)]
        held_part = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert parts
    assert held_part < share * held_whole, (held_part / 20, held_whole / 20)
