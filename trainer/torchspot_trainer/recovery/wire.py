"""Moving a training state between ranks as tensors: a JSON skeleton and the tensors, in one byte buffer.

A restart that brings a joining node (no snapshot of its own) or resumes from Blob must give
every rank the same state. `broadcast_object_list` would pickle the whole state on the source,
send the bytes, and unpickle them on every receiver: the state held twice on each side, CPU
tensors only, and a receiver that runs whatever the pickle says. Here the source sends:

1. the state's structure as JSON (`flatten`): dicts, lists, numbers, strings, and for each
   tensor its dtype, shape and place in its dtype's buffer. A receiver parses it; nothing in
   it runs;
2. per dtype, all tensors of that dtype concatenated into one flat section.

The skeleton and the sections travel as one byte buffer (each section aligned, `layout`), after its
sizes: two broadcasts in all, whatever the state holds (on the group's device: NCCL moves only
device tensors); a skeleton, then one buffer per dtype, took five, and each broadcast cost 3-6 ms on
2 CPU cores, mostly waiting for the slowest rank. In place the two go as sends to each rank that
lacks the state instead (`pack`, `unpack`), while the others train a step without it (train.py).

The receivers cut the sections into the tensors again (`unflatten`; views, no copy on the
host). The state the trainer checkpoints (checkpoint/manager.py, `torch.load(weights_only=True)`)
has only these kinds of values, so whatever can be checkpointed can be sent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

_TENSOR = "__tensor__"
_DICT = "__dict__"
_TUPLE = "__tuple__"
_FLOAT = "__float__"


class WireError(ValueError):
    """A state that cannot be sent as tensors (a value of a kind a checkpoint cannot hold)."""


def flatten(state: Any) -> tuple[str, dict[str, list[torch.Tensor]]]:
    """(the JSON skeleton, the tensors by dtype name, in the skeleton's order). Pure."""
    tensors: dict[str, list[torch.Tensor]] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            group = tensors.setdefault(dtype, [])
            group.append(value)
            return {_TENSOR: [dtype, len(group) - 1, list(value.shape)]}
        if isinstance(value, Mapping):  # keys keep their type (the optimizer's state is keyed by int)
            return {_DICT: [[key, walk(item, f"{where}.{key}")] for key, item in value.items()]}
        if isinstance(value, tuple):
            return {_TUPLE: [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]}
        if isinstance(value, list):
            return [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, float) and not math.isfinite(value):
            return {_FLOAT: repr(value)}  # JSON has no NaN or infinity
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise WireError(f"{where or 'the state'}: a {type(value).__name__} cannot be sent as tensors")

    skeleton = json.dumps(walk(state, ""), allow_nan=False)
    return skeleton, tensors


def unflatten(skeleton: str, buffers: Mapping[str, torch.Tensor]) -> Any:
    """The state again: `buffers[dtype]` is that dtype's flat buffer (`flatten`'s tensors, concatenated).
    The tensors are views of the buffers. Pure."""
    offsets = dict.fromkeys(buffers, 0)

    def build(value: Any) -> Any:
        if isinstance(value, list):
            return [build(item) for item in value]
        if not isinstance(value, dict):
            return value
        if _TENSOR in value:
            dtype, _index, shape = value[_TENSOR]
            count = math.prod(shape)
            start = offsets[dtype]
            offsets[dtype] = start + count
            return buffers[dtype][start : start + count].view(shape)
        if _DICT in value:
            return {key: build(item) for key, item in value[_DICT]}
        if _TUPLE in value:
            return tuple(build(item) for item in value[_TUPLE])
        if _FLOAT in value:
            return float(value[_FLOAT])
        raise WireError(f"not a state skeleton: {sorted(value)}")

    return build(json.loads(skeleton))


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise WireError(f"unknown dtype {name!r} in a state skeleton")
    return found


Send = Callable[[torch.Tensor, int], None]
"""A broadcast of a tensor, in place, from a source rank (`Group.broadcast`)."""


def _default_group(tensor: torch.Tensor, src: int) -> None:
    dist.broadcast(tensor, src=src)


def pack(state: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sizes, the buffer) that carry `state`: the skeleton's bytes and the buffer's as two longs,
    then the skeleton and each dtype's section in one aligned byte buffer (`layout`), on `device`."""
    skeleton, tensors = flatten(state)
    encoded = skeleton.encode()
    places, total = layout(len(encoded), {dtype: sum(t.numel() for t in parts) for dtype, parts in tensors.items()})
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    buffer[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    for dtype, parts in tensors.items():  # one copy per dtype, not a slice assignment per tensor
        flat = [tensor.detach().reshape(-1).to(device) for tensor in parts]
        torch.cat(flat, out=_section(buffer, dtype, places[dtype]))
    return torch.tensor([len(encoded), total], dtype=torch.long, device=device), buffer


def unpack(sizes: torch.Tensor, buffer: torch.Tensor) -> Any:
    """The state `pack` made `sizes` and `buffer` of, its tensors in host memory. A skeleton whose
    tensors do not fill the buffer exactly is refused (WireError)."""
    length, total = (int(value) for value in sizes.tolist())
    skeleton = buffer[:length].cpu().numpy().tobytes().decode()
    places, expected = layout(length, _sizes(skeleton))
    if expected != total or buffer.numel() != total:
        raise WireError(f"a state skeleton that needs {expected} bytes came in a buffer of {buffer.numel()}")
    # A section each of its own in host memory: views of one storage as several dtypes cannot be saved.
    sections = {dtype: _section(buffer, dtype, place).to("cpu", copy=True) for dtype, place in places.items()}
    return unflatten(skeleton, sections)


def broadcast_state(state: Any, src: int, rank: int, device: torch.device, send: Send = _default_group) -> Any:
    """`state` from rank `src` to every rank (the others pass None): over the default group, or
    through `send` (a worker that re-forms in place has no default group: live.py); the receivers'
    tensors end up in host memory. One broadcast for the sizes (the skeleton's bytes, the buffer's),
    one for the buffer (module docstring)."""
    if rank == src:
        sizes, buffer = pack(state, device)
    else:
        sizes = torch.zeros(2, dtype=torch.long, device=device)
    send(sizes, src)
    if rank != src:
        buffer = torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
    send(buffer, src)
    return state if rank == src else unpack(sizes, buffer)


ALIGN = 16
"""Bytes each section of the buffer starts on: a byte buffer's slice can be viewed as a dtype of up to
16 bytes only from an offset its size divides."""


def layout(skeleton_bytes: int, sizes: Mapping[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
    """(each dtype's section as (byte offset, elements), in dtype name order after the skeleton; the
    buffer's bytes) for a skeleton of `skeleton_bytes` and `sizes` elements per dtype. Pure."""
    offset = _aligned(skeleton_bytes)
    places: dict[str, tuple[int, int]] = {}
    for dtype in sorted(sizes):
        places[dtype] = (offset, sizes[dtype])
        offset = _aligned(offset + sizes[dtype] * _dtype(dtype).itemsize)
    return places, offset


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _section(buffer: torch.Tensor, dtype: str, place: tuple[int, int]) -> torch.Tensor:
    """A dtype's section of the byte buffer, as a flat tensor of that dtype (a view)."""
    offset, count = place
    kind = _dtype(dtype)
    return buffer[offset : offset + count * kind.itemsize].view(kind)


def _sizes(skeleton: str) -> dict[str, int]:
    """Elements per dtype in the skeleton's tensors: the sizes of the buffers to receive."""
    found: dict[str, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            if _TENSOR in value:
                dtype, _index, shape = value[_TENSOR]
                _dtype(dtype)  # an unknown dtype is refused before anything is received
                found[dtype] = found.get(dtype, 0) + math.prod(shape)
            else:
                for item in value.values():
                    walk(item)

    walk(json.loads(skeleton))
    return found
