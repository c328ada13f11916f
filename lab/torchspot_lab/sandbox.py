"""`torchspot lab run JOB.yaml [--scenario SCENARIO.yaml]`: an ElasticJob end to end on one machine.

What runs, all real except the cloud: the Kubernetes API emulator (kmock, with our
additions) and a kubeconfig for it; the operator, the same kopf handlers as in a
cluster, in a thread of this process; the node agent (`cluster/`), which plays
scheduler, kubelet and cloud and runs the job's pods as processes (the trainer under
`torchspot-run`, the managed etcd as a real etcd); Azurite as the job's Blob storage,
with the Secret the job names filled in with Azurite's connection string and, for
`az://datasets/...` data, a synthetic CIFAR-10 uploaded there. The scenario's spot
market is played against it; the run ends when the job Succeeds or Fails, or at the
scenario's timeout, and writes the report (`report.py`).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
import yaml

from torchspot_lab.azurite import Azurite
from torchspot_lab.cluster.agent import NodeAgent
from torchspot_lab.datasets import write_synthetic_cifar10
from torchspot_lab.kubeapi import KubeApi
from torchspot_lab.kubeapi.admission import Admission, AdmissionError
from torchspot_lab.report import Report, build_report, read_pod_events
from torchspot_lab.scenario import CLOCK_SUBMITTED, Scenario
from torchspot_operator import constants, handlers
from torchspot_operator.kube import Kube
from torchspot_operator.metrics import METRICS_PORT_ENV
from torchspot_operator.reconcile import ETCD_KINDS
from torchspot_operator.spec import InvalidSpecError, parse_spec
from torchspot_trainer.checkpoint.manager import committed_steps
from torchspot_trainer.checkpoint.storage import open_storage
from torchspot_trainer.data.datasets import CIFAR_TARBALL

NAMESPACE = "default"
PROGRESS_EVERY = 5.0
"""Seconds between two progress lines."""
CRD_RESOURCE = "crd.yaml"
"""The ElasticJob CRD as shipped, package data of torchspot_operator (manifests/crd.yaml, byte for byte):
the sandbox installs it as a cluster would, from a checkout or an installed wheel alike."""
SYNTHETIC_IMAGES = 1200
"""Training images in the synthetic CIFAR-10 (small enough for a demo on 2 cores)."""
DATASETS = "datasets"
"""The Blob container the sandbox fills with synthetic data for `az://datasets/...` job data."""


def shipped_crd() -> dict[str, Any]:
    """The ElasticJob CRD the operator package ships."""
    text = importlib.resources.files("torchspot_operator").joinpath(CRD_RESOURCE).read_text()
    crd: dict[str, Any] = yaml.safe_load(text)
    return crd


class JobFileError(ValueError):
    """A job file the sandbox cannot run, with the reason."""


def load_job(path: Path, *, code: Path | None = None) -> dict[str, Any]:
    """Read an ElasticJob file and check it as the API server and the operator would; name the problem.
    With `code`, the job's script comes from that local folder (`run_from`)."""
    try:
        body: Any = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise JobFileError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise JobFileError(f"{path}: not YAML: {exc}") from exc
    if not isinstance(body, dict) or body.get("kind") != constants.KIND:
        raise JobFileError(f"{path}: expected one {constants.KIND} (kind: {constants.KIND})")
    if body.get("apiVersion") != constants.API_VERSION:
        raise JobFileError(f"{path}: apiVersion must be {constants.API_VERSION}, not {body.get('apiVersion')!r}")
    name = (body.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise JobFileError(f"{path}: metadata.name is required")
    try:
        body = Admission(shipped_crd()).admit(body, strict=True)  # refused as `kubectl apply` would refuse it
        parse_spec(body.get("spec") or {})
    except (AdmissionError, InvalidSpecError) as exc:
        raise JobFileError(f"{path}: {exc}") from exc
    body["metadata"]["namespace"] = NAMESPACE
    loaded: dict[str, Any] = body
    return loaded if code is None else run_from(loaded, code, path=path)


TRAINER_STAND_IN = "ghcr.io/torchspot/torchspot-trainer:0.1.0"
"""The trainer image, which the sandbox's kubelet runs as the local launcher (kubelet.IMAGES)."""


def run_from(job: dict[str, Any], code: Path, *, path: Path) -> dict[str, Any]:
    """`job` with its trainer container's script taken from the local folder `code`: a user's image (built
    on the trainer image, the script copied in) stands in as the trainer image, whose entry point is
    torchspot-run, and its first argument, the script's path in the image, becomes the file of that name
    in `code`. So a job written for a cluster runs here unchanged but for where its script is. Raises
    JobFileError naming what does not fit (`path`: the job file, for the message)."""
    containers = job["spec"]["template"]["spec"]["containers"]
    args = [str(arg) for arg in containers[0].get("args") or []]
    if containers[0].get("command") or not args or not args[0].endswith(".py"):
        raise JobFileError(
            f"{path}: --code needs a container whose first argument is its script (a .py path in the image) and "
            "no command: torchspot-run runs it"
        )
    script = code / Path(args[0]).name
    if not script.is_file():
        raise JobFileError(f"{path}: --code {code}: no {script.name} there (the job runs {args[0]})")
    containers[0]["image"] = TRAINER_STAND_IN
    containers[0]["args"] = [str(script.resolve()), *args[1:]]
    return job


@dataclass
class Timeline:
    """What happened when, in seconds since the job was submitted (thread-safe appends)."""

    start: float = field(default_factory=time.time)
    entries: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, text: str, at: float | None = None) -> None:
        with self._lock:
            self.entries.append({"t": round((at or time.time()) - self.start, 2), "kind": kind, "text": text})


class _Operator:
    """The operator's kopf loop in a thread of this process, stopped with a flag."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        import asyncio  # noqa: PLC0415 - the thread's own event loop

        try:
            asyncio.run(kopf.operator(clusterwide=True, standalone=True, stop_flag=self._stop))
        except BaseException as exc:  # reported by the sandbox
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _prepare_blob(
    job: dict[str, Any], azurite: Azurite, kube: Kube, api: KubeApi, workdir: Path, *, images: int
) -> None:
    """The job's credentials Secret (Azurite's connection string) and, if it reads az://datasets, the data.
    Jobs that name the same Secret share it, as on a cluster."""
    spec = job["spec"]
    secret = (spec.get("checkpoint") or {}).get("credentialsSecret")
    if secret and api.run(kube.get("v1", "secrets", NAMESPACE, secret)) is None:
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": NAMESPACE},
                "type": "Opaque", "stringData": azurite.env()}  # fmt: skip
        api.run(kube.create(body))
    args = " ".join(str(a) for c in spec["template"]["spec"]["containers"] for a in c.get("args", []))
    if f"az://{DATASETS}/" in args:
        tarball = write_synthetic_cifar10(workdir / "data" / CIFAR_TARBALL, n_train=images, n_test=300)
        prefix = args.split(f"az://{DATASETS}/", 1)[1].split()[0].rstrip("/")
        storage = open_storage(f"az://{DATASETS}/{prefix}", azurite.env())
        storage.put(tarball.name, tarball.read_bytes())


SANDBOX_NODE_GRACE = "0"
"""Seconds a worker stays on a NotReady node in the sandbox before the operator moves it (a cluster's
default is the pod's toleration, 300 s): the sandbox's frozen VMs never come back, and a run lasts
minutes, so a frozen node's worker is replaced as soon as it is NotReady (the rate limit and the
full-disruption guard still apply). With 10 s the frozen node's replacement came too late for the
sandbox test's run to count it."""


class Sandbox:
    """The sandbox's parts, started together and stopped together: the API emulator with the CRD
    installed, Azurite, the node agent with the scenario's pools, and the operator. `run_sandbox` plays a
    scenario's market against one job in it; a caller may instead submit several jobs and act on the
    nodes itself (`agent`), as the examples' test does.

    :param workdir: an empty (or new) folder for the run's Blob data, logs and pods.
    :param scenario: the pools to start with and the freeze delay (its events are the caller's to play).
    :param on_action: told (kind, text) of every eviction, freeze and node added.
    :param operator_env: the operator's settings (its environment variables) for this run.
    """

    def __init__(
        self,
        workdir: Path,
        scenario: Scenario,
        say: Callable[[str], None] = print,
        *,
        on_action: Callable[[str, str], None] = lambda kind, text: None,
        operator_env: Mapping[str, str] | None = None,
    ) -> None:
        if workdir.exists() and any(workdir.iterdir()):
            raise JobFileError(f"{workdir}: not empty (a run's folder holds its Blob data and logs): pick a new one")
        self.workdir, self.scenario, self.say, self.on_action = workdir, scenario, say, on_action
        self._operator_env = dict(operator_env or {})
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Sandbox:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            self.api = stack.enter_context(KubeApi(self.workdir / "api"))
            self.azurite = stack.enter_context(Azurite(self.workdir / "azurite"))
            self.kube = Kube(server=self.api.url, headers={}, ssl_context=True)
            stack.callback(lambda: self.api.run(self.kube.close()))
            # kopf logs in with the kubeconfig; /metrics on a free port (a fixed one may be taken on this machine)
            settings = {
                "KUBECONFIG": str(self.api.kubeconfig),
                METRICS_PORT_ENV: "0",
                constants.NODE_GRACE_ENV: SANDBOX_NODE_GRACE,
                **self._operator_env,
            }
            stack.callback(_restore, {key: os.environ.get(key) for key in settings})
            os.environ.update(settings)
            self.say(
                f"API emulator at {self.api.url} (KUBECONFIG={self.api.kubeconfig}); "
                f"Azurite at {self.azurite.account_url}"
            )
            self.api.run(self.kube.create(shipped_crd()))  # the CRD object: its schema admits jobs, as on a cluster
            self.agent = NodeAgent(self.api, self.workdir, self.scenario, on_action=self.on_action)
            handlers.use_endpoint_resolver(self.agent.resolve)
            stack.callback(handlers.use_endpoint_resolver, None)
            self.agent.start()
            stack.callback(self.agent.stop)
            self.operator = _Operator()
            self.operator.start()
            stack.callback(self.operator.stop)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        if self.operator.error is not None:
            raise RuntimeError(f"the operator stopped: {self.operator.error}") from self.operator.error

    def submit(self, job: dict[str, Any], *, synthetic_images: int = SYNTHETIC_IMAGES) -> None:
        """Create the job (`load_job`'s) as `kubectl apply` sends it, after its Secret and data."""
        _prepare_blob(job, self.azurite, self.kube, self.api, self.workdir, images=synthetic_images)
        self.api.run(self.kube.create(job, strict=True))  # a typo is refused, named

    def status(self, name: str) -> dict[str, Any]:
        """The job's status as the operator last wrote it (empty before its first)."""
        body = self.api.run(self.kube.get(constants.API_VERSION, constants.PLURAL, NAMESPACE, name)) or {}
        status: dict[str, Any] = body.get("status") or {}
        return status

    def workers(self, name: str) -> list[dict[str, Any]]:
        """The job's worker pods in the API, by name."""
        selector = {constants.LABEL_JOB: name, constants.LABEL_ROLE: constants.ROLE_WORKER}
        pods: list[dict[str, Any]] = self.api.run(self.kube.list("v1", "Pod", NAMESPACE, selector))
        return sorted(pods, key=lambda pod: pod["metadata"]["name"])

    def checkpoints(self, job: dict[str, Any]) -> list[int]:
        """Steps with a COMMIT marker under the job's checkpoint URI in Azurite."""
        uri = (job["spec"].get("checkpoint") or {}).get("uri", "")
        if not uri.startswith("az://"):
            return []
        try:
            names = open_storage(uri, self.azurite.env(), create_container=False).list("step-")
        except Exception:  # no container yet: nothing was committed
            return []
        return committed_steps(names)


def _restore(previous: Mapping[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def run_sandbox(
    job_path: Path,
    scenario: Scenario,
    workdir: Path,
    say: Callable[[str], None] = print,
    *,
    synthetic_images: int = SYNTHETIC_IMAGES,
    operator_env: Mapping[str, str] | None = None,
    alongside: Callable[[Sandbox], object] | None = None,
    code: Path | None = None,
) -> Report:
    """Run the job through the scenario; write report.json and report.png into `workdir`.

    :param synthetic_images: training images in the synthetic CIFAR-10 for `az://datasets/...`.
    :param operator_env: the operator's settings (its environment variables) for this run.
    :param alongside: other work in the same sandbox, on a thread from the job's submission on (more jobs,
        on nodes of their own: `NodeAgent.add_spot`'s taints keep this job's pods off them). The sandbox
        stops once both are done; an exception of it is raised here, after the report is written.
    :param code: a local folder the job's script comes from (`run_from`): a user's own job and script.
    """
    job = load_job(job_path, code=code)
    name = job["metadata"]["name"]
    timeline = Timeline()
    sandbox = Sandbox(workdir, scenario, say, on_action=timeline.add, operator_env=operator_env)
    with sandbox, ThreadPoolExecutor(1, thread_name_prefix="sandbox-alongside") as pool:
        beside: Future[object] | None = None
        try:
            sandbox.submit(job, synthetic_images=synthetic_images)
            timeline.start = time.time()
            timeline.add("submit", f"ElasticJob {name} submitted ({len(scenario.initial_nodes())} nodes)")
            beside = None if alongside is None else pool.submit(alongside, sandbox)
            status = _play(sandbox, name, timeline=timeline, say=say)
            left = _left(sandbox, name)
            if beside is not None:
                wait([beside])  # (its outcome is raised below, once this job's report is written)
        finally:
            sandbox.operator.stop()  # what it said is complete before it is read
            events = sandbox.api.run(sandbox.kube.list("v1", "Event", NAMESPACE))
            checkpoints = sandbox.checkpoints(job)
    report = build_report(
        job=name,
        submitted=timeline.start,
        status=status,
        timeline=timeline.entries,
        api_events=[e for e in events if e.get("involvedObject", {}).get("name") == name],
        trainer_events=read_pod_events(workdir / "pods", timeline.start, job=name),
        checkpoints=checkpoints,
        agent_errors=sandbox.agent.errors,
        left=left,
    )
    report.write(workdir)
    if beside is not None:
        beside.result()
    return report


def _play(sandbox: Sandbox, name: str, *, timeline: Timeline, say: Callable[[str], None]) -> dict[str, Any]:
    """Apply the scenario's events on time and print progress until the job ends or time runs out.

    Events count from the scenario's clock; a job that ends before a `firstCheckpoint` clock starts
    ends the run there, its events unplayed, rather than waiting for the timeout."""
    scenario, agent, api, kube = sandbox.scenario, sandbox.agent, sandbox.api, sandbox.kube
    pending = list(scenario.events)
    next_line = 0.0
    market_start = timeline.start if scenario.clock == CLOCK_SUBMITTED else None
    status: dict[str, Any] = {}
    while True:
        now = time.time()
        elapsed = now - timeline.start
        if market_start is None and isinstance((status.get("lastCheckpoint") or {}).get("step"), int):
            market_start = now
            step = status["lastCheckpoint"]["step"]
            timeline.add("market", f"market clock starts: the job's first checkpoint (step {step}) is in its status")
        market = -1.0 if market_start is None else now - market_start
        while pending and pending[0].at <= market:
            event = pending.pop(0)
            if event.action == "evict":
                agent.evict(event.node, notice=event.notice)
            elif event.action == "freeze":
                agent.freeze(event.node)
            elif event.action == "suspend":
                api.run(
                    kube.patch(
                        constants.API_VERSION, constants.PLURAL, NAMESPACE, name, {"spec": {"suspend": event.suspend}}
                    )
                )
                timeline.add("suspend", f"spec.suspend set to {str(event.suspend).lower()}")
            else:
                agent.add_spot(event.count)
        status = sandbox.status(name)
        if elapsed >= next_line:
            next_line = elapsed + PROGRESS_EVERY
            say(_progress_line(elapsed, status))
        if status.get("phase") in ("Succeeded", "Failed", "Invalid") and (not pending or market_start is None):
            say(_progress_line(elapsed, status))
            timeline.add("end", f"job {status['phase']}")
            return status
        if elapsed > scenario.timeout:
            timeline.add("timeout", f"stopped after {scenario.timeout:g} s in phase {status.get('phase')}")
            return {**status, "phase": status.get("phase") or "Unknown", "timedOut": True}
        time.sleep(0.5)


def _left(sandbox: Sandbox, name: str) -> list[str]:
    """The job's worker pods and managed etcd objects still in the API (`Report.left`)."""
    found = [f"Pod {pod['metadata']['name']} ({pod.get('status', {}).get('phase', 'Pending')})"
             for pod in sandbox.workers(name)]  # fmt: skip
    for api_version, kind in ETCD_KINDS:
        if sandbox.api.run(sandbox.kube.get(api_version, kind, NAMESPACE, f"{name}-etcd")) is not None:
            found.append(f"{kind} {name}-etcd")
    return found


def _progress_line(elapsed: float, status: dict[str, Any]) -> str:
    replicas = status.get("replicas") or {}
    checkpoint = (status.get("lastCheckpoint") or {}).get("step", "-")
    ready = f"{replicas.get('ready', 0)}/{replicas.get('desired', '?')}"
    return (
        f"[{elapsed:6.1f}s] {status.get('phase', 'Pending'):<9} ready {ready}  pending {replicas.get('pending', 0)}"
        f"  round {status.get('rendezvousRound', '-')}  checkpoint {checkpoint}  evictions {status.get('evictions', 0)}"
    )
