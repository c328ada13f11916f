"""The sandbox end to end: the real operator, the node agent's pods as real processes
(torchspot-run, the trainer, a real etcd), Azurite, and a spot market with an eviction
with notice, a frozen node, capacity returning, a hard eviction after which capacity
never returns, and a suspension of the job and its resumption. In the same sandbox run, on
nodes of their own, the examples' user scripts re-form in place through their own faults
(tests/lab/examples.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.lab.examples import Examples
from torchspot.cli import main
from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import NodeFactory
from torchspot_lab.report import read_pod_events
from torchspot_lab.sandbox import TRAINER_STAND_IN, load_job, run_sandbox
from torchspot_lab.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[2]
DEMO_JOB = ROOT / "lab" / "jobs" / "cifar10-demo.yaml"
KUBECTL = str(Path(sys.executable).parent / "kubectl")  # installed by make venv (tools/kube_tools.py)

pytestmark = pytest.mark.slow
SCRIPTED = ROOT / "tests" / "trainer" / "scripted_trainer.py"
JOB = "cifar10-resnet18"
"""The demo job's name (its file's): the sandbox runs the examples' jobs beside it."""
STEPS = 150
STEP_PACE = 0.6
"""Seconds a step takes at least (scripted_trainer.py): 150 steps last 90 s of training or more, so the
market's last events (65 s, 75 s, 85 s after the first checkpoint at step 5) fall inside the run
however idle the cores. With ResNet-18's
steps the run's length followed the machine's load instead (122 s alone, 225 s in the suite)."""


def _small_job(tmp: Path) -> Path:
    """The demo job (its CIFAR-10 data from Blob, its operator settings) with small_cnn for the model and
    paced steps: what this test proves is the operator's and the runtime's, and ResNet-18 would only
    hold the suite's two cores for as long as the market lasts."""
    job = yaml.safe_load(DEMO_JOB.read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["-m", "torchspot_trainer"]
    # The restart path through the operator (the demo re-forms in place: examples.py runs the examples'
    # jobs in place through the sandbox, and the equivalence test covers that path's guarantees).
    replaced = ("--epochs", "--global-batch-size", "--model", "--in-place")
    args = [a for a in container["args"][2:] if not a.startswith(replaced)]
    container["args"] = [str(SCRIPTED), *args, "--model=small_cnn", "--global-batch-size=12", "--epochs=100",
                         f"--max-steps={STEPS}", "--no-in-place"]  # fmt: skip
    container.setdefault("env", []).append({"name": "STEP_PACE", "value": str(STEP_PACE)})
    job["spec"]["checkpoint"]["intervalSteps"] = 5
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


MARKET_NODES = ("spot-1", "spot-2", "spot-3")
"""The spot nodes the market's events name: the job's; the examples' jobs are given nodes of their own."""
MARKET = {
    "pools": {"onDemand": {"nodes": 1}, "spot": {"nodes": 3, "gpus": 1}},
    "notReadyAfter": 4,
    "timeout": 400,
    # From the first checkpoint, not the submission: a CI run whose job started late on its busy cores
    # had the notice come while the first round still built DDP, with no step to checkpoint.
    "clock": "firstCheckpoint",
    "events": [
        {"at": 5, "evict": "spot-3", "notice": True},
        {"at": 30, "freeze": "spot-2"},
        {"at": 35, "addSpot": 2},
        {"at": 65, "evict": "spot-1"},  # capacity never comes back: a replacement stays Pending to the end
        {"at": 75, "suspend": True},  # by step 5 + 75 / STEP_PACE = 130 at the most: before the last
        {"at": 85, "suspend": False},
    ],
}


@pytest.mark.slow(seconds=150, cpu_heavy=2)  # its market is timed, and the examples' jobs train beside it
def test_a_job_survives_notice_frozen_and_hard_evictions_to_success_beside_the_examples_in_place(
    tmp_path: Path, etcd: EtcdServer, run_id: str, nodes: NodeFactory
) -> None:
    """The demo's job on the restart path through the scenario's market; beside it, the examples' jobs
    in place (`Examples`): one sandbox run for both, as the suite's budget asks."""
    examples = Examples(tmp_path / "examples", etcd, run_id, nodes)
    lines: list[str] = []
    seen: dict[str, Any] = {}

    def say(line: str) -> None:  # once the job runs at full size, look at it with kubectl, as a user would
        lines.append(line)
        if "ready 3/3" in line and not seen:
            for what in ("ej", "pods"):
                done = subprocess.run([KUBECTL, "get", what, "-o", "json"], capture_output=True, text=True, check=False)
                seen[what] = json.loads(done.stdout) if done.returncode == 0 else done.stderr

    report = run_sandbox(_small_job(tmp_path), parse_scenario(MARKET), tmp_path / "run", say=say, alongside=examples)

    assert report.phase == "Succeeded", report.summary()
    assert report.agent_errors == []
    assert report.final_step == STEPS
    # The operator saw and said it: three workers lost (notice, frozen, hard), each replaced.
    assert report.status["evictions"] >= 3, report.summary()
    assert report.status["failures"] == 0
    texts = [e["text"] for e in report.timeline]
    # The market's clock started at the first checkpoint, before any of its events.
    # (The examples' own evictions and freezes, on their nodes, are in the sandbox's timeline too.)
    ours = [e for e in report.timeline if e["kind"] not in ("evict", "freeze") or e["text"].split()[0] in MARKET_NODES]
    kinds = [e["kind"] for e in ours]
    assert any(t.startswith("market clock starts: the job's first checkpoint (step ") for t in texts), texts
    assert kinds.index("market") < min(kinds.index(k) for k in kinds if k in ("evict", "freeze", "suspend"))
    lost = [t for t in texts if t.startswith("Warning Evicted")]
    # With notice the kubelet ends the pod (a DisruptionTarget, TerminationByKubelet, or reason
    # Terminated) before the VM goes; the operator may see either first.
    notice_seen = ("on spot-3: node is gone", "(Terminated", "(TerminationByKubelet")
    assert any(said in t for t in lost for said in notice_seen), lost
    assert any("on spot-2: node is unreachable (Ready Unknown), past the pod's grace" in t for t in lost), (
        texts
    )  # frozen
    assert any("on spot-1: node is gone" in t for t in lost), texts  # vanished
    assert sum(t.startswith("Normal Replaced") for t in texts) >= 3
    # Every resumption loaded a checkpoint the run had committed to Blob, or a surviving node's
    # own copy of the state at its last completed step.
    events = read_pod_events(tmp_path / "run" / "pods", 0.0, job=JOB)  # this job's pods (not the examples')
    committed = {e["step"] for e in events if e["event"] in ("checkpoint", "emergency_checkpoint") and e["ok"]}
    resumed = report.restarts[1:]
    assert len(resumed) >= 3, report.summary()
    assert {r["from"] for r in resumed} <= {"checkpoint", "snapshot"}, resumed
    from_blob = {r["step"] for r in resumed if r["from"] == "checkpoint"}
    assert from_blob <= committed, (resumed, sorted(committed))
    # The eviction with notice lost nothing: its emergency checkpoint is where the next round began.
    emergency = sorted((e for e in events if e["event"] == "emergency_checkpoint"), key=lambda e: e["t"])
    # The evicted node's notice writes one to Blob (the restarts of the nodes that stay keep their
    # state in their snapshots instead), and so does the suspension, which stops every worker.
    assert len(emergency) == 2, (emergency, _exits(tmp_path / "run"))
    assert all(e["ok"] for e in emergency)
    assert report.restarts[1]["step"] == emergency[0]["step"]
    assert report.restarts[1]["lost"] == 0
    # Suspended, the job kept its record; resumed, it started a fresh run from the suspension's
    # emergency checkpoint in Blob, redoing no step. Counted from the resume: a round re-formed after
    # the hard eviction may start between the suspend order and the suspension stopping the workers
    # (a CI run saw the recovery from 85 s start after the order at 95 s, from a node's snapshot).
    resumed_at = next(e["t"] for e in report.timeline if e["text"] == "spec.suspend set to false")
    after = [r for r in report.restarts if r["t"] > resumed_at]
    assert after, report.summary()
    assert (after[0]["from"], after[0]["step"], after[0]["lost"]) == ("checkpoint", emergency[1]["step"], 0)
    assert report.status["resumes"] == 1
    assert report.status["runId"].endswith("-r1")
    assert any(t.startswith("Normal Suspended") for t in texts)
    assert any(t.startswith("Normal Resumed") for t in texts)
    # Capacity never came back after the hard eviction: the run finished with a replacement still
    # Pending. The job Succeeded at the first worker's exit: no worker group formed at the final step,
    # and neither the Pending worker nor the managed etcd is left behind.
    assert all(r["step"] < STEPS for r in report.restarts), report.restarts
    assert not [e for e in events if e["event"] == "start" and e["step"] == STEPS]
    assert not [x for x in report.left if "Pending" in x or "etcd" in x], report.left
    # Blob holds the final checkpoint; the report and its plot were written.
    assert report.checkpoints[-1] == STEPS
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["phase"] == "Succeeded"
    assert saved["series"]
    assert (tmp_path / "run" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 0 < report.goodput < 1
    assert any("ready 3/3" in line for line in lines)  # the progress display showed the full size
    # kubectl, pointed at the sandbox by the kubeconfig it wrote, saw the job running and its pods.
    assert isinstance(seen["ej"], dict), seen["ej"]
    phases = {j["metadata"]["name"]: j.get("status", {}).get("phase") for j in seen["ej"]["items"]}
    assert phases.keys() == {JOB, "ddp-example", "transformers-example"}, phases
    assert phases[JOB] == "Running", phases
    assert isinstance(seen["pods"], dict), seen["pods"]
    names = {p["metadata"]["name"] for p in seen["pods"]["items"]}
    assert {f"{JOB}-worker-0", f"{JOB}-etcd-0"} <= names
    examples.check()  # the examples' jobs in the same run, in place


def _exits(run: Path) -> list[str]:
    """What each pod's workers said as they were told to stop: when an emergency checkpoint is
    missing, these lines say whether the notice came in a round's set-up or a worker was ended."""
    said = ("eviction notice", "no step boundary", "skipped", "training stopped", "left it")
    return [
        f"{log.parent.name}: {line[:200]}"
        for log in sorted(run.glob(f"pods/*{JOB}-worker-*/log.txt"))
        for line in log.read_text(errors="replace").splitlines()
        if any(s in line for s in said)
    ]


@pytest.mark.parametrize(
    ("job", "said"),
    [
        ({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}, "expected one ElasticJob"),
        ({"apiVersion": "torchspot.dev/v1", "kind": "ElasticJob", "metadata": {"name": "x"}}, "apiVersion must be"),
        (
            {"apiVersion": "torchspot.dev/v1alpha1", "kind": "ElasticJob", "metadata": {"name": "x"},
             "spec": {"minReplicas": 2, "maxReplicas": 1,
                      "template": {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}}}},
            "spec.minReplicas: minReplicas must not exceed maxReplicas",  # the CRD's CEL rule, as kubectl says
        ),
        (
            {"apiVersion": "torchspot.dev/v1alpha1", "kind": "ElasticJob", "metadata": {"name": "x"},
             "spec": {"minReplicas": 1, "maxReplicas": 1,
                      "template": {"spec": {"nodeSelecter": {"pool": "gpu"},
                                            "containers": [{"name": "trainer", "image": "trainer:1"}]}}}},
            'unknown field "spec.template.spec.nodeSelecter"',  # the pod template's schema, strict as kubectl
        ),
    ],
    ids=["not-a-job", "wrong-version", "bad-spec", "template-typo"],
)  # fmt: skip
def test_a_bad_job_file_stops_before_anything_starts(
    job: dict[str, Any], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["lab", "run", str(path), "--out", str(tmp_path / "out")]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_code_runs_a_job_for_a_users_image_from_a_local_folder_or_says_why_it_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--code FOLDER`: the job's image stands in as the trainer's and its script is FOLDER's file of the same
    name (the sandbox test runs the examples so: tests/lab/examples.py). A folder without it, or a job
    whose container does not name a script, stops before anything starts, naming why."""
    example = ROOT / "examples" / "ddp"
    job = load_job(example / "elasticjob.yaml", code=example)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == TRAINER_STAND_IN
    assert container["args"][0] == str((example / "train.py").resolve())
    assert main(["lab", "run", str(example / "elasticjob.yaml"), "--code", str(tmp_path), "--out",
                 str(tmp_path / "out")]) == 2  # fmt: skip
    assert f"--code {tmp_path}: no train.py there (the job runs /home/trainer/ddp/train.py)" in capsys.readouterr().err
    assert main(["lab", "run", str(DEMO_JOB), "--code", str(example), "--out", str(tmp_path / "out")]) == 2
    assert "--code needs a container whose first argument is its script" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_bad_scenario_file_stops_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "market.yaml"
    scenario.write_text("events:\n  - {at: 10, evict: spot-7}\n")
    assert main(["lab", "run", str(DEMO_JOB), "--scenario", str(scenario), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "market.yaml" in err
    assert "events[0].evict: no node spot-7" in err
    assert not (tmp_path / "out").exists()
