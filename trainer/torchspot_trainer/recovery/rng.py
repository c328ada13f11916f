"""Random-number state in a checkpoint: what `torch.load(weights_only=True)` accepts.

Augmentation draws from per-sample generators (data.sample_generator), so these states
matter only for what still uses the global generators (DataLoader worker seeds, user
code); saved anyway so that a resume continues every stream where it stopped.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch and (when CUDA is in use) this device's CUDA RNG states."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {
        # Python's 625 words as one tensor, not a list: a list of them was 70% of the time a heal in place
        # spent packing the state (wire.flatten walks each number; 1.7 of 2.4 ms for the small CNN's).
        "python": torch.tensor(words, dtype=torch.int64),
        "python_gauss": gauss,
        "python_version": version,
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
        "torch": torch.get_rng_state(),
    }
    if _cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured (a CUDA state only where CUDA is in use: a checkpoint
    written on a GPU resumes on a CPU, and the other way round)."""
    values = state["python"]
    if isinstance(values, torch.Tensor):
        random.setstate((state["python_version"], tuple(values.tolist()), state["python_gauss"]))
    else:  # a checkpoint of an older trainer: the words, then the Gaussian's spare value, in a list
        random.setstate((state["python_version"], tuple(values[:-1]), values[-1]))
    keys = state["numpy"]["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy"]["pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and _cuda_in_use():
        torch.cuda.set_rng_state(state["cuda"])


def _cuda_in_use() -> bool:
    """CUDA is initialised in this process (asking does not initialise it)."""
    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
