"""A stand-in, for the processes of a test, for what a CUDA build of torch does to fork; CI has only
the CPU build, where it never happens.

On a CUDA build `torch.cuda.is_available()` and `torch.cuda.device_count()` mark every later fork of
the calling process as one CUDA cannot be used in (torch's `poison_fork`, GPU or not: seen with
2.11+cu130 on a machine without one), and `torch.cuda._is_in_bad_fork()` is True in such a child.
Here the two functions of the CPU build are wrapped to do the marking, through the same fork hook.
Loaded by Python's `site` from PYTHONPATH in every process the test starts (this folder first).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_state = {"poisoned": False, "bad": False}


def _mark_bad_in_child() -> None:
    _state["bad"] = True


def _poison() -> None:
    if not _state["poisoned"]:
        _state["poisoned"] = True
        os.register_at_fork(after_in_child=_mark_bad_in_child)


def _poisoning(real: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        _poison()
        return real(*args, **kwargs)

    return call


class _CudaBuildFork(importlib.abc.MetaPathFinder):
    """Wraps torch.cuda's two queries once the module has run, as it is first imported."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch.cuda":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            for name in ("is_available", "device_count"):
                setattr(module, name, _poisoning(getattr(module, name)))
            module._is_in_bad_fork = lambda: _state["bad"]  # type: ignore[attr-defined]

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _CudaBuildFork())
