"""`python -m torchspot_trainer`: the training program that runs under torchspot-run."""

from __future__ import annotations

import logging
import sys

from torchspot_trainer.checkpoint.storage import quiet_sdk_logs
from torchspot_trainer.config import parse_config
from torchspot_trainer.train import Trainer


def build(argv: list[str] | None = None) -> Trainer:
    """Logging, then the trainer for these flags (a bad flag stops here, naming it)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_sdk_logs()
    return Trainer(parse_config(argv))


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train (resuming from the newest checkpoint), exit 0 when done."""
    build(argv).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
