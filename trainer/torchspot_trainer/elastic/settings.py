"""The manager's settings and refusals: what its arguments and the job's environment give (pure).

An argument given wins; else the job's value, as the operator passes it to every worker
(TORCHSPOT_<SETTING>, builders.launcher_env); else the default. A value that cannot be honoured is
refused at start, naming it (`Refused`); a call in the wrong order later says what to call first
(`ApiOrderError`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

from torchspot_trainer import ENV_PREFIX, REPLICA_GROUP_ENV, REPLICA_GROUP_SIZE_ENV
from torchspot_trainer.markers import PEER_LOST_ENV
from torchspot_trainer.recovery.signals import NOTICE_HOLD, events_setting_valid, events_url

REFORM_SECONDS = 30.0
"""How long a worker that re-forms in place waits for its agent's next round, and for that round's group
to form, before it leaves by the restart path."""
COMMIT_SECONDS = 300.0
"""A step's default limit from its start to its commit (`Manager`'s `commit_seconds`)."""
PROGRESS_SECONDS = 2.0
"""Seconds between rank 0's progress records (step, world size, samples per second): often enough for the
sandbox's report to draw throughput and goodput from them, one line on stdout however short the step."""
CHECKPOINT_URI_ENV = f"{ENV_PREFIX}CHECKPOINT_URI"
CHECKPOINT_EVERY_ENV = f"{ENV_PREFIX}CHECKPOINT_EVERY"
KEEP_CHECKPOINTS_ENV = f"{ENV_PREFIX}KEEP_CHECKPOINTS"
"""The job's checkpoint settings, as the operator passes them to every worker (builders.launcher_env):
the manager's defaults, so a script on an ElasticJob checkpoints where the job says with no code."""
NOTICE_HOLD_ENV = f"{ENV_PREFIX}NOTICE_HOLD"
SCHEDULED_EVENTS_ENV = f"{ENV_PREFIX}SCHEDULED_EVENTS"
"""The trainer's --notice-hold and --scheduled-events, as the environment gives them to any program:
the manager's defaults for `notice_hold` and `scheduled_events`."""
EVENTS_FILE_ENV = f"{ENV_PREFIX}EVENTS_FILE"
"""Where the manager appends its records (JSON lines) when its `events_file` is not given."""
_N = TypeVar("_N", int, float)


class ApiOrderError(RuntimeError):
    """A manager call came in the wrong order; the message says what to call first."""


class Refused(ValueError):
    """A combination the manager cannot honour, said at start with the reason."""


def checkpoint_settings(
    uri: str | None, every: int | None, keep: int | None, environ: Mapping[str, str]
) -> tuple[str, int, int]:
    """(uri, every, keep) of the manager's checkpoints: each argument given, else the job's from `environ`
    (the operator's TORCHSPOT_CHECKPOINT_*), else none, 0 and 3. Pure. Raises Refused for a value that
    cannot be honoured, naming it."""
    uri = environ.get(CHECKPOINT_URI_ENV, "") if uri is None else uri
    every = _from_env(environ, CHECKPOINT_EVERY_ENV, 0, int) if every is None else every
    keep = _from_env(environ, KEEP_CHECKPOINTS_ENV, 3, int) if keep is None else keep
    if every < 0:
        raise Refused(f"checkpoint_every={every}: must be 0 (only the final one) or more")
    if every and not uri:
        raise Refused(f"checkpoint_every={every} without a checkpoint_uri: say where they go")
    if keep < 1:
        raise Refused(f"keep_checkpoints={keep}: keep at least 1")
    return uri, every, keep


def notice_settings(
    hold: float | None, scheduled_events: str | None, environ: Mapping[str, str]
) -> tuple[float, str | None]:
    """(notice hold, Scheduled Events endpoint or None) of the manager's notices: each argument given,
    else the job's from `environ` (TORCHSPOT_NOTICE_HOLD, TORCHSPOT_SCHEDULED_EVENTS), else 120 s and
    'auto'. Pure. Raises Refused for a value that cannot be honoured, naming it."""
    hold = _from_env(environ, NOTICE_HOLD_ENV, NOTICE_HOLD, float) if hold is None else hold
    if hold < 0:
        raise Refused(f"notice_hold={hold}: must be 0 or more")
    setting = (environ.get(SCHEDULED_EVENTS_ENV) or "auto") if scheduled_events is None else scheduled_events
    if not events_setting_valid(setting):
        raise Refused(f"scheduled_events={setting!r}: use 'auto', 'off' or an http(s) URL")
    return hold, events_url(setting, environ)


def _from_env(environ: Mapping[str, str], name: str, default: _N, kind: Callable[[str], _N]) -> _N:
    """A number of `kind` from the environment variable `name`, `default` where it is unset or empty."""
    value = environ.get(name, "")
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        raise Refused(f"{name}={value!r}: expected a {'whole ' if kind is int else ''}number") from None


def node_name() -> str:
    """This worker's node, as the operator names it (the downward API's NODE_NAME), else its host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def default_device(environ: Mapping[str, str] = os.environ) -> torch.device:
    """This worker's GPU (its LOCAL_RANK) where CUDA is usable, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def choose_path(
    in_place: bool | None, environ: Mapping[str, str], *, sharded: bool = False, own_group: bool = False
) -> tuple[bool, str]:
    """(whether to re-form in place, why), for the manager's `in_place` argument. Pure.

    In place needs torchspot-run's agent, which hands each new round to its live workers: under another
    launcher no round would ever come. It also needs a live peer that holds what a lost rank held: a
    sharded state (`sharded`: FSDP2) has one where each node, or each of the job's replica groups
    (TORCHSPOT_REPLICA_GROUP_SIZE nodes, each told its group's name in TORCHSPOT_REPLICA_GROUP), holds a
    whole copy, sharded over its own workers (sharding.py), over the copy's own default group, which a
    script that made torch's default group itself (`own_group`: over every rank) rules out. None (the
    default) takes in place wherever it can run; True where it cannot is refused (`Refused`), rather than
    silently taking the restart path."""
    if in_place is False:
        return False, "the restart path, as asked (in_place=False)"
    nodes = _from_env(environ, REPLICA_GROUP_SIZE_ENV, 0, int) if sharded else 0
    if nodes > 1 and not environ.get(REPLICA_GROUP_ENV):
        reason = (
            f"replica groups of {nodes} nodes, but no {REPLICA_GROUP_ENV} names this node's: in place each group "
            "holds one copy of the sharded state (the operator sets both)"
        )
        instead = f"set {REPLICA_GROUP_ENV} on every node, or drop in_place"
    elif sharded and own_group:
        reason = (
            "the script made torch's default process group itself (over every rank): in place a sharded run "
            "shards within each node, over the group the manager makes (Manager.shard_mesh)"
        )
        instead = "do not call init_process_group, or drop in_place"
    elif PEER_LOST_ENV not in environ:
        reason = "in place needs torchspot-run with --rdzv-backend etcd-v3, whose agent hands live workers each round"
        instead = "launch with torchspot-run or drop in_place"
    else:
        return True, "in place: torchspot-run's agent hands this worker each new round"
    if in_place:
        raise Refused(f"in_place=True: {reason}; {instead}")
    return False, f"the restart path: {reason}"
