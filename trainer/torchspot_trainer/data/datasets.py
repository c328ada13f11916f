"""Data sets: CIFAR-10 (python batches), ImageNet-style folders and digits.

- CIFAR-10 in its "python version" format: the pickled `data_batch_1..5` and
  `test_batch` inside `cifar-10-python.tar.gz` (or the extracted
  `cifar-10-batches-py/` folder), each a dict with `data` (N x 3072 uint8, channel
  planes of 32x32) and `labels`.
- ImageNet's folder layout: `ROOT/train/<class>/*.JPEG` and `ROOT/val/<class>/*`:
  RandomResizedCrop and flip for training, resize and centre crop for evaluation (the
  standard recipe). The crop boxes and the JPEG decoding are imaging.py's.
- Every data set yields uint8 images (a quarter of float32's bytes through the loader,
  its shared memory and the copy to the GPU) and names its `Normalize`, which the trainer
  applies on the device.
- Augmentation is drawn per sample from (seed, epoch, index) (`sample_generator`), never
  from a process's random state, so it does not depend on the rank or the world size.
- scikit-learn's bundled 8x8 digits (real handwriting, shipped inside the package),
  for correctness tests that must not depend on data written here.

Small synthetic sets in these formats, for the tests, benchmarks and demo, are written by
the lab (torchspot_lab/datasets.py); a Blob prefix is copied to the node by fetch.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import shutil
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from torchspot_trainer.data.imaging import Box, decode_region, eval_crop_box, resized_crop_box

log = logging.getLogger(__name__)

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TARBALL = "cifar-10-python.tar.gz"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = "test_batch"
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


class Normalize:
    """Per-channel normalisation of a uint8 batch, `(x / 255 - mean) / std`, where the batch is.

    Data sets yield uint8 and the trainer normalises after the copy to the device: the
    loader's workers, their shared memory and the host-to-device copy carry a quarter of
    the bytes, and the arithmetic runs on the GPU instead of a loader core. The constants
    are kept per device, so a step makes no host-to-device copy of its own for them.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if len(mean) != len(std):
            raise ValueError(f"{len(mean)} means but {len(std)} standard deviations")
        self.mean = tuple(mean)
        self.std = tuple(std)
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Float32 `images` (N, C, H, W), normalised; the memory format is kept."""
        if images.dtype != torch.uint8:
            raise TypeError(f"expected a uint8 batch, got {images.dtype}")
        device = images.device
        if device not in self._constants:
            shape = (1, len(self.mean), 1, 1)
            offset = torch.tensor([255.0 * m for m in self.mean]).view(shape)
            scale = torch.tensor([1.0 / (255.0 * s) for s in self.std]).view(shape)
            self._constants[device] = (offset.to(device), scale.to(device))
        offset, scale = self._constants[device]
        return (images.float() - offset) * scale

    def __getstate__(self) -> dict[str, object]:  # loader workers get the numbers, not device tensors
        return {"mean": self.mean, "std": self.std, "_constants": {}}


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The random source of one sample's augmentation in one epoch.

    Seeded by (seed, epoch, sample index) alone, so a sample is cropped and flipped the
    same way whichever rank or data-loader worker draws it, before and after a resume
    and at any world size: an elastic run sees the data a fixed run sees. (A generator
    per process, seeded per rank or per worker, made the augmentation depend on how
    the batch was split, and every rank's worker k draw the same crops.)
    """
    mixed = (seed * 1_000_003 + epoch) * 2_654_435_761 + index
    return torch.Generator().manual_seed(mixed % (2**63 - 1))


class SampleRandom:
    """The epoch a data set draws its augmentation for (`set_epoch`, called before each epoch's
    loader is made, so its worker processes inherit it), and the run's seed."""

    seed: int = 0
    epoch: int = 0

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        """Draw augmentations for `epoch` (and, if given, the run's `seed`) from now on."""
        self.epoch = epoch
        if seed is not None:
            self.seed = seed

    def generator(self, index: int) -> torch.Generator:
        return sample_generator(self.seed, self.epoch, index)


class TensorImages(SampleRandom, Dataset[tuple[torch.Tensor, int]]):
    """Images held in memory as uint8 NCHW, yielded as uint8 (`normalize` is their statistics).

    :param augment: random horizontal flip (and 4-pixel random crop for 32x32), drawn per
        sample (`sample_generator`).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: Sequence[int],
        mean: Sequence[float],
        std: Sequence[float],
        *,
        augment: bool = False,
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if images.dtype != torch.uint8:
            raise TypeError(f"images must be uint8, got {images.dtype}")
        self.images = images
        self.labels = torch.as_tensor(list(labels), dtype=torch.long)
        self.normalize = Normalize(mean, std)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.augment:
            random = self.generator(index)
            if torch.rand((), generator=random) < 0.5:
                image = image.flip(-1)
            if image.shape[-1] == 32:
                padded = F.pad(image, (4, 4, 4, 4))  # black, as RandomCrop(32, padding=4) pads before Normalize
                dx, dy = (int(v) for v in torch.randint(0, 9, (2,), generator=random))
                image = padded[:, dy : dy + 32, dx : dx + 32]
        return image.contiguous(), int(self.labels[index])


def _cifar_members(path: Path) -> dict[str, dict[bytes, object]]:
    """Read the pickled batches from the tarball or the extracted folder."""
    wanted = [*CIFAR_TRAIN, CIFAR_TEST]
    batches: dict[str, dict[bytes, object]] = {}
    if path.is_file():
        with tarfile.open(path, "r:gz") as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if name in wanted and (handle := tar.extractfile(member)) is not None:
                    with handle:
                        batches[name] = pickle.load(handle, encoding="bytes")  # noqa: S301 - CIFAR's own format
    elif (path / CIFAR_TARBALL).is_file():  # the tarball's folder: what a copied Blob prefix holds
        return _cifar_members(path / CIFAR_TARBALL)
    else:
        folder = path / CIFAR_FOLDER if (path / CIFAR_FOLDER).is_dir() else path
        for name in wanted:
            if (folder / name).exists():
                with (folder / name).open("rb") as handle:
                    batches[name] = pickle.load(handle, encoding="bytes")  # noqa: S301
    missing = [n for n in wanted if n not in batches]
    if missing:
        raise FileNotFoundError(f"{path}: not a CIFAR-10 python data set (missing {', '.join(missing)})")
    return batches


def _cifar_tensors(batches: list[dict[bytes, object]]) -> tuple[torch.Tensor, list[int]]:
    data = np.concatenate([np.asarray(b[b"data"], dtype=np.uint8) for b in batches])
    labels = [int(v) for b in batches for v in b[b"labels"]]  # type: ignore[attr-defined]
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), labels


def load_cifar10(path: Path, *, augment: bool = True) -> tuple[TensorImages, TensorImages]:
    """(train, test) from `cifar-10-python.tar.gz` or its extracted folder."""
    batches = _cifar_members(path)
    train_x, train_y = _cifar_tensors([batches[n] for n in CIFAR_TRAIN])
    test_x, test_y = _cifar_tensors([batches[CIFAR_TEST]])
    return (
        TensorImages(train_x, train_y, CIFAR_MEAN, CIFAR_STD, augment=augment),
        TensorImages(test_x, test_y, CIFAR_MEAN, CIFAR_STD),
    )


INDEX_VERSION = 1
"""The layout of a folder index's files (`FileIndex`); a new layout gets a new key."""


@dataclass(frozen=True)
class FileIndex:
    """An image folder's samples as three arrays: relative paths end to end (utf-8), their offsets,
    and labels. Why not a list of (Path, label): at ImageNet's 1.28 M files that list is about half
    a GiB of Python objects per training process, built by a scan of every folder at each restart,
    and copied page by page into every loader worker as reference counts touch it. Saved once per
    node (`node_index`) and memory-mapped, the arrays are one copy in the page cache for every
    rank and loader of the node, across restarts."""

    root: Path
    classes: list[str]
    names: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def sample(self, index: int) -> tuple[Path, int]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.root / bytes(self.names[start:end]).decode(), int(self.labels[index])


def scan_folder(root: Path) -> FileIndex:
    """`ROOT/<class>/<image>` listed: classes sorted (torchvision's order), files sorted in each."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not classes:
        raise FileNotFoundError(f"{root}: expected one folder per class with images inside")
    names: list[bytes] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        for path in sorted((root / name).iterdir()):
            if path.suffix.lower() in IMAGE_SUFFIXES:
                names.append(f"{name}/{path.name}".encode())
                labels.append(label)
    if not names:
        raise FileNotFoundError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) found")
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(n) for n in names], out=offsets[1:])
    return FileIndex(root, classes, np.frombuffer(b"".join(names), dtype=np.uint8), offsets,
                     np.asarray(labels, dtype=np.int32))  # fmt: skip


def index_key(root: Path) -> str:
    """The name of `root`'s saved index: its absolute path and each class folder's name and change
    time (adding or removing an image changes its folder's), so a changed data set is scanned again."""
    folders = sorted((p.name, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    text = json.dumps([INDEX_VERSION, str(root.resolve()), folders])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def node_index(root: Path, folder: Path) -> FileIndex:
    """`root`'s index from `folder` (the node's data cache, kept across restarts), memory-mapped;
    scanned and saved there first if it is not (one rank scans, under a lock; the others wait and
    load it). A folder that cannot be written falls back to a scan of this process's own."""
    saved = folder / f"index-{index_key(root)}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{saved.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its holder dies
            if not saved.is_dir():
                _save_index(scan_folder(root), saved)
    except OSError as exc:
        log.warning("data index not kept in %s (%s): scanning %s in this process", folder, exc, root)
        return scan_folder(root)
    classes = json.loads((saved / "classes.json").read_text())
    arrays = {name: np.load(saved / f"{name}.npy", mmap_mode="r") for name in ("names", "offsets", "labels")}
    return FileIndex(root, classes, arrays["names"], arrays["offsets"], arrays["labels"])


def _save_index(index: FileIndex, saved: Path) -> None:
    """Write the index's files to a temporary folder and rename it: a crash leaves no half index."""
    partial = saved.with_name(f"{saved.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    (partial / "classes.json").write_text(json.dumps(index.classes))
    for name in ("names", "offsets", "labels"):
        np.save(partial / f"{name}.npy", getattr(index, name))
    partial.rename(saved)


class ImageFolder(SampleRandom, Dataset[tuple[torch.Tensor, int]]):
    """`ROOT/<class>/<image>`: the standard ImageNet transforms, yielded as uint8 (3, size, size).

    Training (`augment`): RandomResizedCrop to `size` and a horizontal flip, drawn per
    sample (`sample_generator`). Evaluation: the shorter side resized to size x 256/224,
    then the centre crop. Classes are the sorted folder names, as in torchvision's ImageFolder.
    The region is cut before the resize (`decode_region`), so only it is resized.
    """

    def __init__(self, root: Path, size: int = 224, *, augment: bool = False, index_dir: Path | None = None) -> None:
        """:param index_dir: the node's folder for the file index (`node_index`); None: scan here."""
        self.index = scan_folder(root) if index_dir is None else node_index(root, index_dir)
        self.classes = self.index.classes
        self.size = size
        self.augment = augment
        self.normalize = Normalize(IMAGENET_MEAN, IMAGENET_STD)

    def __len__(self) -> int:
        return len(self.index)

    def region(self, index: int, width: int, height: int) -> tuple[Box, bool]:
        """Sample `index`'s crop of a width x height image, and whether it is flipped: the
        box, then the flip, drawn from the sample's generator (`sample_generator`)."""
        if not self.augment:
            return eval_crop_box(width, height, self.size), False
        random = self.generator(index)
        box = resized_crop_box(width, height, random)
        return box, bool(torch.rand((), generator=random) < 0.5)

    def decoded(self, index: int, data: bytes) -> torch.Tensor:
        """Sample `index` from its file's bytes `data`: cropped, resized and flipped, uint8."""
        flips: list[bool] = []

        def box_of(width: int, height: int) -> Box:
            box, flip = self.region(index, width, height)
            flips.append(flip)
            return box

        image = decode_region(data, box_of, self.size)
        return image.flip(-1) if flips[0] else image

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.index.sample(index)
        return self.decoded(index, path.read_bytes()), label


def load_imagenet(root: Path, size: int = 224, index_dir: Path | None = None) -> tuple[ImageFolder, ImageFolder]:
    """(train, val) from an ImageNet-style folder with `train/` and `val/` (`index_dir`: ImageFolder's)."""
    return (
        ImageFolder(root / "train", size, augment=True, index_dir=index_dir),
        ImageFolder(root / "val", size, index_dir=index_dir),
    )


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")
"""Where scikit-learn ships its digits, under its package folder: 1797 rows of 64 pixel values (0-16)
and the label."""


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> tuple[TensorImages, TensorImages]:
    """scikit-learn's bundled 8x8 digits (1797 images), split into (train, test).

    Read from the file scikit-learn ships (`DIGITS_FILE`), as its `load_digits` reads it, without
    importing scikit-learn: that import (SciPy's with it) took 2.3 s of CPU on an idle core here, paid
    by every worker at every restart of the tests' and benchmarks' jobs, and 16-25 s in a loaded suite.
    """
    found = importlib.util.find_spec("sklearn")
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError("--dataset digits: scikit-learn's digits ship with scikit-learn: install it")
    table = np.loadtxt(Path(found.submodule_search_locations[0], *DIGITS_FILE), delimiter=",")
    images = torch.from_numpy((table[:, :-1].reshape(-1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)
    labels = [int(v) for v in table[:, -1]]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = int(len(order) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    mean, std = (0.5,), (0.5,)
    return (
        TensorImages(images[train], [labels[i] for i in train], mean, std),
        TensorImages(images[test], [labels[i] for i in test], mean, std),
    )


Loaded = tuple[Dataset[Any], Dataset[Any], int]
"""A data set's training set, test set and number of classes."""


@dataclass(frozen=True)
class DataSetSpec:
    """What the trainer knows of a data set it trains on (`DATA_SETS`)."""

    load: Callable[[Path, int, Path], Loaded]
    """(its local path, --image-size, the node's folder of file indexes) -> its sets and classes."""
    channels: int
    """Its images' colour channels (the model's first layer takes them)."""
    needs_data: bool = True
    """Read from --data (a folder, an archive or az://); False: it ships inside a package."""
    jpeg: bool = False
    """Its images are JPEG files, which --decode gpu may decode."""


def _cifar10(path: Path, _size: int, _index: Path) -> Loaded:
    train, test = load_cifar10(path)
    return train, test, 10


def _imagenet(path: Path, size: int, index: Path) -> Loaded:
    train, val = load_imagenet(path, size, index_dir=index)
    return train, val, len(train.classes)


def _digits(_path: Path, _size: int, _index: Path) -> Loaded:
    train, test = load_digits(seed=0)
    return train, test, 10


DATA_SETS: dict[str, DataSetSpec] = {
    "cifar10": DataSetSpec(_cifar10, channels=3),
    "imagenet": DataSetSpec(_imagenet, channels=3, jpeg=True),
    "digits": DataSetSpec(_digits, channels=1, needs_data=False),
}
"""The data sets --dataset names, as `models.MODELS` holds the models: a new one is one entry here (its
loader and what the trainer must know of it); the flags' checks and the run's set-up read it."""
