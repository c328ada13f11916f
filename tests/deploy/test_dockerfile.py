"""The Dockerfile, checked without a Docker engine (none runs here): what it copies exists,
what it runs is ours, its final stages are non-root and pinned, and the pinned package
lists cover what each image imports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field

import pytest

from tests.deploy.helm import ROOT

DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    """One FROM ... AS name block, with the instructions under it."""

    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current = f"{current} {line}" if current else line
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        logical.append(current)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in logical]


def _stages() -> tuple[dict[str, str], dict[str, Stage]]:
    """The global ARG defaults and the named stages."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for keyword, rest in _instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+) AS (\S+)", rest, flags=re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            current = stages[match.group(2)] = Stage(match.group(2), match.group(1))
        elif current is None:
            if keyword == "ARG" and "=" in rest:
                key, value = rest.split("=", 1)
                args[key] = value
        else:
            current.instructions.append((keyword, rest))
    return args, stages


def test_stages_for_the_operator_and_the_trainer() -> None:
    args, stages = _stages()
    assert {"build", "operator", "trainer"} <= set(stages)
    assert stages["trainer"].base == "${TRAINER_BASE}"
    assert "cuda" in args["TRAINER_BASE"]  # a CUDA-enabled PyTorch base by default
    assert "pytorch" in args["TRAINER_BASE"]
    for image in args.values():
        assert ":" in image
        assert not image.endswith(":latest"), image


def test_every_copied_path_exists() -> None:
    _, stages = _stages()
    for stage in stages.values():
        for copy in stage.all("COPY"):
            if copy.startswith("--from="):
                assert copy.split()[0].removeprefix("--from=") in stages
                continue
            *sources, _ = copy.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{stage.name}: COPY {source}: no such file"


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_final_stages_run_our_console_scripts_as_a_non_root_user(target: str) -> None:
    _, stages = _stages()
    stage = stages[target]
    users = stage.all("USER")
    assert users
    assert users[-1] not in ("0", "root")
    entry = json.loads(stage.all("ENTRYPOINT")[-1])
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry[0] in scripts, f"{target}: ENTRYPOINT {entry[0]} is not a console script of the project"
    runs = " ".join(stage.all("RUN"))
    for tool in ("gcc", "build-essential", "apt-get install"):
        assert tool not in runs, f"{target}: build tools ({tool}) in a final stage"
    assert f"--uid {users[-1]}" in runs  # the user exists in the image


def test_the_trainer_pins_torch_as_the_project_does() -> None:
    _, stages = _stages()
    pinned = [a for a in stages["trainer"].all("ARG") if a.startswith("TORCH_VERSION=")]
    assert pinned == ["TORCH_VERSION=2.13.0"]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in dependencies


def _pins(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in (ROOT / "requirements" / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            assert re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", line), f"requirements/{name}: {line!r} is not pinned"
            key, version = line.split("==")
            pins[key.lower().replace("_", "-")] = version
    return pins


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (`kubernetes>=37,<38` -> `kubernetes`)."""
    return re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _distributions_loaded_by(imports: str) -> set[str]:
    """The distributions (normalized names) whose modules a fresh interpreter has loaded after `imports`."""
    probe = (
        f"import sys, json, importlib.metadata as md\n{imports}\n"
        "owners = md.packages_distributions()\n"
        "loaded = [m for m, v in list(sys.modules.items()) if v is not None]\n"
        "print(json.dumps(sorted({d for m in loaded for d in owners.get(m.split('.')[0], [])})))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return {_name(d) for d in json.loads(done.stdout)}


def test_trainer_requirements_pin_exactly_the_projects_dependencies() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {_name(d) for d in dependencies}
    assert set(_pins("trainer.txt")) == names - {"torch"}


def test_operator_requirements_cover_what_the_operator_imports() -> None:
    """Import the operator as its image runs it and list the distributions that got loaded. The `kubernetes`
    client imports kubernetes-validate (a test dependency here) only if it is installed: the image has none,
    and the probe hides it."""
    loaded = _distributions_loaded_by(
        "sys.modules['kubernetes_validate'] = None\nimport torchspot_operator.handlers, torchspot_operator.__main__"
    )
    needed = loaded - {"torchspot", "setuptools"}
    assert "torch" not in needed  # the operator image has no torch
    missing = needed - set(_pins("operator.txt"))
    assert not missing, f"requirements/operator.txt lacks {sorted(missing)}"


def test_a_workers_runtime_needs_none_of_the_operators_packages() -> None:
    """What a user's training image installs (the distribution without extras: requirements/trainer.txt)
    is all a worker imports: torchspot-run, the rendezvous, the trainer and torchspot.elastic load none
    of the `operator` extra's packages (kopf, aiohttp, kubernetes...)."""
    loaded = _distributions_loaded_by(
        "import torchspot_trainer.launch, torchspot_trainer.rendezvous.handler, torchspot_trainer.train\n"
        "import torchspot_trainer.__main__, torchspot.elastic"
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    operator_only = {_name(d) for d in project["optional-dependencies"]["operator"]}
    assert {"kopf", "aiohttp", "kubernetes"} <= operator_only
    assert not loaded & operator_only, sorted(loaded & operator_only)
    assert "torch" in loaded
