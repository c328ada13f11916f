"""The agent's warm fork server, and what the workers it forks run (launch.py's `_launch_forked` starts it).

The server is a fork of the agent after its imports (`fork_server_here`), or multiprocessing's own where
this Python's forkserver differs; it preloads torch and the rest of the program's imports (launch.py's
`fork_preload`), and forks each worker from there: a worker restarted at a membership change starts in
about 0.1 s instead of a new interpreter's seconds. A forked worker runs our trainer (`run_trainer`) or
any Python program (`run_program`), takes SIGTERM back, sizes torch's thread pool as a new interpreter
would, and refuses to start where the server initialised CUDA. The helpers a worker forks from the same
server (the checkpoint saver) are forks.py's.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import runpy
import signal
import socket
import sys
from collections.abc import Mapping
from multiprocessing import connection, forkserver, resource_tracker

from torchspot_trainer import PROG
from torchspot_trainer.markers import agent_restarting, node_leaving

__all__ = [
    "FORK_ENV",
    "SERVER_NAME",
    "THREADS_ENV",
    "fork_server_here",
    "name_process",
    "refuse_bad_fork",
    "run_program",
    "run_trainer",
    "start_fork_server",
    "take_thread_count",
    "thread_count",
]

FORK_ENV = "TORCHSPOT_FORK_WORKERS"
"""Set to 0 to start each worker as a new interpreter, as torchrun does, instead of forking it from the
warm server. Forked by default: a restart at every membership change then costs a fork (about a tenth
of a second) and a model set-up from preloaded modules, instead of a new interpreter's start and
imports (seconds), with no slower steps."""

_FINISHED: list[object] = []
"""Trainers whose run ended, kept until the forked worker exits (see run_trainer)."""


THREADS_ENV = "OMP_NUM_THREADS"
"""The size of torch's intra-op pool a worker gets: torchrun sets 1 for several workers a node where the
pod set none, and puts it in each worker's environment."""


def thread_count(environ: Mapping[str, str]) -> int | None:
    """THREADS_ENV's count where it is a positive integer, else None (torch's default stands). Pure."""
    value = environ.get(THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def take_thread_count() -> None:
    """Size torch's intra-op pool by this worker's THREADS_ENV, as a new interpreter's torch does as it
    starts. A worker forked from the warm server kept the size the agent's torch took when it was
    imported, before torchrun set the variable: with several workers a node and nothing set in the pod,
    each ran a thread per core (2 where torchrun asked 1, on 2 cores) instead of one."""
    import torch  # noqa: PLC0415 - the fork server has imported it already

    count = thread_count(os.environ)
    if count is not None and torch.get_num_threads() != count:
        torch.set_num_threads(count)


def run_trainer(*argv: str) -> int:
    """The worker's entry point when the agent forks it (module-level: the fork server pickles it by name).

    The finished trainer (which keeps its run) stays referenced: freeing DDP's reducer destroys its
    gloo process group, and in a forked worker that destructor waited for ever joining a gloo
    thread (py-spy: ~ProcessGroupGloo in std::thread::join), so the agents never saw the run
    end. A forked worker ends with os._exit, which frees nothing.
    """
    from torchspot_trainer.__main__ import build  # noqa: PLC0415 - imported in the fork server already

    refuse_bad_fork()
    take_thread_count()
    hear_sigterm()
    trainer = build(list(argv))
    trainer.train()
    _FINISHED.append(trainer)
    return 0


def run_program(target: str, kind: str, *argv: str) -> int:
    """The entry point of a forked worker that runs any program: `-m target` (kind "module") or the
    script `target` (kind "script"), as `python` would run it, with `argv` as its arguments.

    Module-level, as run_trainer, and for the same reason it keeps the program's globals: freeing
    its process group in a forked worker can block for ever. `sys.exit(0)` (or None) is a success;
    another exit status, or an exception, is the worker's failure as torchrun reports it. An exception goes
    to the program's own `sys.excepthook` first, as `python` would hand it there (multiprocessing, which
    starts the forked worker, prints it and exits without): the recovery API's keeps the node's snapshot
    (elastic/leaving.py), and a worker whose loop raised as a peer was lost left none before."""
    refuse_bad_fork()
    take_thread_count()
    hear_sigterm()
    sys.argv = [target, *argv]
    try:
        if kind == "module":
            ran = runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            ran = runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
        return 0
    except BaseException:
        if sys.excepthook is not sys.__excepthook__:  # (the default would print what multiprocessing prints)
            sys.excepthook(*sys.exc_info())
        raise
    _FINISHED.append(ran)
    return 0


def hear_sigterm() -> None:
    """Take SIGTERM's default back in a forked worker (the server ignores it: start_fork_server), and
    act on one that came before: a SIGTERM that arrives while a signal is ignored is lost, so a worker
    its agent stopped while it was starting would run on until the agent's SIGKILL 30 s later, with no
    snapshot (a CI run lost 9 steps so, when a second joiner came right after the first). The agent
    marks why it stops its workers before it signals them (markers.py): a worker that finds the mark
    when it starts stops as if the signal had reached it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if agent_restarting() or node_leaving():
        os.kill(os.getpid(), signal.SIGTERM)


def _warm() -> None:
    """A worker that does nothing: forking it waits until the server has imported FORK_PRELOAD, and
    shows whether the server is fit to fork workers (`refuse_bad_fork`) before the node joins."""
    refuse_bad_fork()


def refuse_bad_fork() -> None:
    """Exit with a message if this process was forked from one that had initialised CUDA (something
    it preloaded asked the device at import): CUDA cannot be used in such a child, and the worker
    would fail at its first device call, after joining the group and holding it up."""
    import torch  # noqa: PLC0415 - the fork server has imported it already

    if torch.cuda._is_in_bad_fork():  # torch's own check (private: what its lazy init raises on)
        raise SystemExit(
            f"{PROG}: error: the fork server initialised CUDA before forking this worker (an import in "
            f"FORK_PRELOAD queried the device); set {FORK_ENV}=0 to start each worker as a new process"
        )


SERVER_NAME = b"torchspot-forks"
"""The fork server's process name (what `ps` and `top` show; Linux's 15-byte `comm`): forked from the
agent, its command line is the agent's."""


def start_fork_server(preload: list[str], *, wait: bool = True) -> None:
    """Start the fork server, and (`wait`) wait until it has imported `preload`.

    A fork of this process where Python allows it (`fork_server_here`), so torch, which the agent has
    imported already, is not imported a second time; else multiprocessing's own, a new interpreter.
    It ignores SIGTERM: a SIGTERM sent to every process of the pod must leave it to the agent to stop
    the workers. The agent hears of a worker's exit through the server, so a server killed first
    reads as every worker gone at once, and the agent would leave while its workers still write
    their emergency checkpoint.
    """
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a new interpreter keeps it through exec
    try:
        if not fork_server_here(preload):
            multiprocessing.set_forkserver_preload(preload)
            forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not wait:  # the first worker's fork waits for the imports instead, and refuses a bad fork itself
        return
    # A fork is served once the server's imports are done: this one returns then.
    warm = multiprocessing.get_context("forkserver").Process(target=_warm, name="torchspot-warm-up")
    warm.start()
    warm.join()
    if warm.exitcode:  # refuse_bad_fork said why on its stderr
        raise SystemExit(f"{PROG}: error: the warm fork server cannot start workers (exit {warm.exitcode})")


def fork_server_here(preload: list[str]) -> bool:
    """Start multiprocessing's fork server as a fork of this process, which then imports `preload` and
    serves forks as the server multiprocessing starts would; False (nothing started) where this
    Python's forkserver module is not the one this was written against (3.11-3.13's).

    Why: multiprocessing starts its server as a new interpreter, which imports torch again: 3.0-3.6 s
    of CPU on an idle core here (1.3 s on a faster one), paid by every agent before its node joins,
    and by a joining node on cores the others may be training on. Forked after the agent's own
    imports, the server pays only for what it adds (torch._dynamo, the trainer). Safe to fork here:
    the agent has started no thread, connection or store yet (this runs before the rendezvous), as
    the server itself is a process that imported torch and forks workers."""
    server = getattr(forkserver, "_forkserver", None)
    fields = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if server is None or not all(hasattr(server, f) for f in fields) or hasattr(server, "_forkserver_authkey"):
        return False
    if server._forkserver_pid is not None:  # started already (a second launch in one process)
        return True
    resource_tracker.ensure_running()  # shared with the server's children, as multiprocessing's server does
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]  # untyped in typeshed
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # EOF for the server once every client (this agent) is gone
        pid = os.fork()
        if pid == 0:  # the server: it never returns from here
            try:
                os.close(alive_w)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                name_process(SERVER_NAME)
                forkserver.main(listener.fileno(), alive_r, preload)
            finally:
                os._exit(0)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def name_process(name: bytes) -> None:
    """Set this process's name as `ps` shows it (Linux's prctl PR_SET_NAME); nothing elsewhere."""
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux, or no prctl
        return
