"""Fixtures of the trainer's tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports

from torchspot_lab.etcd import free_port
from torchspot_trainer.markers import LEAVING_MARKER, PEER_LOST_ENV, marker_beside


@pytest.fixture(autouse=True)
def _handlers_left_clean() -> Iterator[None]:
    """What the rendezvous handlers a test made in this process leave behind, undone: their liveness
    threads stopped (an agent's end with its process, a test's would go on writing to an etcd the
    test has stopped) and the leaving marker removed (handlers in one process share its markers: one
    that left, in test_backend or test_liveness, must not mark the next test's)."""
    yield
    if PEER_LOST_ENV in os.environ:
        Path(marker_beside(os.environ[PEER_LOST_ENV], LEAVING_MARKER)).unlink(missing_ok=True)
    handler_module = sys.modules.get("torchspot_trainer.rendezvous.handler")
    if handler_module is None:  # no handler made here
        return
    for handler in handler_module._ACTIVE:
        if handler._liveness is not None:
            handler._liveness.stop()
    handler_module._ACTIVE.clear()


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real one-rank gloo group in this process, as a worker of a world of one has (DCP coordinates
    over it)."""
    store = TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
