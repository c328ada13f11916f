"""`python -m torchspot_operator`: run the operator (kopf) with the handlers of this package.

The same as `kopf run -m torchspot_operator.handlers ...`; the flags go to `kopf run`:
`--all-namespaces` or `--namespace NS` (repeatable), `--liveness
http://0.0.0.0:8080/healthz`, `--log-format json` (structured logs), `--standalone`
(no peering), `--peering NAME`.

More than one replica: with `--peering` and no `--priority`, each replica's priority counts
down from its start time (`start_priority`), so kopf's peering lets the oldest live replica
handle objects and pauses the others until it is gone (see operator/README.md): a standby that
starts or restarts never takes over from a healthy leader, where random priorities made it do
so half the time. A random last three digits keep two replicas started in the same millisecond
apart (equal priorities would pause both).
"""

from __future__ import annotations

import os
import secrets
import sys
import time

from kopf import cli

from torchspot_operator import constants


def start_priority(started: float, tiebreak: int) -> int:
    """A replica's peering priority: higher the earlier it started (milliseconds before
    `PRIORITY_HORIZON`), with `tiebreak` (0-999) as the last three digits."""
    return int((constants.PRIORITY_HORIZON - started) * 1000) * 1000 + tiebreak


def main(argv: list[str] | None = None) -> None:
    """Hand over to kopf's own command line with our handlers module."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("--all-namespaces", "-A") for a in args):  # one cluster-wide watch per kind (informer.py)
        os.environ[constants.ALL_NAMESPACES_ENV] = "1"
    if any(a == "--peering" or a.startswith("--peering=") for a in args) and not any(
        a.startswith("--priority") for a in args
    ):
        args = [*args, f"--priority={start_priority(time.time(), secrets.randbelow(1000))}"]
    cli.main(["run", "-m", "torchspot_operator.handlers", *args], prog_name="python -m torchspot_operator")


if __name__ == "__main__":
    main()
