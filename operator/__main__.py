"""`python -m torchspot.operator`: run the operator (kopf) with the handlers of this package.

The same as `kopf run -m torchspot.operator.handlers ...`; flags after the module
name go to `kopf run` (for example `--all-namespaces`, `--namespace NS`,
`--liveness http://0.0.0.0:8080/healthz`, `--verbose`).
"""

from __future__ import annotations

import sys

from kopf import cli


def main(argv: list[str] | None = None) -> None:
    """Hand over to kopf's own command line with our handlers module."""
    args = sys.argv[1:] if argv is None else argv
    cli.main(["run", "-m", "torchspot.operator.handlers", *args], prog_name="python -m torchspot.operator")


if __name__ == "__main__":
    main()
