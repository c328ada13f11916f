"""`torchspot data prepare`: an ImageNet-style folder written to Blob (or a folder) as shards of
pre-resized JPEGs, which a node copies as a few thousand objects and unpacks into its cache.

Why: ImageNet's 1.28 M files are 1.28 M GETs (or blobfuse's per-file latency) for every node that
joins, and its images average about 400 x 350 with many far larger, so every epoch decodes pixels
that the 224-pixel crop throws away. Prepared, the train split is about 1,300 objects of 1,000
images, each image shrunk to `--short-side` (288 by default: RandomResizedCrop still finds 224
pixels across, and a JPEG decode costs about its pixel count) and re-encoded by libjpeg-turbo.

The layout the trainer reads is unchanged: the node's copy (`fetch.fetch_prefix`) unpacks each
shard into `<split>/<class>/<file>`, so the same `ImageFolder`, its node index and the exact-once
sampler apply, and the sample order is the source's (classes and files sorted as there).

    torchspot data prepare /data/imagenet az://datasets/imagenet-288 [--short-side 288]
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from torchspot_trainer.checkpoint.storage import open_storage
from torchspot_trainer.data.datasets import scan_folder
from torchspot_trainer.data.imaging import jpeg_size

MANIFEST = "torchspot-data.json"
"""The prepared data set's description, at its prefix's root: its presence tells the node's copy
to unpack the shards (`fetch.fetch_prefix`)."""
FORMAT = "torchspot-shards/1"
SPLITS = ("train", "val")
DEFAULT_SHORT_SIDE = 288
DEFAULT_SHARD_IMAGES = 1000
DEFAULT_QUALITY = 90
JPEG_SUFFIXES = (".jpeg", ".jpg")


@dataclass(frozen=True)
class Shard:
    """One shard to write: its split, number, and the (file, class name) of each image in it."""

    split: str
    number: int
    images: list[tuple[Path, str]]

    @property
    def name(self) -> str:
        return f"{self.split}/shard-{self.number:06d}.tar"


def target_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """(width, height) with the shorter side `short_side`, the aspect kept; never enlarged. Pure."""
    shorter = min(width, height)
    if shorter <= short_side:
        return width, height
    scale = short_side / shorter
    return max(1, round(width * scale)), max(1, round(height * scale))


def shrink(data: bytes, short_side: int, quality: int) -> bytes:
    """An image file's bytes as a JPEG whose shorter side is at most `short_side`. A JPEG already
    small enough is kept as it is (no second lossy encode); anything else is decoded (libjpeg-turbo
    for JPEGs, Pillow otherwise), resized by torch's antialiased bilinear kernel and encoded."""
    import simplejpeg  # noqa: PLC0415

    dimensions = jpeg_size(data)
    if dimensions is not None:
        if target_size(*dimensions, short_side) == dimensions:
            return data
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")
    else:
        from PIL import Image  # noqa: PLC0415

        with Image.open(io.BytesIO(data)) as img:
            pixels = np.array(img.convert("RGB"), dtype=np.uint8)
    height, width = pixels.shape[:2]
    new_width, new_height = target_size(width, height, short_side)
    if (new_width, new_height) != (width, height):
        image = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)
        resized = F.interpolate(image, size=(new_height, new_width), mode="bilinear", antialias=True)
        pixels = resized[0].permute(1, 2, 0).contiguous().numpy()
    encoded: bytes = simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB")
    return encoded


def member_name(path: Path, class_name: str) -> str:
    """The image's name in its shard: `<class>/<file>`, with a JPEG suffix (a PNG becomes a JPEG)."""
    suffix = path.suffix if path.suffix.lower() in JPEG_SUFFIXES else ".JPEG"
    return f"{class_name}/{path.stem}{suffix}"


def build_shard(shard: Shard, short_side: int, quality: int) -> bytes:
    """The shard's tar file: each image shrunk (`shrink`) under `member_name`. Runs in a pool process."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path, class_name in shard.images:
            body = shrink(path.read_bytes(), short_side, quality)
            info = tarfile.TarInfo(member_name(path, class_name))
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buffer.getvalue()


def plan_shards(source: Path, shard_images: int) -> Iterator[Shard]:
    """Every split's images in the trainer's order (`scan_folder`), cut into shards of `shard_images`."""
    for split in SPLITS:
        index = scan_folder(source / split)
        images = [index.sample(i) for i in range(len(index))]
        named = [(path, index.classes[label]) for path, label in images]
        for number, start in enumerate(range(0, len(named), shard_images)):
            yield Shard(split, number, named[start : start + shard_images])


def prepare(
    source: Path,
    dest: str,
    *,
    short_side: int = DEFAULT_SHORT_SIDE,
    shard_images: int = DEFAULT_SHARD_IMAGES,
    quality: int = DEFAULT_QUALITY,
    workers: int = 1,
    say: Callable[[str], None] = print,
) -> dict[str, object]:
    """Write `source` (an ImageNet-style folder with train/ and val/) to `dest` (az://container/prefix
    or a folder) as shards, then the manifest (last: a data set without it is not a prepared one).
    Returns the manifest."""
    for problem in _problems(source, short_side, shard_images, quality, workers):
        raise ValueError(problem)
    storage = open_storage(dest)
    shards = list(plan_shards(source, shard_images))
    counts: dict[str, dict[str, int]] = {split: {"images": 0, "shards": 0} for split in SPLITS}
    with ProcessPoolExecutor(workers) as pool:
        built = pool.map(build_shard, shards, [short_side] * len(shards), [quality] * len(shards))
        for done, (shard, body) in enumerate(zip(shards, built, strict=True), start=1):
            storage.put(shard.name, body)
            counts[shard.split]["images"] += len(shard.images)
            counts[shard.split]["shards"] += 1
            say(f"{shard.name}: {len(shard.images)} images, {len(body) / 2**20:.1f} MiB ({done} of {len(shards)})")
    manifest: dict[str, object] = {
        "format": FORMAT, "short_side": short_side, "quality": quality, "splits": counts,
    }  # fmt: skip
    storage.put(MANIFEST, json.dumps(manifest, indent=2).encode())
    return manifest


def _problems(source: Path, short_side: int, shard_images: int, quality: int, workers: int) -> Sequence[str]:
    checks = [
        (all((source / split).is_dir() for split in SPLITS), f"{source}: expected train/ and val/ folders"),
        (short_side >= 32, f"--short-side {short_side}: must be at least 32 (pixels)"),
        (shard_images >= 1, f"--shard-images {shard_images}: must be at least 1"),
        (1 <= quality <= 100, f"--quality {quality}: must be between 1 and 100"),
        (workers >= 1, f"--workers {workers}: must be at least 1"),
    ]
    return [message for ok, message in checks if not ok]


def unpack(body: bytes, into: Path) -> int:
    """Unpack one shard into `into` (its split's folder in the node's cache); the number of images.
    Members are checked as tarfile's `data` filter does: no absolute paths, links or devices."""
    with tarfile.open(fileobj=io.BytesIO(body), mode="r") as tar:
        members = [tarfile.data_filter(member, str(into)) for member in tar.getmembers()]  # raises on a bad one
        # Several shards unpack at once (fetch's threads) into the same class folders, and tarfile's
        # own check-then-create of a member's folder races: they are made first, each safe already.
        for folder in {Path(member.name).parent for member in members}:
            (into / folder).mkdir(parents=True, exist_ok=True)
        tar.extractall(into, members=members, filter="data")
    return len(members)
