"""A node's start-up imports at a lower CPU priority than training (`import_yielding`).

Why: a node that joins a job re-forming in place sets itself up while the others train on (live.py's
deferred join), so nobody waits for its imports: the agent's torch, then the fork server's
torch._dynamo, trainer and Blob SDK, 3-4 s of CPU on this project's machine. But where the job's
training shares the node's cores (the sandbox's nodes; several pods of one job on one machine) they
took that training's CPU: 4-6 s of the others' training a join in goodput runs 37-39 (bench/README.md).
Imported at a raised niceness they run on what the training leaves idle. On a node whose cores are
idle while it starts (a cluster's joining node) the priority changes nothing; where every node starts
at once, all yield alike.

Only one thread's niceness is raised (Linux keeps one per thread), and it cannot be lowered again
without CAP_SYS_NICE: so the imports run on a thread of their own while the caller waits, and the
caller, and every process it forks later, keeps its own priority. A thread a module starts at import
(numpy's OpenBLAS server) keeps the raised niceness: the agent and the fork server compute nothing on
it, and a forked worker inherits no thread.

Light on purpose (no torch): `torchspot-run`'s entry (run.py) imports it before anything heavy.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Mapping, Sequence

PROG = "torchspot-run"
"""The launcher's name in its messages (and its console script's)."""
START_NICE = 10
"""Niceness a node's start-up imports add to their thread: under contention CFS gives such a thread
about a tenth of a core's share against a training thread at 0 (the checkpoint saver's SAVER_NICE
yields alike)."""
NICE_ENV = "TORCHSPOT_START_NICE"
"""Overrides START_NICE: a whole number from 0 (the imports at the agent's own priority: a node whose
other tenants keep its cores busy while the whole job waits for it to start) to 19."""
MAX_NICE = 19
"""Linux's largest niceness."""


def start_nice(environ: Mapping[str, str]) -> int:
    """The niceness to add to the start-up imports: NICE_ENV's value, else START_NICE. Pure; a value
    that is not a whole number from 0 to MAX_NICE raises ValueError naming the variable."""
    text = environ.get(NICE_ENV, "").strip()
    if not text:
        return START_NICE
    if not text.isdigit() or int(text) > MAX_NICE:
        raise ValueError(f"{NICE_ENV}={text!r}: expected a whole number from 0 to {MAX_NICE}")
    return int(text)


def import_yielding(modules: Sequence[str], nice: int, *, skip_missing: bool = False) -> None:
    """Import `modules` in order on a new thread whose niceness is raised by `nice`, while this thread
    waits for it (see the module docstring); raise here what an import raised, except, with
    `skip_missing`, an ImportError, which skips that module as multiprocessing's fork server does.

    A thread whose niceness cannot be raised (a seccomp profile that refuses setpriority) imports at
    its own priority: the priority is a courtesy, never a reason not to start."""
    failures: list[BaseException] = []

    def run() -> None:
        me = threading.get_native_id()
        if nice > 0:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, me, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, me) + nice))
        try:
            for name in modules:
                try:
                    importlib.import_module(name)
                except ImportError:
                    if not skip_missing:
                        raise
        except BaseException as exc:  # handed to the caller, which raises it where it waits
            failures.append(exc)

    thread = threading.Thread(target=run, name="torchspot-imports", daemon=True)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]
