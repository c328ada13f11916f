"""`torchspot-run`: a drop-in `torchrun` with the `etcd-v3` rendezvous backend.

Every torchrun flag parses and behaves as in torchrun (we use torch's own parser and
`run`). Before anything starts we check the flags torchrun would only reject deep
inside the agent (or never), so a bad value stops the launcher with a message that
names the flag.

Usage::

    torchspot-run --nnodes 1:4 --nproc-per-node 1 --max-restarts 100 \\
        --rdzv-backend etcd-v3 --rdzv-endpoint etcd:2379 --rdzv-id job-7f3a \\
        train.py --epochs 10
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import logging
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing import connection, forkserver, resource_tracker
from pathlib import Path
from types import FrameType

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser, get_use_env
from torch.distributed.run import run as torchrun_run

from torchspot_trainer import ENV_PREFIX, NODE_FAULT_EXIT, env_switch
from torchspot_trainer.handover import InPlaceAgent, agent_folder, live_workers, notice_agreed, running_workers
from torchspot_trainer.markers import (
    STACKS_SIGNAL,
    agent_restarting,
    mark_leaving,
    name_peer_lost_marker,
    node_leaving,
)
from torchspot_trainer.nccl import worker_environment
from torchspot_trainer.rendezvous.settings import BACKEND_NAME, parse_settings

PROG = "torchspot-run"
TRAINER_MODULE = "torchspot_trainer"
FORK_ENV = "TORCHSPOT_FORK_WORKERS"
"""Set to 0 to start each worker as a new interpreter, as torchrun does, instead of forking it
from a warm server (FORK_PRELOAD). Forked by default: a restart at every membership change then
costs about 0.1 s of process start instead of 1.3-2.9 s, and 0.2-0.5 s of model set-up instead
of 1.3-2.6 s. Early measurements (bench/README.md, run 6) had forked workers 9-16% slower per
step; side by side without a market they are not (0.756 against 0.737 s at 2 nodes, 1.194
against 1.266 s at 3)."""
FORK_PRELOAD = ("torch._dynamo", "torchspot_trainer.train")
"""What the fork server imports once, so that a worker restarted at every membership change
does not: torch and our trainer (about 1.3 s alone, 2-3 s on a busy node), and torch._dynamo, which
DistributedDataParallel and the first optimizer imports on first use (another 1.0-2.5 s). Measured
in the trainer's start line (`setup_s`). BLOB_PRELOAD as well where the trainer uses Blob; for any
other program PROGRAM_PRELOAD instead."""
BLOB_PRELOAD = "azure.storage.blob"
"""The Blob SDK, preloaded only for a trainer with an `az://` checkpoint URI or data set (`uses_blob`):
0.3 s of CPU on an idle core here, on the path of a joining node's first step (its worker forks once
the server's imports are done) and paid for nothing by a job without Blob. Skipped by the server
where it is not installed."""
BLOB_SCHEME = "az://"
"""How the trainer's flags name a Blob container (config.py)."""
PROGRAM_PRELOAD = ("torch._dynamo",)
"""What the fork server imports for a program that is not our trainer: torch and torch._dynamo
(DistributedDataParallel's first use), and the modules PRELOAD_ENV names; not our trainer or the
Blob SDK, whose import would only delay a joining node's entry (it preloads before it joins)."""
PRELOAD_ENV = "TORCHSPOT_FORK_PRELOAD"
"""Comma-separated modules the fork server also imports for a program that is not our trainer
(its own heavy imports: torchvision, transformers...), once per agent instead of at every restart.
A module that queries CUDA at import makes every worker refuse to start (refuse_bad_fork)."""
STACKS_AFTER_NOTICE = 20.0
"""Seconds after its SIGTERM at which an agent still running prints every thread's stack to its log
(the kubelet's default grace is 30 s): its workers' emergency checkpoint and its leaving take a
few seconds, and an agent that hung instead (a CI run's never left) says where before its SIGKILL; a
worker of its that is still there says where too (`ask_for_stacks`)."""

AGREED_LOOK = 0.005
"""Between a leaving agent's looks for its workers' `agreed-` files: a few `stat`s, for the moment
after SIGTERM until the node leaves; every millisecond here delays the others' re-form."""

_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
_TORCHRUN_DEFAULT_RUN_ID = "none"


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """Parse `k1=v1,k2=v2` with torchrun's own parser (so we accept exactly what it will),
    raising ValueError that names `--rdzv-conf`."""
    try:
        return _parse_rendezvous_config(text)
    except ValueError as exc:
        raise ValueError(f"--rdzv-conf {text!r}: {exc}") from None


def check_args(args: argparse.Namespace) -> str | None:
    """Return a message naming the first bad flag, or None if the flags are usable.

    Pure: inspects the parsed namespace only.
    """
    parts = str(args.nnodes).split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        return f"--nnodes {args.nnodes!r}: expected N or MIN:MAX with whole numbers"
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        return f"--nnodes {args.nnodes!r}: the minimum must be at least 1"
    if low > high:
        return f"--nnodes {args.nnodes!r}: MIN ({low}) is larger than MAX ({high})"
    nproc = str(args.nproc_per_node)
    if nproc not in _NPROC_WORDS and not (nproc.isdigit() and int(nproc) >= 1):
        words = ", ".join(_NPROC_WORDS)
        return f"--nproc-per-node {nproc!r}: expected a positive integer or one of {words}"
    if args.max_restarts < 0:
        return f"--max-restarts {args.max_restarts}: must be 0 or more"
    if args.monitor_interval <= 0:
        return f"--monitor-interval {args.monitor_interval}: must be greater than 0"
    try:
        conf = parse_rdzv_conf(args.rdzv_conf)
        if args.rdzv_backend == BACKEND_NAME and not args.standalone:
            if args.rdzv_id == _TORCHRUN_DEFAULT_RUN_ID:
                return (
                    "--rdzv-id is required with --rdzv-backend etcd-v3: give each job "
                    "incarnation its own id (torchrun's default 'none' shares state between jobs)"
                )
            parse_settings(args.rdzv_endpoint, args.rdzv_id, conf)
    except ValueError as exc:
        return str(exc)
    return None


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
    another exit status, or an exception, is the worker's failure as torchrun reports it."""
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
    _FINISHED.append(ran)
    return 0


def hear_sigterm() -> None:
    """Take SIGTERM's default back in a forked worker (the server ignores it: _start_fork_server), and
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


def forks_workers(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether to fork the workers from a warm server: any Python program (`-m module` or a script)
    under our rendezvous, unless FORK_ENV=0 says not to. Pure. Not `--no-python` (not Python) or
    `--run-path` (torchrun's own runpy mode), nor torch's backends (stock torchrun's behaviour)."""
    return bool(
        environ.get(FORK_ENV, "1") != "0"
        and args.rdzv_backend == BACKEND_NAME
        and not args.standalone
        and not args.no_python
        and not args.run_path
        and get_use_env(args)
    )


def runs_our_trainer(args: argparse.Namespace) -> bool:
    """Whether the training program is our trainer (`-m torchspot_trainer`). Pure."""
    return bool(args.module) and args.training_script == TRAINER_MODULE and not args.no_python


def forks_our_trainer(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the forked workers run our trainer (`run_trainer`) rather than a program. Pure."""
    return forks_workers(args, environ) and runs_our_trainer(args)


def fork_preload(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """What the fork server imports: FORK_PRELOAD for our trainer; PROGRAM_PRELOAD and PRELOAD_ENV's
    modules for another program. Pure."""
    if forks_our_trainer(args, environ):
        return [*FORK_PRELOAD, BLOB_PRELOAD] if uses_blob(args.training_script_args, environ) else list(FORK_PRELOAD)
    extra = (module.strip() for module in environ.get(PRELOAD_ENV, "").split(","))
    return [*PROGRAM_PRELOAD, *(module for module in extra if module)]


SERVER_NAME = b"torchspot-forks"
"""The fork server's process name (what `ps` and `top` show; Linux's 15-byte `comm`): forked from the
agent, its command line is the agent's."""


def _start_fork_server(preload: list[str], *, wait: bool = True) -> None:
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


def _launch_forked(args: argparse.Namespace) -> None:
    """torchrun's launch with the program as a function (run_trainer, or run_program for any other), each
    worker forked from a server that preloaded torch and the rest of `fork_preload`."""
    # Start it, and wait for its imports, before joining the rendezvous: a node that joins a
    # running job makes everyone restart, and its first worker would hold up the new group
    # while it imported torch; the group trains on meanwhile instead. Not for our trainer in
    # place with nothing to stage (`joins_while_warming`). It copies this environment now:
    # whatever workers read must be set before.
    name_peer_lost_marker()
    _start_fork_server(fork_preload(args, os.environ), wait=not joins_while_warming(args, os.environ))
    # Only now torchrun's config: its LaunchConfig asks torch.cuda.is_available() (for its NUMA
    # default), which on a CUDA build of torch marks every later fork of this process as one CUDA
    # cannot be used in, GPU or not. Made before the server, it made every worker of a CUDA build refuse
    # to start (refuse_bad_fork): seen with torch 2.11+cu130 (bench/README, 2026-11-29); 2.13's asks the same.
    # The OMP_NUM_THREADS it may set reaches the workers all the same: torch's agent puts it in each
    # worker's environment, and each sizes its pool by it (take_thread_count).
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    register()
    stage_forked(args)
    if forks_our_trainer(args):
        elastic_launch(config=config, entrypoint=run_trainer)(*args.training_script_args)
        return
    kind = "module" if args.module else "script"
    elastic_launch(config=config, entrypoint=run_program)(args.training_script, kind, *args.training_script_args)


HANDLER_MODULE = "torchspot_trainer.rendezvous.handler"
"""The etcd-v3 rendezvous handler's module: the agent's alone, imported once the fork server has
started (`register`)."""


def register() -> None:
    """Make `--rdzv-backend etcd-v3` available to torchrun in this process (the handler's `register`).

    Imported here, after the fork server has started, not at this module's top: the handler's etcd
    client (pyetcd and gRPC, 0.13 s of CPU on an idle core here) serves the agent alone, and imported
    first it delayed the server's fork, whose imports a joining node's first step waits for
    (bench/README.md, the join beside TorchFT). The server and its workers never load gRPC either."""
    from torchspot_trainer.rendezvous.handler import register as register_backend  # noqa: PLC0415 - see above

    register_backend()


def leave_rendezvous() -> None:
    """Take this agent out of its rendezvous (the handler's `leave_rendezvous`): nothing before the
    handler's module is loaded, since no rendezvous was joined then. Looked up, not imported: a
    signal handler (`leave_then_stop`) calls this, and may have interrupted that import."""
    leave = getattr(sys.modules.get(HANDLER_MODULE), "leave_rendezvous", None)
    if leave is not None:
        leave()


def use_in_place_agent() -> None:
    """Make torchrun's launch build our InPlaceAgent (handover.py) instead of torch's local
    agent, which it names in its module: the same agent for every program, which re-forms in place
    only the workers that register for it."""
    launcher_api.LocalElasticAgent = InPlaceAgent  # type: ignore[attr-defined]


def leave_then_stop(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM: take our node out of the rendezvous, then what torch's handler does (raise
    SignalException, so the agent stops its workers and exits). The other nodes re-form at
    once instead of when our workers are done with their emergency checkpoint.

    Not while workers that re-form in place run here: the others' agents would hand them a round
    without us at once, which breaks the group our workers need for the notice's agreement at their
    next boundary. The node is only marked leaving; it leaves once its workers have shared the notice
    with their group (`leave_once_agreed`: their emergency checkpoint needs no collective), or have
    stopped (`_launch`), whichever comes first, and the others re-form in place then. Either way an
    agent still here STACKS_AFTER_NOTICE seconds later prints its threads' stacks, and asks those
    workers still running for theirs (`ask_for_stacks`)."""
    faulthandler.dump_traceback_later(STACKS_AFTER_NOTICE, exit=False)
    try:
        folder: Path | None = agent_folder()
    except KeyError:  # no agent folder named: no worker of ours registered
        folder = None
    if folder is not None and live_workers(folder):
        mark_leaving()
        threading.Thread(target=leave_once_agreed, args=(folder,), name="torchspot-leave", daemon=True).start()
        threading.Thread(target=ask_for_stacks, args=(folder,), name="torchspot-stacks", daemon=True).start()
    else:
        leave_rendezvous()
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def stopped_by_signal(sig: signal.Signals) -> int:
    """Say on stderr that the agent stops for `sig` (its workers stopped, its node out of the
    rendezvous), and return its exit code: 128 + the signal's number, what a container runtime reports
    for a process a signal ended, and what our workers exit with after SIGTERM.

    torch's agent raises SignalException for it. Left to Python, its traceback (30 lines of torch's
    frames) ended every eviction with notice, the path spot nodes take every day, as if the launcher
    had crashed, with exit code 1. The operator reads 1 and 143 alike (verdicts.classify: a
    disruption or a node reason decides, not the code)."""
    code = 128 + int(sig)
    print(f"{PROG}: stopped by {sig.name}; this node left the rendezvous (exit {code})", file=sys.stderr, flush=True)
    return code


def ask_for_stacks(folder: Path) -> None:
    """STACKS_AFTER_NOTICE seconds after our SIGTERM, ask each registered worker of ours that still runs
    for its threads' stacks (markers.STACKS_SIGNAL: only workers that registered handle it). The
    agent's own stacks show only that it waits for them."""
    time.sleep(STACKS_AFTER_NOTICE)
    for pid in running_workers(folder):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, STACKS_SIGNAL)


def leave_once_agreed(folder: Path) -> None:
    """Take our node out of the rendezvous once every worker of ours that runs has shared the notice
    with its group (handover.py's `agreed-` files), looking every AGREED_LOOK seconds."""
    while not notice_agreed(folder):
        time.sleep(AGREED_LOOK)
    leave_rendezvous()


def handle_sigterm_ourselves(args: argparse.Namespace) -> None:
    """Take SIGTERM from torch's agent (`--signals-to-handle`, which it registers whenever it
    starts workers) and install leave_then_stop for it; a list without SIGTERM stays as given."""
    signals = [name.strip() for name in str(args.signals_to_handle).split(",") if name.strip()]
    if "SIGTERM" not in signals:
        return
    args.signals_to_handle = ",".join(name for name in signals if name != "SIGTERM")
    signal.signal(signal.SIGTERM, leave_then_stop)


MAX_WORLD_ENV = f"{ENV_PREFIX}MAX_WORLD_SIZE"
"""The trainer's --max-world-size, from its environment (config.py's TORCHSPOT_<FLAG> rule)."""


def max_world_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """`MAX_WORLD_ENV` for the workers: the maximum of --nnodes times a numeric --nproc-per-node (a word
    such as `gpu` is resolved by torch later: then none), unless `environ` has it. Pure.

    Why: with a global batch the trainer sizes its micro-batch from the largest world (config.py's
    `micro_batch`), which no environment variable of torchrun's tells a worker."""
    nproc = str(args.nproc_per_node)
    if MAX_WORLD_ENV in environ or not nproc.isdigit():
        return {}
    return {MAX_WORLD_ENV: str(int(str(args.nnodes).split(":")[-1]) * int(nproc))}


STAGE_MODULE = "torchspot_trainer.data.stage"
"""What stages our trainer's data set before the agent joins (data/stage.py says why)."""


def staging_command(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The command that stages the data set of `args`' training program on this node: for our trainer
    (`-m torchspot_trainer`) with something to stage (`needs_staging`); None otherwise. Pure."""
    if not runs_our_trainer(args) or not needs_staging(args.training_script_args, environ):
        return None
    return [sys.executable, "-m", STAGE_MODULE, *args.training_script_args]


IN_PLACE_ENV, SYNC_BN_ENV = f"{ENV_PREFIX}IN_PLACE", f"{ENV_PREFIX}SYNC_BN"
"""The trainer's --in-place and --sync-bn, from its environment (config.py's TORCHSPOT_<FLAG> rule)."""


def joins_while_warming(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the agent joins the rendezvous while its fork server still imports, instead of after:
    for our trainer in place (unless `--no-in-place` or `--sync-bn`: run.choose_in_place) and with no data
    set to stage. Pure.

    Why: a running job's workers that re-form in place train on in their generation until a joiner's
    worker is in the new round's group build (live.py's deferred join), so the joiner's imports cost
    them nothing, and its rendezvous (0.5-0.9 s) overlaps them instead of following them. A restarted
    worker would wait for them instead: every other program (we cannot know whether it re-forms in
    place) joins once warm, as does a node that stages its data set from the server first."""
    if not runs_our_trainer(args) or needs_staging(args.training_script_args, environ):
        return False
    in_place, sync_bn = environ.get(IN_PLACE_ENV), env_switch(environ.get(SYNC_BN_ENV, ""))
    parser = argparse.ArgumentParser(add_help=False)  # (a bad value: the trainer says so, once warm)
    parser.add_argument("--in-place", action=argparse.BooleanOptionalAction, default=in_place and env_switch(in_place))
    parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=sync_bn)
    known, _ = parser.parse_known_args(args.training_script_args)
    return known.in_place is True or (known.in_place is None and known.sync_bn is not True)


def needs_staging(trainer_args: list[str], environ: Mapping[str, str]) -> bool:
    """Whether the trainer's data set has anything to stage: an `az://` copy, or an image folder's
    index (`--dataset imagenet`). Pure. Read from its `--data` and `--dataset` (or their TORCHSPOT_
    variables) without the trainer's own parser, which imports torch: the stage's process costs a
    torch import, paid only where there is something to do (not for a local CIFAR-10 or digits)."""
    known = _trainer_places(trainer_args, environ)
    return str(known.data).startswith(BLOB_SCHEME) or known.dataset == "imagenet"


def uses_blob(trainer_args: list[str], environ: Mapping[str, str]) -> bool:
    """Whether the trainer reads or writes Azure Blob: an `az://` data set or checkpoint URI. Pure; read
    as `needs_staging` reads its flags."""
    known = _trainer_places(trainer_args, environ)
    return any(str(place).startswith(BLOB_SCHEME) for place in (known.data, known.checkpoint_uri))


def _trainer_places(trainer_args: list[str], environ: Mapping[str, str]) -> argparse.Namespace:
    """The trainer's `--data`, `--dataset` and `--checkpoint-uri` (or their TORCHSPOT_ variables), parsed
    without its own parser (`needs_staging` says why)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--data", default=environ.get(f"{ENV_PREFIX}DATA", ""))
    parser.add_argument("--dataset", default=environ.get(f"{ENV_PREFIX}DATASET", ""))
    parser.add_argument("--checkpoint-uri", default=environ.get(f"{ENV_PREFIX}CHECKPOINT_URI", ""))
    known, _ = parser.parse_known_args(trainer_args)
    return known


def stage_data(args: argparse.Namespace) -> None:
    """Run `staging_command` and wait: its progress goes to our stderr; a failure stops the launcher
    before it joins, with the staging's own message above ours. Where workers are not forked."""
    command = staging_command(args)
    if command is None:
        return
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        _staging_failed(done.returncode)


def stage_forked(args: argparse.Namespace) -> None:
    """`stage_data`, in a process forked from the warm server (`run_stage`) instead of a new interpreter,
    which would import torch once more before the node joins."""
    if staging_command(args) is None:
        return
    stage = multiprocessing.get_context("forkserver").Process(
        target=run_stage, args=tuple(args.training_script_args), name="torchspot-stage"
    )
    stage.start()
    try:
        stage.join()
    except BaseException:  # our SIGTERM (leave_then_stop): the pod goes, and its staging with it
        stage.terminate()
        stage.join(STAGE_STOP_SECONDS)
        raise
    if stage.exitcode:
        _staging_failed(stage.exitcode)


STAGE_STOP_SECONDS = 5.0
"""How long a stopping agent waits for its staging process to end after SIGTERM."""


def run_stage(*argv: str) -> None:
    """The staging's entry point in a forked process (module-level, as run_trainer: pickled by name)."""
    from torchspot_trainer.data.stage import stage  # noqa: PLC0415 - imported in the fork server already

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it; the agent may stop us
    stage(list(argv))


def _staging_failed(code: int) -> None:
    raise SystemExit(f"{PROG}: error: staging the data set failed (exit {code}); see above")


_TRACEBACKS = logging.Formatter()
"""Formats a record's exception as logging's own Formatter does (`format_tracebacks_plainly`)."""


def _plain_traceback(record: logging.LogRecord) -> bool:
    """A handler filter: the record's exception formatted into its `exc_text` and its `exc_info`
    dropped, so torch's formatter appends the same text without importing torch._dynamo. Passes
    every record."""
    if record.exc_info:
        if not record.exc_text:
            record.exc_text = _TRACEBACKS.formatException(record.exc_info)
        record.exc_info = None
    return True


def format_tracebacks_plainly() -> None:
    """Format the tracebacks torch's log handlers print here, not in torch's formatter.

    Why: torch's formatter (torch/_logging/_internal.py, `TorchLogsFormatter.format`) imports
    torch._dynamo to format any record that carries an exception, and torch's agent logs its failed
    worker group with `logger.exception` at the moment it sees the failure. That first import took
    2.2-2.5 s of the agent's main thread on 2 cores, between its worker's end and its re-form: the
    restart path's hard loss took 2.8 s at p50 where a freeze, whose workers the agent stops itself
    without logging an exception, took 1.2 s (bench/README.md, the restart path on 2026-11-27). The
    log says the same; the import, and its CPU, happen only where torch.compile is used. torch gives
    some of its loggers handlers of their own (torch.distributed's, which the agent's records reach):
    every handler of torch's loggers gets the filter."""
    for name, logger in logging.root.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and (name == "torch" or name.startswith("torch.")):
            for handler in logger.handlers:
                handler.addFilter(_plain_traceback)  # once: addFilter skips a filter it has


@record
def _launch(args: argparse.Namespace) -> None:
    format_tracebacks_plainly()
    # Before any worker or the fork server starts (each copies this environment): torchrun's agent
    # would give every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1, which our trainer's must not have and
    # any other program's keeps (nccl.py says why).
    os.environ.update(worker_environment(os.environ, ours=runs_our_trainer(args)))
    os.environ.update(max_world_environment(args, os.environ))
    if args.rdzv_backend == BACKEND_NAME:
        handle_sigterm_ourselves(args)
        use_in_place_agent()
    # The data set is staged before the rendezvous: a joiner's copy must not hold the others' set-up.
    try:
        if forks_workers(args):
            _launch_forked(args)
        else:
            register()
            stage_data(args)
            torchrun_run(args)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    except RendezvousConnectionError as exc:
        raise SystemExit(f"{PROG}: error: {exc}") from None
    except RendezvousTimeoutError:  # torch's says nothing
        ours = args.rdzv_backend == BACKEND_NAME
        left = "; this node left the rendezvous, which stays open for the others" if ours else ""
        raise SystemExit(
            f"{PROG}: error: no round of at least {str(args.nnodes).split(':')[0]} node(s) formed within the join "
            f"timeout (--rdzv-conf join_timeout){left}"  # ours leaves: handler.py's `shutdown`; torch's closes it
        ) from None
    except SignalException as exc:
        # Our node is going (the agent has stopped its workers): let the others re-form now.
        leave_rendezvous()
        raise SystemExit(stopped_by_signal(exc.sigval)) from None
    except ChildFailedError as exc:
        if any(failure.exitcode == NODE_FAULT_EXIT for failure in exc.failures.values()):
            print(f"{PROG}: a worker found that this node cannot run the program (exit {NODE_FAULT_EXIT}, see "
                  "above); this node left the rendezvous", file=sys.stderr, flush=True)  # fmt: skip
            raise SystemExit(NODE_FAULT_EXIT) from None
        raise


def main(argv: list[str] | None = None) -> None:
    """Parse torchrun's flags, check them, register `etcd-v3`, and run the agent."""
    parser = get_args_parser()
    parser.prog = PROG
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    problem = check_args(args)
    if problem is not None:
        parser.error(problem)
    _launch(args)


if __name__ == "__main__":
    main()
