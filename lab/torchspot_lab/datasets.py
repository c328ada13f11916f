"""Small synthetic data sets in the real CIFAR-10 and ImageNet formats, with a learnable class
signal: what the demo, the tests and the benchmarks train on (no data set can be downloaded here).
The trainer reads them as it reads the real ones."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np

from torchspot_trainer.data.datasets import CIFAR_FOLDER, CIFAR_TEST, CIFAR_TRAIN


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
