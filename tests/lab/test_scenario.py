"""Scenario files and the node agent's pure rules (scheduling, tolerations, env expansion)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from torchspot_lab.cluster.agent import NodeAgent
from torchspot_lab.cluster.cloud import node_object
from torchspot_lab.cluster.kubelet import expand
from torchspot_lab.cluster.scheduler import bind_pending, fits, gpus_requested, tolerates
from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.scenario import Event, Pool, ScenarioError, load_scenario, parse_scenario
from torchspot_operator import constants

ROOT = Path(__file__).resolve().parents[2]


def test_a_full_scenario_parses_in_time_order() -> None:
    scenario = parse_scenario({
        "pools": {"onDemand": {"nodes": 1}, "spot": {"nodes": 3, "gpus": 1}},
        "notReadyAfter": 5,
        "timeout": 200,
        "events": [
            {"at": 90, "addSpot": 2},
            {"at": 30, "evict": "spot-3", "notice": True},
            {"at": 60, "freeze": "spot-2"},
            {"at": 95, "evict": "spot-5"},
            {"at": 100, "suspend": True},
            {"at": 110, "suspend": False},
        ],
    })  # fmt: skip
    assert scenario.spot == Pool(nodes=3, gpus=1)
    assert [e.at for e in scenario.events] == [30, 60, 90, 95, 100, 110]
    assert scenario.events[0] == Event(30, "evict", node="spot-3", notice=True)
    assert scenario.events[2] == Event(90, "addSpot", count=2)
    assert scenario.events[3].notice is False  # hard unless said otherwise
    assert [(e.action, e.suspend) for e in scenario.events[4:]] == [("suspend", True), ("suspend", False)]
    assert scenario.initial_nodes() == [("ondemand-1", False), ("spot-1", True), ("spot-2", True), ("spot-3", True)]
    assert (scenario.not_ready_after, scenario.timeout) == (5.0, 200.0)


def test_the_market_clock_counts_from_the_submission_unless_told_the_first_checkpoint() -> None:
    assert parse_scenario({}).clock == "submitted"
    assert parse_scenario({"clock": "firstCheckpoint"}).clock == "firstCheckpoint"


BAD = [
    ("unknown-clock", {"clock": "firstStep"}, "clock: must be one of submitted, firstCheckpoint, not 'firstStep'"),
    ("not-a-mapping", ["evict"], "must hold a mapping"),
    ("unknown-top", {"evnets": []}, "unknown keys evnets"),
    ("unknown-pool", {"pools": {"gpu": {}}}, "pools: unknown keys gpu"),
    ("negative-nodes", {"pools": {"spot": {"nodes": -1}}}, "pools.spot.nodes: must be a whole number >= 0"),
    ("no-on-demand", {"pools": {"onDemand": {"nodes": 0}}}, "pools.onDemand.nodes: at least 1"),
    ("no-action", {"events": [{"at": 3}]}, "events[0]: needs exactly one of evict, freeze, addSpot, suspend"),
    ("two-actions", {"events": [{"at": 3, "evict": "spot-1", "freeze": "spot-2"}]}, "needs exactly one"),
    ("bad-time", {"events": [{"at": "soon", "evict": "spot-1"}]}, "events[0].at: must be a number >= 0"),
    ("missing-time", {"events": [{"evict": "spot-1"}]}, "events[0].at: must be a number"),
    (
        "bad-notice",
        {"events": [{"at": 1, "evict": "spot-1", "notice": "yes"}]},
        "events[0].notice: must be true or false",
    ),
    ("suspend-not-bool", {"events": [{"at": 1, "suspend": "yes"}]}, "events[0].suspend: must be true or false"),
    ("notice-on-freeze", {"events": [{"at": 1, "freeze": "spot-1", "notice": True}]}, "unknown keys notice for freeze"),
    ("unknown-node", {"events": [{"at": 1, "evict": "spot-9"}]}, "no node spot-9 at t=1"),
    (
        "evicted-twice",
        {"events": [{"at": 1, "evict": "spot-1"}, {"at": 2, "freeze": "spot-1"}]},
        "no node spot-1 at t=2",
    ),
    ("added-later", {"events": [{"at": 1, "evict": "spot-4"}, {"at": 5, "addSpot": 1}]}, "no node spot-4 at t=1"),
    ("zero-added", {"events": [{"at": 1, "addSpot": 0}]}, "events[0].addSpot: must be a whole number >= 1"),
]


@pytest.mark.parametrize(("case", "raw", "said"), BAD, ids=[c[0] for c in BAD])
def test_bad_scenarios_are_refused_naming_the_field(case: str, raw: Any, said: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(raw, "market.yaml")
    assert said in str(caught.value)
    assert str(caught.value).startswith("market.yaml: ")


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario({"timeout": 0, "events": [{"at": -1, "evict": "spot-1"}, {"at": 2, "freeze": 7}]})
    assert len(caught.value.problems) == 3


def test_files_that_are_not_yaml_or_missing_are_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("events: [at: 1, evict")
    with pytest.raises(ScenarioError, match=r"broken\.yaml: not YAML"):
        load_scenario(broken)
    with pytest.raises(ScenarioError, match=r"absent\.yaml: cannot read"):
        load_scenario(tmp_path / "absent.yaml")


@pytest.mark.parametrize("path", sorted((ROOT / "lab" / "scenarios").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_scenarios_parse(path: Path) -> None:
    assert load_scenario(path).timeout > 0


def _pod(**spec: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "trainer", "image": "x"}], **spec}}


def test_spot_pods_fit_spot_nodes_only_with_the_toleration_and_gpu_room() -> None:
    spot = node_object("spot-1", spot=True, gpus=1, cpu=4)
    system = node_object("ondemand-1", spot=False, gpus=0, cpu=4)
    toleration = dict(constants.SPOT_TOLERATION)
    gpu = {"limits": {constants.GPU_RESOURCE: 1}}
    worker = _pod(
        nodeSelector={constants.SPOT_LABEL: constants.SPOT_VALUE},
        tolerations=[toleration],
        containers=[{"name": "trainer", "image": "x", "resources": gpu}],
    )
    assert gpus_requested(worker) == 1
    assert fits(worker, spot, gpus_free=1)
    assert not fits(worker, spot, gpus_free=0)
    assert not fits(worker, system, gpus_free=1)  # selector
    untolerated = _pod(nodeSelector={constants.SPOT_LABEL: constants.SPOT_VALUE})
    assert not fits(untolerated, spot, gpus_free=1)  # the spot taint keeps it out
    etcd = _pod()
    assert fits(etcd, system, gpus_free=0)
    assert not fits(etcd, spot, gpus_free=1)
    cordoned = {**system, "spec": {**system["spec"], "unschedulable": True}}
    assert not fits(etcd, cordoned, gpus_free=0)


@pytest.mark.parametrize(
    ("toleration", "taint", "want"),
    [
        ({"operator": "Exists"}, {"key": "a", "effect": "NoSchedule"}, True),
        ({"key": "a", "operator": "Exists"}, {"key": "a", "value": "x", "effect": "NoSchedule"}, True),
        ({"key": "a", "value": "x"}, {"key": "a", "value": "x", "effect": "NoSchedule"}, True),
        ({"key": "a", "value": "y"}, {"key": "a", "value": "x", "effect": "NoSchedule"}, False),
        ({"key": "a", "value": "x", "effect": "NoExecute"}, {"key": "a", "value": "x", "effect": "NoSchedule"}, False),
        ({"key": "b", "operator": "Exists"}, {"key": "a", "effect": "NoSchedule"}, False),
    ],
)
def test_toleration_rules(toleration: dict[str, str], taint: dict[str, str], want: bool) -> None:
    assert tolerates([toleration], taint) is want


def test_variable_expansion_as_kubernetes_does() -> None:
    env = {"POD_IP": "127.0.0.1", "PORT": "29500"}
    assert expand("$(POD_IP):$(PORT)", env) == "127.0.0.1:29500"
    assert expand("$(UNKNOWN) stays", env) == "$(UNKNOWN) stays"
    assert expand("no refs", env) == "no refs"


def test_the_demo_job_is_the_example_made_small() -> None:
    """Same image, placement, Secret and program as manifests/examples/elasticjob.yaml; only sizes differ."""
    demo = yaml.safe_load((ROOT / "lab" / "jobs" / "cifar10-demo.yaml").read_text())
    example = yaml.safe_load((ROOT / "manifests" / "examples" / "elasticjob.yaml").read_text())
    assert demo["metadata"]["name"] == example["metadata"]["name"]
    assert demo["spec"]["placement"] == example["spec"]["placement"]
    assert demo["spec"]["checkpoint"]["credentialsSecret"] == example["spec"]["checkpoint"]["credentialsSecret"]
    demo_container, example_container = (
        demo["spec"]["template"]["spec"]["containers"][0],
        example["spec"]["template"]["spec"]["containers"][0],
    )
    assert demo_container["image"] == example_container["image"]
    demo_flags = {a.split("=")[0] for a in demo_container["args"]}
    example_flags = {a.split("=")[0] for a in example_container["args"]}
    # --sync-bn needs GPUs; the sandbox's workers run on CPU (and re-form in place, which --sync-bn rules out).
    assert demo_flags - {"--log-every"} == example_flags - {"--sync-bn"}


def test_a_pod_deleted_between_the_list_and_its_binding_is_skipped(tmp_path: Path) -> None:
    """The sandbox's scheduler binds what it listed; the operator may delete a pod meanwhile (a
    CI run failed on that 404). A real scheduler's binding gets NotFound and moves on: so does ours,
    and the pods after it are still bound."""
    scenario = parse_scenario({})
    with KubeApi(tmp_path / "api") as api:
        agent = NodeAgent(api, tmp_path / "work", scenario)
        agent.cloud.add_node("ondemand-1", spot=False)
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "live", "namespace": "default"},
                "spec": {"containers": [{"name": "c", "image": "i"}]}}  # fmt: skip
        api.run(agent.kube.create(body))
        gone = {**body, "metadata": {"name": "gone", "namespace": "default", "creationTimestamp": "0"}}
        listed = [gone, *api.run(agent.kube.list("v1", "Pod", None))]  # "gone" was listed, then deleted
        nodes = {n["metadata"]["name"]: n for n in api.run(agent.kube.list("v1", "Node", None))}
        bind_pending(api, agent.kube, listed, agent.nodes, nodes)
        (live,) = api.run(agent.kube.list("v1", "Pod", None))
        assert live["spec"]["nodeName"] == "ondemand-1"
        api.run(agent.kube.close())
