"""Data sets: CIFAR-10 (python batches), ImageNet-style folders, digits, and synthetic sets.

- CIFAR-10 in its "python version" format: the pickled `data_batch_1..5` and
  `test_batch` inside `cifar-10-python.tar.gz` (or the extracted
  `cifar-10-batches-py/` folder), each a dict with `data` (N x 3072 uint8, channel
  planes of 32x32) and `labels`.
- ImageNet's folder layout: `ROOT/train/<class>/*.JPEG` and `ROOT/val/<class>/*`:
  RandomResizedCrop and flip for training, resize and centre crop for evaluation (the
  standard recipe). JPEGs are decoded by libjpeg-turbo through simplejpeg (Pillow for
  anything else), cropped, and resized by torch's uint8 antialiased bilinear kernel.
- Every data set yields uint8 images (a quarter of float32's bytes through the loader,
  its shared memory and the copy to the GPU) and names its `Normalize`, which the trainer
  applies on the device.
- Augmentation is drawn per sample from (seed, epoch, index) (`sample_generator`), never
  from a process's random state, so it does not depend on the rank or the world size.
- scikit-learn's bundled 8x8 digits (real handwriting, shipped inside the package),
  for correctness tests that must not depend on data written here.
- Generators that write small synthetic sets in the CIFAR and ImageNet formats, with
  a learnable class signal, for the tests and the demo.
- `fetch_prefix` copies a Blob prefix (`az://container/prefix`) to a local cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import math
import pickle
import tarfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from torchspot_trainer.checkpoint.storage import open_storage

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


RESIZED_CROP_SCALE = (0.08, 1.0)
RESIZED_CROP_RATIO = (3 / 4, 4 / 3)
"""The standard ImageNet training crop (torchvision's RandomResizedCrop defaults, the reference
recipe of torchvision's classification references and of Goyal et al. 2017): a region of 8% to
100% of the image's area with an aspect ratio from 3:4 to 4:3, resized to the input size."""
EVAL_RESIZE = 256 / 224
"""Evaluation resizes the shorter side to size x 256/224, then takes the centre crop."""


def resized_crop_box(width: int, height: int, random: torch.Generator) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a RandomResizedCrop region, as torchvision draws it: ten
    tries at a random scale and log-uniform ratio, then the centre crop of the clamped ratio."""
    area = width * height
    low, high = math.log(RESIZED_CROP_RATIO[0]), math.log(RESIZED_CROP_RATIO[1])
    for _ in range(10):
        target = area * float(torch.empty(()).uniform_(*RESIZED_CROP_SCALE, generator=random))
        ratio = math.exp(float(torch.empty(()).uniform_(low, high, generator=random)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (), generator=random))
            left = int(torch.randint(0, width - w + 1, (), generator=random))
            return left, top, left + w, top + h
    ratio = width / height
    if ratio < RESIZED_CROP_RATIO[0]:
        w, h = width, round(width / RESIZED_CROP_RATIO[0])
    elif ratio > RESIZED_CROP_RATIO[1]:
        w, h = round(height * RESIZED_CROP_RATIO[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


Box = tuple[int, int, int, int]
"""(left, top, right, bottom) of a region of an image, in pixels."""


def eval_crop_box(width: int, height: int, size: int) -> Box:
    """The evaluation crop as a region of the original image: resizing the shorter side to
    size x 256/224 and taking the centre size x size is the centre square of side
    shorter / (256/224), resized to size."""
    side = max(1, round(min(width, height) / EVAL_RESIZE))
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def decode_reduction(box: Box, size: int) -> int:
    """How many times smaller (1, 2, 4 or 8) libjpeg-turbo may decode an image, in the DCT
    domain, and still leave the crop `box` at least `size` pixels on each side: the resize
    after it then still only shrinks. Saves most of the work on images several times the
    input size; at ImageNet's usual 500 x 375 it is 1. Pure."""
    shorter = min(box[2] - box[0], box[3] - box[1])
    factor = 1
    while factor < 8 and shorter >= 2 * factor * size:
        factor *= 2
    return factor


def scale_box(box: Box, sx: float, sy: float) -> Box:
    """`box` in an image scaled by (sx, sy): the pixels it covers, never empty. Pure."""
    left, top = math.floor(box[0] * sx), math.floor(box[1] * sy)
    return left, top, max(math.ceil(box[2] * sx), left + 1), max(math.ceil(box[3] * sy), top + 1)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's header, or None if libjpeg-turbo cannot decode it to RGB
    (not a JPEG, or a CMYK one): those go through Pillow."""
    import simplejpeg  # noqa: PLC0415 - the trainer's dependency; imported where images are read

    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return (width, height) if colorspace in ("Gray", "YCbCr", "RGB") else None


def decode_region(data: bytes, box_of: Callable[[int, int], Box], size: int) -> torch.Tensor:
    """Decode an image file's bytes and return the region `box_of(width, height)` resized to
    size x size: uint8, (3, size, size).

    JPEGs are decoded by libjpeg-turbo (simplejpeg), shrunk while decoding where the crop
    allows (`decode_reduction`); anything else by Pillow. The region is resized by torch's
    uint8 antialiased bilinear kernel, Pillow's filter vectorised: about a third of the
    CPU time of Pillow's resize here.
    """
    import simplejpeg  # noqa: PLC0415

    dimensions = jpeg_size(data)
    if dimensions is not None:
        box = box_of(*dimensions)
        factor = decode_reduction(box, size)
        width, height = dimensions
        pixels = simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_width=-(-width // factor), min_height=-(-height // factor), min_factor=factor
        )
        box = scale_box(box, pixels.shape[1] / width, pixels.shape[0] / height)
    else:
        from PIL import Image  # noqa: PLC0415

        with Image.open(io.BytesIO(data)) as img:
            pixels = np.array(img.convert("RGB"), dtype=np.uint8)
        box = box_of(pixels.shape[1], pixels.shape[0])
    left, top, right, bottom = box
    region = torch.from_numpy(pixels[top:bottom, left:right]).permute(2, 0, 1).unsqueeze(0)
    resized = F.interpolate(region, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return resized[0].contiguous()


class ImageFolder(SampleRandom, Dataset[tuple[torch.Tensor, int]]):
    """`ROOT/<class>/<image>`: the standard ImageNet transforms, yielded as uint8 (3, size, size).

    Training (`augment`): RandomResizedCrop to `size` and a horizontal flip, drawn per
    sample (`sample_generator`). Evaluation: the shorter side resized to size x 256/224,
    then the centre crop. Classes are the sorted folder names, as in torchvision's ImageFolder.
    The region is cut before the resize (`decode_region`), so only it is resized.
    """

    def __init__(self, root: Path, size: int = 224, *, augment: bool = False) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        if not classes:
            raise FileNotFoundError(f"{root}: expected one folder per class with images inside")
        self.classes = classes
        self.samples = [
            (path, label)
            for label, name in enumerate(classes)
            for path in sorted((root / name).iterdir())
            if path.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.samples:
            raise FileNotFoundError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) found")
        self.size = size
        self.augment = augment
        self.normalize = Normalize(IMAGENET_MEAN, IMAGENET_STD)

    def __len__(self) -> int:
        return len(self.samples)

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
        path, label = self.samples[index]
        return self.decoded(index, path.read_bytes()), label


def load_imagenet(root: Path, size: int = 224) -> tuple[ImageFolder, ImageFolder]:
    """(train, val) from an ImageNet-style folder with `train/` and `val/`."""
    return ImageFolder(root / "train", size, augment=True), ImageFolder(root / "val", size)


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> tuple[TensorImages, TensorImages]:
    """scikit-learn's bundled 8x8 digits (1797 images), split into (train, test)."""
    from sklearn.datasets import load_digits as sk_digits  # noqa: PLC0415 - test/demo extra

    bunch = sk_digits()
    images = torch.from_numpy((bunch.images * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)
    labels = [int(v) for v in bunch.target]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = int(len(order) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    mean, std = (0.5,), (0.5,)
    return (
        TensorImages(images[train], [labels[i] for i in train], mean, std),
        TensorImages(images[test], [labels[i] for i in test], mean, std),
    )


def _synthetic_images(n: int, classes: int, size: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """Images whose class shows as a color and a stripe frequency, plus noise."""
    labels = rng.integers(0, classes, n)
    yy, xx = np.mgrid[0:size, 0:size] / size
    images = np.empty((n, 3, size, size), dtype=np.uint8)
    for i, label in enumerate(labels):
        hue = np.array([np.cos(label), np.sin(label * 1.3), np.cos(label * 0.7)]) * 0.35 + 0.5
        stripes = 0.5 + 0.5 * np.sin((label + 2) * np.pi * (xx + yy))
        base = hue[:, None, None] * (0.6 + 0.4 * stripes)[None]
        noisy = base + rng.normal(0, 0.12, base.shape)
        images[i] = np.clip(noisy * 255, 0, 255).astype(np.uint8)
    return images, [int(v) for v in labels]


def write_synthetic_cifar10(path: Path, n_train: int = 5000, n_test: int = 1000, seed: int = 0) -> Path:
    """Write `cifar-10-python.tar.gz` with synthetic 32x32 images in the real format."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    per_batch = -(-n_train // 5)
    with tarfile.open(path, "w:gz") as tar:

        def add(name: str, payload: object) -> None:
            blob = pickle.dumps(payload, protocol=2)
            info = tarfile.TarInfo(f"{CIFAR_FOLDER}/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))

        remaining = n_train
        for name in CIFAR_TRAIN:
            count = min(per_batch, remaining)
            remaining -= count
            images, labels = _synthetic_images(count, 10, 32, rng)
            add(
                name,
                {
                    b"batch_label": name.encode(),
                    b"labels": labels,
                    b"data": images.reshape(count, -1),
                },
            )
        images, labels = _synthetic_images(n_test, 10, 32, rng)
        add(
            CIFAR_TEST,
            {b"batch_label": b"test", b"labels": labels, b"data": images.reshape(n_test, -1)},
        )
        add("batches.meta", {b"label_names": [f"class{i}".encode() for i in range(10)]})
    return path


def write_synthetic_imagenet(root: Path, classes: int = 4, per_class: int = 8, size: int = 64, seed: int = 0) -> Path:
    """Write `ROOT/{train,val}/<class>/*.JPEG` with synthetic images."""
    from PIL import Image  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", max(1, per_class // 4))):
        for label in range(classes):
            folder = root / split / f"n{label:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            images, _ = _synthetic_images(count, classes, size, rng)
            for i in range(count):
                # Force the class signal of `label` on every image of this folder.
                forced, _ = _synthetic_images(1, classes, size, np.random.default_rng(seed * 1000 + label))
                pixels = ((images[i].astype(np.uint16) + forced[0]) // 2).astype(np.uint8)
                Image.fromarray(pixels.transpose(1, 2, 0)).save(folder / f"img{i:05d}.JPEG", quality=90)
    return root


def fetch_prefix(uri: str, cache: Path, env: Mapping[str, str] | None = None) -> Path:
    """Copy every object under `uri` (az://container/prefix or a folder) into `cache`, once per node.

    The local ranks of a node all call this at start-up: the first takes the cache's lock and
    copies, the others wait for the lock and then find the copy complete (a marker named after
    `uri`), so a data set is fetched once per node and no two processes write the same file.
    Objects already in the cache are not fetched again (an interrupted copy resumes); each is
    written to a temporary name and renamed, so an interrupted copy never looks complete.
    """
    cache.mkdir(parents=True, exist_ok=True)
    marker = cache / f".complete-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"
    with open(cache / ".torchspot-fetch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its holder dies
        if marker.exists():
            return cache
        storage = open_storage(uri, env, create_container=False)
        fetched = 0
        for name in storage.list():
            target = cache / name
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.partial")
            tmp.write_bytes(storage.get(name))
            tmp.replace(target)
            fetched += 1
        marker.write_text(f"{uri}\n{fetched} objects fetched\n")
    return cache
