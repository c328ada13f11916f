"""The input path from a data set to the device: one persistent loader per run, uint8 batches,
normalisation on the device, and (`--decode gpu`) JPEG decoding on the GPU.

- `EpochLoader` builds its DataLoader once. Its worker processes persist from epoch to
  epoch and keep `prefetch` batches each in flight, so a new epoch, or evaluation after
  it, does not wait for workers to fork and fill. Each index carries its epoch
  (`EpochView`), which is how a persistent worker draws the new epoch's augmentation
  (`SampleRandom`).
- Batches stay uint8 until the device: the data set's `Normalize` runs after the copy.
- With `--decode gpu` (`gpu_decoder`), the workers only read the file and draw the crop
  (`Encoded`), pack the batch's files into one tensor (`Packed`), and the main process
  decodes a whole batch with nvJPEG through torchvision, then crops, resizes and flips it
  on the GPU (`DeviceDecoder`), on a thread and stream of its own one batch ahead of the
  step (`DeviceAhead`). Files libjpeg-turbo cannot read (PNG, CMYK) are decoded by the
  worker as before.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from torchspot_trainer.data.datasets import ImageFolder, SampleRandom
from torchspot_trainer.data.imaging import Box, jpeg_size

PREFETCH_BATCHES = 4
"""Batches each loader worker keeps ready (DataLoader's `prefetch_factor`; its default is 2).
A step that takes a slow sample (a large JPEG) then eats into a queue instead of stalling."""

DECODERS = ("cpu", "gpu")
CPU_LOADER_WORKERS = 2
"""`--workers auto` on a CPU: the step itself computes on the cores, so the loader takes two
processes, not what is left of the node (the fixed default before `auto`)."""
EVAL_LOADER_WORKERS = 4
"""At most this many loader processes for the test set: evaluation runs once an epoch, and its
processes persist idle the rest of the time, each holding memory (11 per GPU, as training gets
on a 96-vCPU node, would be 88 idle processes per node)."""
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
"""cgroup v2's CPU limit of this container: `max 100000` (none) or `QUOTA PERIOD` in microseconds."""


def loader_workers(workers: str, *, cuda: bool, cpus: float, local_ranks: int) -> int:
    """--workers as a number of loader processes per training process. Pure.

    `auto`, on a GPU: the cores this process may use shared among the node's local ranks, less one
    for the training process itself (its loop, the host-to-device copies, NCCL's proxy thread), and
    at least 1. An H100 trains ResNet-50 in bf16 at roughly 3,000 images/s and libjpeg-turbo decodes
    about 640 a core-second here, so a GPU wants every core it can get (a 96-vCPU node with 8 GPUs:
    11 each; the fixed 2 fed about 40% of one). On a CPU: CPU_LOADER_WORKERS.
    """
    if workers != "auto":
        return int(workers)
    if not cuda:
        return CPU_LOADER_WORKERS
    return max(1, int(cpus // max(local_ranks, 1)) - 1)


def cgroup_cpus(cpu_max: str) -> float | None:
    """The CPU limit in cores from cgroup v2's `cpu.max` text (None: no limit, or unreadable). Pure."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        return int(parts[0]) / int(parts[1])
    except (ValueError, ZeroDivisionError):
        return None


def usable_cpus() -> float:
    """The cores this process may run on: its CPU affinity (Kubernetes' static CPU manager pins a
    pod's cores there), or its container's CPU limit where that is lower (a pod's `limits.cpu`)."""
    cores = float(len(os.sched_getaffinity(0)))
    try:
        with open(CGROUP_CPU_MAX) as limit:
            quota = cgroup_cpus(limit.read())
    except OSError:
        quota = None
    return cores if quota is None else min(cores, quota)


Key = tuple[int, int]
"""(epoch, sample index): what the loader's sampler hands a worker."""


@dataclass(frozen=True)
class Encoded:
    """A JPEG's bytes, its crop region and flip, for the GPU to decode."""

    data: torch.Tensor  # uint8, 1-D: the file
    box: Box
    flip: bool


Sample = torch.Tensor | Encoded


@dataclass(frozen=True)
class Packed:
    """A `--decode gpu` batch as it crosses the loader's queue: every file in one uint8 tensor.

    Why: each tensor a worker sends crosses as its own shared-memory segment, which the training
    process maps and unmaps (a file descriptor through a socket, a mmap, bookkeeping): a batch of
    256 separate files costs the training thread tens of milliseconds per step, one packed tensor a
    handful of tensors whatever the batch size.
    """

    data: torch.Tensor
    """uint8, 1-D: the batch's JPEG files end to end."""
    offsets: torch.Tensor
    """int64, (N+1,): sample i's file is data[offsets[i]:offsets[i+1]] (empty when decoded)."""
    boxes: torch.Tensor
    """int64, (N, 4): each sample's crop (left, top, right, bottom)."""
    flips: torch.Tensor
    """bool, (N,): each sample's horizontal flip."""
    decoded: dict[int, torch.Tensor]
    """Samples the worker decoded (files libjpeg-turbo cannot read), by position in the batch."""

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> Packed:
        """Pack one batch's samples (in the loader worker)."""
        files = [s.data if isinstance(s, Encoded) else torch.empty(0, dtype=torch.uint8) for s in samples]
        sizes = torch.tensor([0, *(len(f) for f in files)], dtype=torch.long)
        boxes = [s.box if isinstance(s, Encoded) else (0, 0, 0, 0) for s in samples]
        return cls(
            data=torch.cat(files),
            offsets=sizes.cumsum(0),
            boxes=torch.tensor(boxes, dtype=torch.long).reshape(len(samples), 4),
            flips=torch.tensor([isinstance(s, Encoded) and s.flip for s in samples], dtype=torch.bool),
            decoded={i: s for i, s in enumerate(samples) if isinstance(s, torch.Tensor)},
        )

    def __len__(self) -> int:
        return len(self.flips)

    def files(self) -> list[torch.Tensor]:
        """The encoded samples' files, in batch order: views of `data`, not copies."""
        ends = self.offsets.tolist()
        return [self.data[ends[i] : ends[i + 1]] for i in range(len(self)) if i not in self.decoded]

    def pin_memory(self) -> Packed:
        """Pinned copies (DataLoader's pin-memory thread calls this): the decoder's reads of the
        files then come from page-locked memory."""
        return Packed(
            self.data.pin_memory(), self.offsets, self.boxes, self.flips,
            {i: image.pin_memory() for i, image in self.decoded.items()},
        )  # fmt: skip


class EpochView(Dataset[tuple[Any, int]]):
    """`dataset` indexed by (epoch, index): sets the epoch of this process's copy first.

    Persistent workers keep the data set they forked with, so the epoch cannot be set in the
    main process as before each new loader; it travels with every index instead.
    """

    def __init__(self, dataset: Dataset[tuple[Any, int]], encode: bool = False) -> None:
        self.dataset = dataset
        self.encode = encode

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Key) -> tuple[Any, int]:
        epoch, index = key
        if isinstance(self.dataset, SampleRandom) and self.dataset.epoch != epoch:
            self.dataset.set_epoch(epoch)
        if self.encode and isinstance(self.dataset, ImageFolder):
            return encode(self.dataset, index)
        return self.dataset[index]


def encode(folder: ImageFolder, index: int) -> tuple[Sample, int]:
    """Sample `index` of `folder` for the GPU: the file and its crop (`Encoded`), decoding
    nothing; a file libjpeg-turbo cannot read is decoded here, as on the CPU path."""
    path, label = folder.index.sample(index)
    data = path.read_bytes()
    dimensions = jpeg_size(data)
    if dimensions is None:
        return folder.decoded(index, data), label
    box, flip = folder.region(index, *dimensions)
    return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip), label


class Collate:
    """Stack (image, label) pairs into a uint8 batch; a batch with encoded samples is `Packed` (the
    GPU decodes it). An empty batch (a short last step) keeps its shape."""

    def __init__(self, sample_shape: torch.Size) -> None:
        self.sample_shape = sample_shape

    def __call__(self, items: list[tuple[Sample, int]]) -> tuple[torch.Tensor | Packed, torch.Tensor]:
        labels = torch.tensor([y for _, y in items], dtype=torch.long)
        if not items:
            return torch.empty((0, *self.sample_shape), dtype=torch.uint8), labels
        samples = [x for x, _ in items]
        if any(isinstance(x, Encoded) for x in samples):
            return Packed.of(samples), labels
        return torch.stack(samples), labels  # type: ignore[arg-type]


class _Batches:
    """The loader's batch sampler: the current epoch's batches, replaced before each epoch."""

    def __init__(self) -> None:
        self.batches: list[list[Key]] = []

    def __iter__(self) -> Iterator[list[Key]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


Loaded = tuple[torch.Tensor | Packed, torch.Tensor]
"""A batch as the loader's workers send it: stacked uint8 images (or packed files) and labels."""
Decoded = tuple[torch.Tensor, torch.Tensor]
"""A batch ready for the step: uint8 images on the device and labels."""
AHEAD_STOP_SECONDS = 60.0
"""How long a new epoch (or `close`) waits for the previous epoch's DeviceAhead thread to let go of the
loader: it may be waiting for a batch from a worker, which takes a fraction of that."""


class DeviceAhead(Iterator[Decoded]):
    """`decode` of `source`'s batches on a thread, one batch ahead of the training thread: the
    GPU decode of `--decode gpu`, or the host-to-device copy of a decoded batch (`to_device`).

    Why: torchvision's nvJPEG decode blocks the thread that calls it until the GPU is done, and
    called from the training loop it stops the host from queueing step k while batch k+1 is
    decoded; a copy issued by the step itself, on its own stream, cannot overlap the step's
    compute. On a GPU the thread works on its own CUDA stream; the consumer's stream waits for
    that batch's event, and the batch's device tensors are recorded on the consumer's stream so
    the allocator does not hand their memory back while the step still reads it.
    """

    _END = object()

    def __init__(self, source: Iterator[Loaded], decode: Callable[[Loaded], Decoded], device: torch.device) -> None:
        self._device = device
        self._stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(source, decode), name="device-ahead", daemon=True)
        self._thread.start()

    def _run(self, source: Iterator[Loaded], decode: Callable[[Loaded], Decoded]) -> None:
        try:
            for batch in source:
                if self._stop.is_set():
                    return
                side = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
                with side:
                    decoded = decode(batch)
                    event = None
                    if self._stream is not None:
                        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        event.record(self._stream)
                if not self._put((decoded, event, None)):
                    return
        except Exception as exc:  # handed to the training thread, which raises it
            self._put((None, None, exc))
            return
        self._put(self._END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
            except queue.Full:
                continue
            return True
        return False

    def __next__(self) -> Decoded:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is self._END:
            self._done = True
            raise StopIteration
        decoded, event, error = item
        if error is not None:
            self._done = True
            raise error
        if event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            for tensor in decoded:
                if tensor.is_cuda:
                    tensor.record_stream(current)
        return decoded  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Stop the thread and let go of the loader (before its iterator is reset or shut down)."""
        self._stop.set()
        self._thread.join(AHEAD_STOP_SECONDS)
        if self._thread.is_alive():
            raise RuntimeError(f"the loader's device thread did not let go of it within {AHEAD_STOP_SECONDS:.0f} s")


def to_device(device: torch.device, batch: Loaded) -> Decoded:
    """A decoded batch, images and labels, copied to `device` (from pinned memory: non-blocking)."""
    images, labels = batch
    if not isinstance(images, torch.Tensor):
        raise TypeError("a packed batch of files goes through DeviceDecoder, not to_device")
    return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


class EpochLoader:
    """One DataLoader for a run's data set; `epoch(e, batches)` iterates that epoch's batches.

    :param workers: loader processes (0: load in the training process). They persist for
        the loader's life, holding `PREFETCH_BATCHES` batches each.
    :param worker_init: run in each worker as it starts (the trainer leaves SIGTERM to itself).
    :param decoder: `--decode gpu`: the workers hand JPEGs over undecoded, and each batch goes
        through this on its way out.
    :param ahead: a CUDA device: without a decoder, each batch is copied there on a side stream one
        batch ahead of the step (`DeviceAhead`, `to_device`); None: the step copies its inputs.
    """

    def __init__(
        self,
        dataset: Dataset[tuple[Any, int]],
        *,
        workers: int,
        pin_memory: bool,
        worker_init: Callable[[int], None],
        decoder: DeviceDecoder | None = None,
        ahead: torch.device | None = None,
    ) -> None:
        self._batches = _Batches()
        self._decoder = decoder
        self._ahead_to = ahead
        self._ahead: DeviceAhead | None = None
        """The epoch's decode or copy thread (DeviceAhead), if any."""
        encode = decoder is not None
        shape = dataset[0][0].shape
        self._loader = DataLoader(
            EpochView(dataset, encode),
            batch_sampler=self._batches,
            num_workers=workers,
            collate_fn=Collate(shape),
            worker_init_fn=worker_init,
            pin_memory=pin_memory,
            persistent_workers=workers > 0,
            prefetch_factor=PREFETCH_BATCHES if workers > 0 else None,
        )

    def epoch(self, epoch: int, batches: Sequence[Sequence[int]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of sample indices `batches`, loaded in order, augmented as in `epoch`:
        uint8 images (decoded on the device first, with a decoder) and their labels.

        The previous epoch's iteration, finished or not, is dropped; the workers discard
        what they had prefetched for it.
        """
        self._stop_ahead()
        self._batches.batches = [[(epoch, index) for index in batch] for batch in batches]
        loaded = iter(self._loader)
        if self._decoder is not None:
            self._ahead = DeviceAhead(loaded, self._decoder, self._decoder.device)
        elif self._ahead_to is not None:
            self._ahead = DeviceAhead(loaded, partial(to_device, self._ahead_to), self._ahead_to)
        else:
            return loaded
        return self._ahead

    def _stop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None

    def close(self) -> None:
        """Stop the workers (they also stop when the training process exits)."""
        self._stop_ahead()
        iterator = getattr(self._loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
            self._loader._iterator = None


JpegDecoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
"""Decode JPEG files (1-D uint8 tensors) to (3, H, W) uint8 RGB tensors on a device."""


CROP_CHUNK = 64
"""Images cropped and resized together by `crop_resize`: its float working copies grow with the
chunk (64 ImageNet images at 3x supersampling: about 350 MB on the device, for a few kernels)."""


def crop_resize(images: Sequence[torch.Tensor], boxes: Sequence[Sequence[int]], flips: Sequence[bool],
                size: int) -> torch.Tensor:  # fmt: skip
    """Crop `boxes` (left, top, right, bottom) of `images` ((3, H, W) uint8, any sizes, one device),
    resize each to size x size and flip where asked, a chunk of images in a few kernels: uint8
    (N, 3, size, size).

    Why batched: per image, a crop, an antialiased resize, a rounding and a flip are about eight
    kernels, some 2,000 launches for a batch of 256. Here each chunk is padded into one tensor and
    sampled through one grid (`grid_sample`, bilinear) at k x k points per output pixel, k the
    chunk's largest downscale, then averaged k x k (`avg_pool2d`): an area filter, where the CPU
    path's antialiased bilinear is a triangle one, so the two differ by a level or two on average
    (the test bounds it). Pure."""
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=images[0].device if images else "cpu")
    for start in range(0, len(images), CROP_CHUNK):
        chunk = slice(start, start + CROP_CHUNK)
        out[chunk] = _crop_resize_chunk(images[chunk], boxes[chunk], flips[chunk], size)
    return out


def _crop_resize_chunk(
    images: Sequence[torch.Tensor], boxes: Sequence[Sequence[int]], flips: Sequence[bool], size: int
) -> torch.Tensor:
    device = images[0].device
    height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    padded = torch.zeros((len(images), 3, height, width), dtype=torch.float32, device=device)
    for slot, image in enumerate(images):
        padded[slot, :, : image.shape[1], : image.shape[2]] = image
    factor = max([1, *(-(-max(right - left, bottom - top) // size) for left, top, right, bottom in boxes)])
    steps = (torch.arange(size * factor, dtype=torch.float32, device=device) + 0.5) / (size * factor)
    box = torch.tensor(boxes, dtype=torch.float32, device=device)
    xs = box[:, 0:1] + steps * (box[:, 2:3] - box[:, 0:1])  # source x of each sample point, in pixels
    ys = box[:, 1:2] + steps * (box[:, 3:4] - box[:, 1:2])
    xs = torch.where(torch.tensor(flips, device=device)[:, None], xs.flip(1), xs)
    across, down = (xs / width * 2 - 1)[:, None, :], (ys / height * 2 - 1)[:, :, None]  # grid_sample's -1..1
    grid = torch.stack((across.expand(-1, down.shape[1], -1), down.expand(-1, -1, across.shape[2])), -1)
    sampled = F.grid_sample(padded, grid, mode="bilinear", padding_mode="border", align_corners=False)
    pooled = F.avg_pool2d(sampled, factor) if factor > 1 else sampled
    return pooled.round_().clamp_(0, 255).to(torch.uint8)


class DeviceDecoder:
    """Turn a batch of `Encoded` samples into a uint8 (N, 3, size, size) batch on `device`:
    decode every JPEG of the batch in one call, then crop, resize and flip them on the device
    in a few kernels (`crop_resize`). Samples the worker decoded pass through."""

    def __init__(self, decode: JpegDecoder, device: torch.device, size: int) -> None:
        self.decode = decode
        self.device = device
        self.size = size

    def __call__(self, batch: Loaded) -> Decoded:
        samples, labels = batch
        if isinstance(samples, torch.Tensor):
            return samples.to(self.device, non_blocking=True), labels
        images = self.decode(samples.files(), self.device)
        encoded = [slot for slot in range(len(samples)) if slot not in samples.decoded]
        boxes, flips = samples.boxes.tolist(), samples.flips.tolist()
        out = torch.empty((len(samples), 3, self.size, self.size), dtype=torch.uint8, device=self.device)
        if encoded:
            index = torch.tensor(encoded, device=self.device)
            out[index] = crop_resize(images, [boxes[i] for i in encoded], [flips[i] for i in encoded], self.size)
        for slot, image in samples.decoded.items():
            out[slot] = image.to(self.device, non_blocking=True)
        return out, labels


def gpu_decoder() -> JpegDecoder:
    """torchvision's batched nvJPEG decode (the `gpu` extra; the trainer image has it)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg  # noqa: PLC0415
    except ImportError as exc:
        raise SystemExit(
            "--decode gpu: torchvision is not installed; install the `gpu` extra "
            "(pip install 'torchspot[gpu]') or use the trainer image"
        ) from exc

    def decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if not files:
            return []
        decoded = decode_jpeg(files, mode=ImageReadMode.RGB, device=device)
        return list(decoded)

    return decode
