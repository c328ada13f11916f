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
import faulthandler
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
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

from torchspot_trainer import ENV_PREFIX, NODE_FAULT_EXIT, PROG, env_switch, takes_in_place
from torchspot_trainer.fork_server import (
    FORK_ENV,
    run_program,
    run_trainer,
    start_fork_server,
)
from torchspot_trainer.handover import InPlaceAgent, agent_folder, live_workers, notice_agreed, running_workers
from torchspot_trainer.markers import (
    STACKS_SIGNAL,
    mark_leaving,
    name_peer_lost_marker,
)
from torchspot_trainer.nccl import worker_environment
from torchspot_trainer.rendezvous.settings import BACKEND_NAME, parse_settings

TRAINER_MODULE = "torchspot_trainer"
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


def _launch_forked(args: argparse.Namespace) -> None:
    """torchrun's launch with the program as a function (run_trainer, or run_program for any other), each
    worker forked from a server that preloaded torch and the rest of `fork_preload`."""
    # Start it, and wait for its imports, before joining the rendezvous: a node that joins a
    # running job makes everyone restart, and its first worker would hold up the new group
    # while it imported torch; the group trains on meanwhile instead. Not for our trainer in
    # place with nothing to stage (`joins_while_warming`). It copies this environment now:
    # whatever workers read must be set before.
    name_peer_lost_marker()
    start_fork_server(fork_preload(args, os.environ), wait=not joins_while_warming(args, os.environ))
    # Only now torchrun's config: its LaunchConfig asks torch.cuda.is_available() (for its NUMA
    # default), which on a CUDA build of torch marks every later fork of this process as one CUDA
    # cannot be used in, GPU or not. Made before the server, it makes every worker of a CUDA build refuse
    # to start (refuse_bad_fork).
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
    client (pyetcd and gRPC: a tenth of a second of CPU) serves the agent alone, and imported first it
    delays the server's fork, whose imports a joining node's first step waits for. The server and its
    workers never load gRPC either."""
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
    return takes_in_place(known.in_place, sync_bn=known.sync_bn is True)


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
    worker group with `logger.exception` at the moment it sees the failure. That first import takes
    seconds of the agent's main thread, between its worker's end and its re-form: a hard loss would
    recover that much slower than a freeze, whose workers the agent stops itself without logging an
    exception. The log says the same; the import, and its CPU, happen only where torch.compile is used. torch gives
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
