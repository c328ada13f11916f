"""manifests/: rendered from the chart (never edited by hand), valid, and examples that really launch."""

from __future__ import annotations

import copy
import importlib.resources
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from torch.distributed.run import get_args_parser

from tests.deploy.helm import ROOT, helm_binary, one, template
from tests.operator.jobs import crd
from tools.manifests import render
from torchspot_lab.kubeapi.admission import Admission, AdmissionError
from torchspot_lab.sandbox import CRD_RESOURCE
from torchspot_operator.builders import JobRef, worker_pod
from torchspot_operator.spec import parse_spec
from torchspot_trainer import REPLICA_GROUP_SIZE_ENV
from torchspot_trainer.config import parse_config
from torchspot_trainer.elastic.settings import checkpoint_settings
from torchspot_trainer.launch import check_args

MANIFESTS = ROOT / "manifests"
EXAMPLES = MANIFESTS / "examples"
JOBS = ["elasticjob.yaml", "imagenet-resnet50.yaml", "h100/imagenet-resnet50.yaml"]
K8S_VERSION = "1.37.0"
ADMISSION = Admission(crd())


def _load(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def test_plain_manifests_are_the_chart_rendered() -> None:
    """Edit the chart and run `make manifests`; this fails when one side changed alone."""
    rendered = render(helm_binary())
    on_disk = {p.name: p.read_text() for p in MANIFESTS.glob("*.yaml")}
    assert sorted(on_disk) == sorted(rendered)
    for name, text in rendered.items():
        assert on_disk[name] == text, f"manifests/{name} differs from the chart: run `make manifests`"


def test_chart_crd_and_manifests_crd_are_identical() -> None:
    in_chart = one(template(), "CustomResourceDefinition", "elasticjobs.torchspot.dev")
    assert in_chart == _load(MANIFESTS / "crd.yaml")


def test_the_packaged_crd_is_the_shipped_one() -> None:
    """The wheel's CRD (what an installed sandbox admits jobs with) is manifests/crd.yaml, byte for byte."""
    packaged = importlib.resources.files("torchspot_operator").joinpath(CRD_RESOURCE).read_text()
    assert packaged == (MANIFESTS / "crd.yaml").read_text(), "the packaged CRD differs: run `make manifests`"


def test_plain_manifests_pass_kubernetes_validate_strict() -> None:
    """The command a user would run, on every file `kubectl apply -f manifests/` applies."""
    files = sorted(str(p) for p in MANIFESTS.glob("*.yaml"))
    tool = Path(sys.executable).parent / "kubernetes-validate"
    done = subprocess.run(
        [str(tool), "--strict", "-k", K8S_VERSION, *files], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    kinds = re.findall(r"passed for resource (\w+)/", done.stdout)
    assert sorted(set(kinds)) == [
        "clusterrole", "clusterrolebinding", "customresourcedefinition", "deployment", "namespace", "role",
        "rolebinding", "service", "serviceaccount",
    ]  # fmt: skip


@pytest.mark.parametrize("name", JOBS)
def test_example_jobs_pass_the_crd_schema_and_the_operator(name: str) -> None:
    body = ADMISSION.admit(_load(EXAMPLES / name), strict=True)  # as `kubectl apply` sends them
    spec = parse_spec(body["spec"])
    assert spec.placement.spot
    assert spec.credentials_secret == _load(EXAMPLES / "blob-credentials.yaml")["metadata"]["name"]


@pytest.mark.parametrize("name", JOBS)
def test_example_worker_pods_are_valid_and_their_command_launches(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod the operator makes from the example: valid for the API, and its arguments are
    accepted by torchspot-run (with the operator's PET_* settings) and by the trainer."""
    body = _load(EXAMPLES / name)
    spec = parse_spec(body["spec"])
    pod = worker_pod(JobRef(body["metadata"]["name"], "default", "uid-1"), spec, 0)
    pod["metadata"]["namespace"] = "default"
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    container = pod["spec"]["containers"][0]
    for env in container["env"]:
        if "value" in env:
            monkeypatch.setenv(env["name"], env["value"])
    launcher = get_args_parser().parse_args(container["args"])  # reads PET_* as torchrun does
    assert check_args(launcher) is None
    assert launcher.module
    assert launcher.training_script == "torchspot_trainer"
    assert launcher.nnodes == f"{spec.min_replicas}:{spec.max_replicas}"
    config = parse_config(launcher.training_script_args)  # reads TORCHSPOT_* as the trainer does
    assert config.checkpoint_uri == spec.checkpoint_uri
    assert config.checkpoint_every == spec.checkpoint_interval


def test_the_secret_example_is_valid_and_holds_no_real_credential() -> None:
    secret = _load(EXAMPLES / "blob-credentials.yaml")
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert set(secret["stringData"]) == {"AZURE_STORAGE_ACCOUNT_URL", "AZURE_STORAGE_SAS_TOKEN"}
    assert "REPLACE" in secret["stringData"]["AZURE_STORAGE_SAS_TOKEN"]


BAD_EXAMPLES = [
    ("min-above-max", "spec.minReplicas", 4, "minReplicas must not exceed maxReplicas"),
    ("no-containers", "spec.template.spec.containers", [], "should be non-empty"),
    ("negative-grace", "spec.failurePolicy.belowMinGraceSeconds", -1, "less than the minimum"),
    ("clean-policy", "spec.cleanPodPolicy", "Sometimes", "is not one of"),
    ("string-replicas", "spec.maxReplicas", "3", "is not of type 'integer'"),
    ("s3-checkpoint", "spec.checkpoint.uri", "s3://bucket/ckpt", "expected az://CONTAINER/PREFIX"),
    ("restart-always", "spec.template.spec.restartPolicy", "Always", "must be Never"),
]


def _set(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(body)
    node = changed
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return changed


@pytest.mark.parametrize(("case", "path", "value", "said"), BAD_EXAMPLES, ids=[c[0] for c in BAD_EXAMPLES])
def test_broken_copies_of_the_example_are_rejected(case: str, path: str, value: Any, said: str) -> None:
    """What a user gets wrong when editing the example: `kubectl apply` refuses it, naming the field."""
    body = _set(_load(EXAMPLES / "elasticjob.yaml"), path, value)
    with pytest.raises(AdmissionError) as info:
        ADMISSION.admit(body)
    assert any(problem.startswith(path) and said in problem for problem in info.value.problems), info.value.problems


@pytest.mark.parametrize("example", ["ddp", "transformers", "fsdp"])
def test_each_examples_job_launches_its_script_with_the_jobs_checkpoint_settings(example: str) -> None:
    """examples/*/elasticjob.yaml: admitted as `kubectl apply` sends it; its pod valid; torchspot-run takes
    its script, which its image copies where the job names it; and the job's checkpoint settings reach
    the script's manager, which names none (torchspot.elastic's TORCHSPOT_CHECKPOINT_* defaults)."""
    folder = ROOT / "examples" / example
    body = ADMISSION.admit(_load(folder / "elasticjob.yaml"), strict=True)
    spec = parse_spec(body["spec"])
    pod = worker_pod(JobRef(body["metadata"]["name"], "default", "uid-1"), spec, 0)
    pod["metadata"]["namespace"] = "default"
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    container = pod["spec"]["containers"][0]
    launcher = get_args_parser().parse_args(container["args"])
    assert not launcher.module
    script = Path(launcher.training_script)
    copied = [line.split() for line in (folder / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    (command,) = [c for c in copied if c[-1] == f"{script.parent}/"]
    assert command[1] == "--chown=10001:10001"
    # Every Python file of the example is copied, the script among them (its imports are its neighbours;
    # a build from examples/ names them by their folders: the FSDP example's corpus is the Transformers one's).
    assert {f.name for f in folder.glob("*.py")} <= {Path(name).name for name in command[2:-1]}, command
    assert script.name in [Path(name).name for name in command]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    chosen = checkpoint_settings(None, None, None, env)
    assert chosen == (spec.checkpoint_uri, spec.checkpoint_interval, spec.checkpoint_keep)
    if spec.replica_group_size > 1:  # the FSDP example's HSDP groups: the script's --shard-size default
        assert env[REPLICA_GROUP_SIZE_ENV] == str(spec.replica_group_size)


def test_make_images_builds_every_image_the_chart_and_the_examples_name() -> None:
    """`make images REGISTRY=...` tags, for that registry, each image a user is told to run: the chart's
    operator (at its appVersion), the trainer the example jobs run and the examples' own; each example is
    built on the trainer image built beside it. (`make -n`: the commands, as no Docker engine runs here.)"""
    registry = "myacr.azurecr.io"
    said = subprocess.run(["make", "-s", "-n", "images", f"REGISTRY={registry}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    built = set(re.findall(r"-t (\S+)", said))
    values = yaml.safe_load((ROOT / "charts" / "torchspot" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "torchspot" / "Chart.yaml").read_text())
    named = {f"{values['image']['repository']}:{chart['appVersion']}"}
    for job in [*ROOT.glob("examples/*/elasticjob.yaml"), *EXAMPLES.glob("*.yaml")]:
        body = _load(job)
        if body.get("kind") == "ElasticJob":
            named |= {c["image"] for c in body["spec"]["template"]["spec"]["containers"]}
    published = "ghcr.io/torchspot/"
    assert all(image.startswith(published) for image in named), named
    assert {image.replace(published, f"{registry}/") for image in named} <= built, (named, built)
    trainer = f"{registry}/torchspot-trainer:{chart['appVersion']}"
    assert said.count(f"--build-arg TRAINER_IMAGE={trainer}") == len(list(ROOT.glob("examples/*/Dockerfile")))
