"""NCCL settings the launcher gives the workers it starts, in one place for both sides (the agent
imports nothing of the worker's modules)."""

from __future__ import annotations

from collections.abc import Mapping

NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""torch's switch for the NCCL watchdog's reaction to a failed or timed-out collective."""
NCCL_RETHROW_ENV = "TORCH_NCCL_RETHROW_CUDA_ERRORS"
"""torch's switch for the NCCL watchdog rethrowing a CUDA error (on by default): it ends the process too."""
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
"""How many collectives torch's flight recorder keeps. Its former name, TORCH_NCCL_TRACE_BUFFER_SIZE, is
still read by torch 2.13, which then warns in every process that makes a group (every worker's log
began with that warning, on gloo too)."""
FORMER_NAMES: Mapping[str, tuple[str, ...]] = {FLIGHT_RECORDER_ENV: ("TORCH_NCCL_TRACE_BUFFER_SIZE",)}
"""Settings torch still reads under a former name: one the user set so is theirs, and ours is not added."""
FLIGHT_RECORDER_DEFAULTS: Mapping[str, str] = {FLIGHT_RECORDER_ENV: "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
"""What the launcher sets for every program's workers, where the user set nothing: torch's flight
recorder keeps the last 2,000 collectives and dumps them (to /tmp/nccl_trace_rank_N, torch's default)
when a collective times out, so a hang leaves evidence. Evidence only: what a timeout does is torch's
watchdog's (WORKER_NCCL_DEFAULTS)."""
WORKER_NCCL_DEFAULTS: Mapping[str, str] = {
    NCCL_ERROR_HANDLING_ENV: "0",
    NCCL_RETHROW_ENV: "0",
    **FLIGHT_RECORDER_DEFAULTS,
}
"""What the launcher sets for the workers of our trainer, where the user set nothing (`worker_environment`):
NCCL's watchdog neither tears a worker down (async error handling) nor rethrows a CUDA error before
the worker's own exit path has written its snapshot (every path out of a broken group is the trainer's:
recovery/group.py, and in place live.py). The launcher must set them: torchrun's agent puts
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 into every worker's environment unless its own has a value, so the
trainer's own default never applied. Any other program keeps torch's: it has no watchdog of its own,
and torch's tears down a worker whose collective failed or hung (a collective mismatch, an
InfiniBand fault with its peers alive), which its agent then restarts. Written from torch's
documented settings; not measured on a GPU here."""


def worker_environment(environ: Mapping[str, str], *, ours: bool) -> dict[str, str]:
    """What the launcher adds to its own environment for its workers: `WORKER_NCCL_DEFAULTS` for our
    trainer (`ours`), `FLIGHT_RECORDER_DEFAULTS` for any other program, each where `environ` has no
    value, under the setting's name or a former one (`FORMER_NAMES`). Pure."""
    defaults = WORKER_NCCL_DEFAULTS if ours else FLIGHT_RECORDER_DEFAULTS
    return {
        key: value
        for key, value in defaults.items()
        if not any(name in environ for name in (key, *FORMER_NAMES.get(key, ())))
    }
