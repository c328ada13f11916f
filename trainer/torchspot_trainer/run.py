"""`torchspot-run`'s entry point: the launcher's own imports (torch) at the start-up priority
(startup.py), then the launcher (launch.py).

A module of its own because launch.py imports torch at its top: imported by this one's caller, torch
would load at the agent's priority before anything could lower it."""

from __future__ import annotations

import os
import sys

from torchspot_trainer.startup import PROG, import_yielding, start_nice

LAUNCHER = "torchspot_trainer.launch"


def main() -> None:
    """Import the launcher yielding to training on the same cores, then run it."""
    try:
        nice = start_nice(os.environ)
    except ValueError as exc:
        sys.exit(f"{PROG}: error: {exc}")
    import_yielding((LAUNCHER,), nice)
    from torchspot_trainer.launch import main as launch  # noqa: PLC0415 - imported just above, yielding

    launch()


if __name__ == "__main__":
    main()
