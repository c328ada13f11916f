"""`python -m torchspot_operator`: run the operator (kopf) with the handlers of this package.

The same as `kopf run -m torchspot_operator.handlers ...`; the flags go to `kopf run`:
`--all-namespaces` or `--namespace NS` (repeatable), `--liveness
http://0.0.0.0:8080/healthz`, `--log-format json` (structured logs), `--standalone`
(no peering), `--peering NAME`.

More than one replica: with `--peering` and no `--priority`, each replica picks a
random priority, so kopf's peering lets exactly one (the highest) handle objects and
pauses the others until it is gone (see operator/README.md). Replicas with equal
priorities would all pause: one in a million per pair.
"""

from __future__ import annotations

import secrets
import sys

from kopf import cli


def main(argv: list[str] | None = None) -> None:
    """Hand over to kopf's own command line with our handlers module."""
    args = sys.argv[1:] if argv is None else argv
    if any(a == "--peering" or a.startswith("--peering=") for a in args) and not any(
        a.startswith("--priority") for a in args
    ):
        args = [*args, f"--priority={secrets.randbelow(1_000_000) + 1}"]
    cli.main(["run", "-m", "torchspot_operator.handlers", *args], prog_name="python -m torchspot_operator")


if __name__ == "__main__":
    main()
