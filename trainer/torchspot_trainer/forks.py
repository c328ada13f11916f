"""Helper processes of a worker (the checkpoint saver) forked from the warm server the worker came from.

`torchspot-run` forks its workers from a server that imported torch, the trainer and the Blob SDK
once (launch.py). A helper a worker starts the usual way, a new interpreter (multiprocessing's
`spawn`), imports all of them again: 3.0-3.6 s of CPU on an idle core of this project's machine, paid
by every rank 0 at every start of the restart path, beside the training it should not slow. Asked of
the same server instead, the helper is a sibling of the worker and starts in milliseconds.

Where the worker was not forked by a server (torchrun, `TORCHSPOT_FORK_WORKERS=0`, a test's own
process), `helper_context` is `spawn`, as before. The server ignores SIGTERM and so do its children
until they say otherwise (the saver ignores it anyway). A helper forked so is the server's child, not
the worker's: it watches the worker itself (the saver's `_die_with_worker`) rather than its parent.
"""

from __future__ import annotations

from multiprocessing import forkserver, resource_tracker
from multiprocessing.context import ForkServerContext, SpawnContext

import torch.multiprocessing


def helper_context() -> SpawnContext | ForkServerContext:
    """The multiprocessing context a worker starts its helpers with: its fork server's (see the module
    docstring) where this process was forked by one, else `spawn`."""
    server = getattr(forkserver, "_forkserver", None)
    address = getattr(server, "_forkserver_address", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if server is None or address is None or alive is None or getattr(server, "_forkserver_pid", 0) is not None:
        # No server served us (its address and our "alive" end are set in a process it forked); or
        # this process started the server itself (the agent, whose pid of it is set).
        return torch.multiprocessing.get_context("spawn")
    # In a process the server forked, multiprocessing knows the server's address but not its pid, and
    # would start a new server (a new interpreter) before asking for a fork: ask the one we came from.
    setattr(server, "ensure_running", resource_tracker.ensure_running)  # noqa: B010 - shadows the method
    return torch.multiprocessing.get_context("forkserver")
