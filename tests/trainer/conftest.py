"""Fixtures of the trainer's tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _liveness_stopped() -> Iterator[None]:
    """Stop the liveness threads of the rendezvous handlers a test made in this process: an agent's
    end with its process, a test's would go on writing to an etcd the test has stopped."""
    yield
    handler_module = sys.modules.get("torchspot_trainer.rendezvous.handler")
    if handler_module is None:  # no handler made here
        return
    for handler in handler_module._ACTIVE:
        if handler._liveness is not None:
            handler._liveness.stop()
    handler_module._ACTIVE.clear()
