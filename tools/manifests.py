"""Render the plain manifests in manifests/ from the Helm chart, so the two never drift.

`make manifests` writes them, and the CRD a second time into the operator package
(operator/torchspot_operator/crd.yaml, package data: an installed sandbox admits jobs with
it as the API server would); tests/deploy compares the files with a fresh rendering
and fails if anyone edited one side only. The chart's default values are used, in the
namespace `torchspot`, which manifests/namespace.yaml creates (with the `restricted`
Pod Security level, which the operator pod meets).

Usage: python tools/manifests.py HELM
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "torchspot"
OUT = ROOT / "manifests"
PACKAGE_CRD = ROOT / "operator" / "torchspot_operator" / "crd.yaml"
"""The CRD as the wheel ships it: the same bytes as manifests/crd.yaml."""
RELEASE = "torchspot"
NAMESPACE = "torchspot"
FILES = {
    "crd.yaml": ["crd.yaml"],
    "peering-crd.yaml": ["peering-crd.yaml"],
    "rbac.yaml": ["serviceaccount.yaml", "rbac.yaml"],
    "operator.yaml": ["deployment.yaml", "metrics.yaml"],
}
"""Each plain manifest and the chart templates it is rendered from."""

HEADER = "# Rendered from charts/torchspot by `make manifests` (tools/manifests.py): edit the chart, not this file.\n"

NAMESPACE_YAML = f"""{HEADER}apiVersion: v1
kind: Namespace
metadata:
  name: {NAMESPACE}
  labels:
    # The operator pod runs as non-root with no privileges: it passes the strictest level.
    pod-security.kubernetes.io/enforce: restricted
    pod-security.kubernetes.io/warn: restricted
"""


def render(helm: str) -> dict[str, str]:
    """Every file of manifests/ (name -> text), rendered now from the chart's defaults."""
    files = {"namespace.yaml": NAMESPACE_YAML}
    for name, templates in FILES.items():
        command = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        for template in templates:
            command += ["--show-only", f"templates/{template}"]
        rendered = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        files[name] = HEADER + rendered
    return files


def main() -> None:
    """Write the rendered files into manifests/."""
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    files = render(sys.argv[1])
    for name, text in files.items():
        (OUT / name).write_text(text)
        print(f"wrote {(OUT / name).relative_to(ROOT)}")
    PACKAGE_CRD.write_text(files["crd.yaml"])
    print(f"wrote {PACKAGE_CRD.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
