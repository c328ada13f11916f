"""The Helm chart with the real helm binary: lint, render, validate, and what each value does.

Rendered objects are validated with kubernetes-validate (the API's own OpenAPI schemas
for Kubernetes 1.37, strict: unknown fields fail) for the default values and several
non-default sets; the chart's values schema must refuse bad values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from click import Command
from kopf import cli

from tests.deploy.helm import CHART, NAMESPACE, find, helm, lint, one, template, template_error
from torchspot_operator import constants
from torchspot_operator.metrics import METRICS_PORT_ENV
from torchspot_operator.spec import default_etcd_placement

K8S_VERSION = "1.37.0"
PEERINGS = "clusterkopfpeerings"

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["ml-a", "ml-b"], "logLevel": "debug", "logFormat": "plain"},
    "monitored": {"metrics": {"port": 9100, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "restricted-pod-patches": {"rbac": {"restrictPodPatches": True}},
    "no-crd-own-account": {
        "crds": {"enabled": False, "keep": True, "peering": False},
        "serviceAccount": {"create": False, "name": "platform-operator"},
        "rbac": {"aggregateToDefaultRoles": False},
    },
    "aks-system-pool": {
        "image": {"repository": "myacr.azurecr.io/torchspot-operator", "digest": "sha256:" + "a" * 64},
        "imagePullSecrets": [{"name": "acr-pull"}],
        "nodeSelector": {"kubernetes.azure.com/mode": "system"},
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"prometheus.io/scrape": "false"},
        "serviceAccount": {
            "annotations": {"azure.workload.identity/client-id": "00000000-0000-0000-0000-000000000000"}
        },
        "logLevel": "warning",
        "etcd": {"defaultPlacement": {"nodeSelector": {"kubernetes.azure.com/mode": "system"}}},
    },
}


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")


def _operator(docs: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = _deployment(docs)["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("case", VALUE_SETS, ids=list(VALUE_SETS))
def test_lint_strict_passes(case: str, tmp_path: Path) -> None:
    done = lint(VALUE_SETS[case], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("case", VALUE_SETS, ids=list(VALUE_SETS))
def test_every_rendered_object_is_valid_kubernetes(case: str, tmp_path: Path) -> None:
    docs = template(VALUE_SETS[case], tmp_path)
    assert docs
    for doc in docs:
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            continue  # the Prometheus Operator's CRD: not in Kubernetes' schemas (test_metrics_are_exposed checks it)
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{case}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_defaults_install_everything_cluster_wide(tmp_path: Path) -> None:
    docs = template()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ServiceAccount", "Deployment", "Service"]
        + ["CustomResourceDefinition"] * 2
        + ["ClusterRole"] * 4
        + ["ClusterRoleBinding"] * 2
        + ["Role", "RoleBinding"]  # the operator CA's, in its own namespace
    )
    for crd in find(docs, "CustomResourceDefinition"):
        assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert _operator(docs)["args"] == [
        "--peering=torchspot",
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--log-format=json",
    ]
    assert [b["metadata"]["name"] for b in find(docs, "RoleBinding")] == ["torchspot-ca"]
    cluster = one(docs, "ClusterRole", "torchspot-cluster")
    assert [r["resources"] for r in cluster["rules"]] == [["nodes"], ["customresourcedefinitions"], [PEERINGS]]


def test_watched_namespaces_get_role_bindings_only_there(tmp_path: Path) -> None:
    docs = template(VALUE_SETS["namespaced"], tmp_path)
    bindings = [b for b in find(docs, "RoleBinding") if b["metadata"]["name"] == "torchspot-jobs"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml-a", "ml-b"]
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "torchspot-jobs",
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "torchspot", "namespace": NAMESPACE}]
    assert find(docs, "ClusterRoleBinding", "torchspot-jobs") == []  # no cluster-wide write access
    cluster = one(docs, "ClusterRole", "torchspot-cluster")
    assert ["namespaces"] in [r["resources"] for r in cluster["rules"]]  # kopf checks the namespaces exist
    args = _operator(docs)["args"]
    assert "--namespace=ml-a" in args
    assert "--namespace=ml-b" in args
    assert "--all-namespaces" not in args
    assert "--verbose" in args
    assert "--log-format=plain" in args


def test_replicas_meet_through_peering_and_roll_one_at_a_time(tmp_path: Path) -> None:
    """Several operator pods are safe: kopf's peering (its CRD in the chart) lets one act at a time."""
    docs = template({"replicas": 2}, tmp_path)
    deployment = _deployment(docs)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert "--peering=torchspot" in _operator(docs)["args"]
    assert "--standalone" not in _operator(docs)["args"]
    peering = one(docs, "CustomResourceDefinition", f"{PEERINGS}.kopf.dev")
    assert peering["spec"]["names"]["kind"] == constants.PEERING_KIND
    assert peering["spec"]["scope"] == "Cluster"
    assert f"{peering['spec']['group']}/{peering['spec']['versions'][0]['name']}" == constants.PEERING_API_VERSION
    # Spread across nodes, a drain takes one at a time, and an update waits for the new pod to be ready.
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert [(c["topologyKey"], c["maxSkew"]) for c in spread] == [("kubernetes.io/hostname", 1)]
    assert spread[0]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    budget = one(docs, "PodDisruptionBudget", "torchspot")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
    assert _operator(docs)["readinessProbe"]["httpGet"]["path"] == "/healthz"
    lifetime = {e["name"]: e.get("value") for e in _operator(docs)["env"]}[constants.PEERING_LIFETIME_ENV]
    assert lifetime == str(constants.PEERING_LIFETIME)
    alone = template({"replicas": 1}, tmp_path)
    assert find(alone, "PodDisruptionBudget") == []  # one pod: a budget would block every drain
    assert "topologySpreadConstraints" not in _deployment(alone)["spec"]["template"]["spec"]
    shared = template({"crds": {"enabled": True, "keep": True, "peering": False}}, tmp_path)
    assert [c["metadata"]["name"] for c in find(shared, "CustomResourceDefinition")] == ["elasticjobs.torchspot.dev"]


def test_crd_switch_and_a_service_account_of_ones_own(tmp_path: Path) -> None:
    docs = template(VALUE_SETS["no-crd-own-account"], tmp_path)
    assert find(docs, "CustomResourceDefinition") == []
    assert find(docs, "ServiceAccount") == []
    assert _deployment(docs)["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"
    for binding in find(docs, "ClusterRoleBinding"):
        assert binding["subjects"][0]["name"] == "platform-operator"
    assert find(docs, "ClusterRole", "torchspot-edit") == []
    notes = helm("install", "x", str(CHART), "--dry-run=client", "--set", "crds.enabled=false").stdout
    assert "WARNING: crds.enabled is false" in notes


def test_crd_without_keep_has_no_resource_policy(tmp_path: Path) -> None:
    docs = template({"crds": {"enabled": True, "keep": False}}, tmp_path)
    assert all("annotations" not in crd["metadata"] for crd in find(docs, "CustomResourceDefinition"))


def test_operator_placement_image_and_etcd_default(tmp_path: Path) -> None:
    values = VALUE_SETS["aks-system-pool"]
    docs = template(values, tmp_path)
    pod = _deployment(docs)["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == values["nodeSelector"]
    assert pod["spec"]["tolerations"] == values["tolerations"]
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "acr-pull"}]
    assert pod["metadata"]["annotations"] == values["podAnnotations"]
    container = _operator(docs)
    assert container["image"] == "myacr.azurecr.io/torchspot-operator@sha256:" + "a" * 64
    assert "--quiet" in container["args"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    placement = default_etcd_placement(env[constants.ETCD_PLACEMENT_ENV])  # the operator accepts what the chart sets
    assert placement is not None
    assert placement.node_selector == {"kubernetes.azure.com/mode": "system"}
    account = one(docs, "ServiceAccount")
    assert account["metadata"]["annotations"] == values["serviceAccount"]["annotations"]


def test_operator_pod_is_locked_down() -> None:
    docs = template()
    pod = _deployment(docs)["spec"]["template"]["spec"]
    assert _deployment(docs)["spec"]["replicas"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _operator(docs)
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert set(container["resources"]) == {"requests", "limits"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("case", VALUE_SETS, ids=list(VALUE_SETS))
def test_deployment_args_are_flags_of_the_operators_command_line(case: str, tmp_path: Path) -> None:
    """What the chart passes must parse: the operator is `kopf run` with our handlers module."""
    run = cli.main.get_command(None, "run")  # type: ignore[arg-type]  # click allows no context here
    assert isinstance(run, Command)
    known = {opt for param in run.params for opt in param.opts}
    for arg in _operator(template(VALUE_SETS[case], tmp_path))["args"]:
        assert arg.split("=", 1)[0] in known, arg


GRANTS: dict[tuple[str, str], set[tuple[str, str, str, str]]] = {
    ("ClusterRole", "torchspot-cluster"): {
        *(("", "nodes", verb, "") for verb in ("get", "list", "watch")),
        *(("apiextensions.k8s.io", "customresourcedefinitions", verb, "") for verb in ("get", "list", "watch")),
        *(("kopf.dev", PEERINGS, verb, "") for verb in ("get", "list", "watch", "create", "patch")),
        *(("", "namespaces", verb, "") for verb in ("get", "list", "watch")),  # watchNamespaces: kopf checks them
    },
    ("ClusterRole", "torchspot-jobs"): {
        *(("torchspot.dev", "elasticjobs", verb, "") for verb in ("get", "list", "watch", "patch", "delete")),
        *(("torchspot.dev", "elasticjobs/status", verb, "") for verb in ("get", "patch")),
        # patch: the counted annotation on a kept failed worker (Controller._keep); no update
        *(("", "pods", verb, "") for verb in ("get", "list", "watch", "create", "patch", "delete")),
        *(
            (group, kind, verb, "")
            for group, kind in [
                ("", "services"),
                ("apps", "deployments"),
                ("policy", "poddisruptionbudgets"),
                ("networking.k8s.io", "networkpolicies"),
            ]
            for verb in ("get", "list", "watch", "create", "patch", "delete")
        ),
        ("", "secrets", "create", ""),  # each job's etcd certificates: made, never read
        ("", "events", "create", ""),
    },
    ("Role", "torchspot-ca"): {  # in the release's namespace only
        ("", "secrets", "get", "torchspot-ca"),
        ("", "secrets", "create", ""),
    },
}
"""Every permission the chart grants the operator, as (API group, resource, verb, resource name)."""


def _grants(role: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    return {
        (group, resource, verb, name)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        for name in rule.get("resourceNames") or [""]
    }


def test_rbac_is_least_privilege(tmp_path: Path) -> None:
    """The operator's roles grant exactly the list above: no wildcards, no Secret read outside its own
    namespace (and there one, by name), nothing cluster-wide but reading and kopf's peering records."""
    docs = template({"watchNamespaces": ["ml-a"]}, tmp_path)
    for (kind, name), wanted in GRANTS.items():
        assert _grants(one(docs, kind, name)) == wanted, (kind, name)
    assert one(docs, "Role", "torchspot-ca")["metadata"]["namespace"] == "torchspot"
    binding = one(docs, "RoleBinding", "torchspot-ca")
    assert (binding["roleRef"]["name"], binding["subjects"][0]["name"]) == ("torchspot-ca", "torchspot")
    env = {e["name"]: e.get("value") for e in _operator(docs)["env"]}
    assert env[constants.OPERATOR_CA_SECRET_ENV] == "torchspot-ca"  # the Secret the Role names
    everywhere = template(None, tmp_path)  # all namespaces: no namespaces rule, the rest the same
    cluster = _grants(one(everywhere, "ClusterRole", "torchspot-cluster"))
    assert cluster == {g for g in GRANTS["ClusterRole", "torchspot-cluster"] if g[1] != "namespaces"}
    aggregated = [
        r
        for r in find(everywhere, "ClusterRole")
        if r["metadata"]["name"] not in ("torchspot-cluster", "torchspot-jobs")
    ]
    for role in aggregated:  # the users' roles (edit/view aggregation): ElasticJobs only
        assert {g[1] for g in _grants(role)} <= {"elasticjobs", "elasticjobs/status", "elasticjobs/scale"}, role[
            "metadata"
        ]["name"]


def _policy_verdict(policy: dict[str, Any], user: str, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """What a ValidatingAdmissionPolicy says of an UPDATE from `old` to `new` by `user`, its CEL evaluated
    as the API server does (cel-python, the same library the sandbox's CRD admission uses): None where
    it admits it (or does not match the request), else the first failing validation's message."""
    import celpy
    import celpy.adapter

    env = celpy.Environment()

    def evaluate(expression: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    activation: dict[str, Any] = {
        "object": celpy.adapter.json_to_cel(new), "oldObject": celpy.adapter.json_to_cel(old),
        "request": celpy.adapter.json_to_cel({"userInfo": {"username": user}, "operation": "UPDATE"}),
    }  # fmt: skip
    spec = policy["spec"]
    if not all(bool(evaluate(c["expression"], activation)) for c in spec["matchConditions"]):
        return None
    activation["variables"] = celpy.celtypes.MapType(
        {celpy.celtypes.StringType(v["name"]): evaluate(v["expression"], activation) for v in spec["variables"]}
    )
    failed = [v["message"] for v in spec["validations"] if not bool(evaluate(v["expression"], activation))]
    return failed[0] if failed else None


def test_an_option_keeps_the_operators_pod_patches_to_its_own_annotations(tmp_path: Path) -> None:
    """rbac.restrictPodPatches: the operator's service account may mark a pod (its torchspot.dev/
    annotations) and nothing else, its image least of all; other users are not matched. Off by default."""
    assert find(template(None, tmp_path), "ValidatingAdmissionPolicy") == []
    docs = template({"rbac": {"restrictPodPatches": True}}, tmp_path)
    policy = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert (binding["spec"]["policyName"], binding["spec"]["validationActions"]) == (
        policy["metadata"]["name"],
        ["Deny"],
    )
    operator = f"system:serviceaccount:{NAMESPACE}:torchspot"
    pod = {
        "metadata": {"name": "w-0", "labels": {"app": "x"}, "annotations": {"torchspot.dev/index": "0", "team": "a"}},
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
    }

    def changed(path: list[str], value: Any) -> dict[str, Any]:
        new: dict[str, Any] = json.loads(json.dumps(pod))
        target = new
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return new

    marked = changed(["metadata", "annotations", "torchspot.dev/accounted"], "failure: ExitCode")
    assert _policy_verdict(policy, operator, pod, marked) is None
    image = changed(["spec", "containers"], [{"name": "trainer", "image": "attacker:1"}])
    assert "not its spec" in str(_policy_verdict(policy, operator, pod, image))
    assert "not its labels" in str(_policy_verdict(policy, operator, pod, changed(["metadata", "labels"], {})))
    other = changed(["metadata", "annotations"], {"torchspot.dev/index": "0", "team": "b"})
    assert _policy_verdict(policy, operator, pod, other) is not None
    dropped = changed(["metadata", "annotations"], {"torchspot.dev/index": "0"})
    assert _policy_verdict(policy, operator, pod, dropped) is not None
    assert _policy_verdict(policy, "system:serviceaccount:kube-system:deployment-controller", pod, image) is None


def test_metrics_are_exposed(tmp_path: Path) -> None:
    """The Service reaches the operator's metrics port; the ServiceMonitor selects that Service."""
    docs = template(VALUE_SETS["monitored"], tmp_path)
    container = _operator(docs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[METRICS_PORT_ENV] == "9100"
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
    service = one(docs, "Service", "torchspot-metrics")
    pod_labels = _deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"}]
    monitor = one(docs, "ServiceMonitor", "torchspot")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert find(template(), "ServiceMonitor") == []  # off by default: the CRD may not exist


def test_chart_names_the_operators_environment_variable() -> None:
    """The chart cannot import constants.py: this keeps its copy of the name in step."""
    docs = template()
    env = {e["name"]: e for e in _operator(docs)["env"]}
    names = {
        constants.ETCD_PLACEMENT_ENV, constants.OPERATOR_NAMESPACE_ENV, constants.OPERATOR_LABELS_ENV,
        METRICS_PORT_ENV, constants.ETCD_IMAGE_ENV, constants.ETCD_PULL_SECRETS_ENV,
        constants.CORDON_HANDLING_ENV, constants.FULL_DISRUPTION_ENV, constants.NODE_EVICTION_RATE_ENV,
        constants.PEERING_LIFETIME_ENV, constants.OPERATOR_CA_SECRET_ENV, constants.NODE_SELECTOR_ENV,
    }  # fmt: skip
    assert set(env) == names | {"POD_ID"}  # POD_ID: kopf's name for the replica
    # The NotReady grace is set only when the chart says one (else the pods' tolerations decide).
    rendered = template(None, None, "--set", "nodes.notReadyGraceSeconds=30")
    graced = {e["name"]: e for e in _operator(rendered)["env"]}
    assert graced[constants.NODE_GRACE_ENV]["value"] == "30"
    # The etcd NetworkPolicies admit the operator by these: they must be the operator pod's own.
    pod = one(docs, "Deployment", "torchspot")["spec"]["template"]
    labels = json.loads(env[constants.OPERATOR_LABELS_ENV]["value"])
    assert labels.items() <= pod["metadata"]["labels"].items()
    assert env[constants.OPERATOR_NAMESPACE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


BAD_VALUES = [
    ("unknown-key", {"replicaCount": 2}, "replicaCount"),
    ("no-replicas", {"replicas": 0}, "replicas"),
    ("typo-nested", {"crds": {"enabeld": True}}, "enabeld"),
    ("wrong-type", {"watchNamespaces": "ml-a"}, "watchNamespaces"),
    ("bad-enum", {"logLevel": "verbose"}, "logLevel"),
    ("bad-namespace", {"watchNamespaces": ["ML_A"]}, "watchNamespaces"),
    ("bad-digest", {"image": {"digest": "latest"}}, "digest"),
    ("bad-pull-policy", {"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ("probe-port", {"livenessProbe": {"port": 70000}}, "port"),
    ("etcd-on-spot", {"etcd": {"defaultPlacement": {"nodeSelector": {constants.SPOT_LABEL: "spot"}}}}, "nodeSelector"),
    (
        "etcd-spot-toleration",
        {"etcd": {"defaultPlacement": {"tolerations": [{"key": constants.SPOT_LABEL}]}}},
        "tolerations",
    ),
    ("resources-typo", {"resources": {"limit": {"cpu": "1"}}}, "limit"),
    ("account-without-name", {"serviceAccount": {"create": False}}, "serviceAccount.name is required"),
    ("ports-clash", {"metrics": {"port": 8080}}, "metrics.port and livenessProbe.port are both 8080"),
    ("crd-dropped", {"crds": {"enabled": False, "keep": False, "peering": True}}, "crds.enabled=false with crds.keep"),
    ("short-peering", {"peering": {"lifetimeSeconds": 15}}, "lifetimeSeconds"),
]


@pytest.mark.parametrize(("case", "values", "said"), BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_values_are_refused_with_a_message_naming_them(
    case: str, values: dict[str, Any], said: str, tmp_path: Path
) -> None:
    assert said in template_error(values, tmp_path)


def _leaf_paths(values: Any, prefix: str = "") -> set[str]:
    if isinstance(values, dict) and values and not prefix.endswith(("nodeSelector", "annotations", "podAnnotations")):
        paths: set[str] = set()
        for key, value in values.items():
            paths |= _leaf_paths(value, f"{prefix}.{key}" if prefix else key)
        return paths
    return {prefix}


def _schema_paths(schema: dict[str, Any], defs: dict[str, Any], prefix: str = "") -> set[str]:
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    props = schema.get("properties")
    if not props or schema.get("additionalProperties") is not False:
        return {prefix}
    paths: set[str] = set()
    for key, sub in props.items():
        paths |= _schema_paths(sub, defs, f"{prefix}.{key}" if prefix else key)
    return paths


def test_every_value_is_commented_and_in_the_schema() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    # `resources` is compared as a whole: its schema allows quantities the defaults leave out.
    leaves = {p.split(".")[0] if p.startswith("resources.") else p for p in _leaf_paths(values)}
    in_schema = _schema_paths(schema, schema["definitions"]) - {"global"}
    in_schema = {p.split(".")[0] if p.startswith("resources.") else p for p in in_schema}
    assert leaves == in_schema, "values.yaml and values.schema.json name different keys"
    # Every key has a comment line right above it; only the insides of `resources`
    # (a Kubernetes ResourceRequirements, described as a whole) are exempt.
    lines = text.splitlines()
    inside_resources = False
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)[A-Za-z][\w.-]*:", line)
        if not match:
            continue
        if not match.group(1):
            inside_resources = line.startswith("resources:")
        elif inside_resources:
            continue
        assert lines[number - 1].strip().startswith("#"), f"values.yaml:{number + 1}: {line.strip()} has no comment"
