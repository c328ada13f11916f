"""The input path: uint8 samples normalised on the device, JPEG decoding through libjpeg-turbo
with the crop cut before the resize, the persistent loader, and the GPU decoder's mechanism.

The GPU decoder (`--decode gpu`) calls torchvision's nvJPEG, which cannot run here (no GPU,
and no CPU build of torchvision): its test hands `DeviceDecoder` a libjpeg-turbo stand-in
with the same contract, on the CPU, so everything around the decode call is what runs.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image
from torch.utils.data import Dataset

from torchspot_lab.datasets import write_synthetic_imagenet
from torchspot_lab.local import wait_for
from torchspot_trainer.config import TrainConfig
from torchspot_trainer.data.datasets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageFolder,
    Normalize,
    TensorImages,
    sample_generator,
)
from torchspot_trainer.data.imaging import decode_reduction, decode_region, eval_crop_box, resized_crop_box
from torchspot_trainer.data.loader import (
    CROP_CHUNK,
    Collate,
    DeviceAhead,
    DeviceDecoder,
    EpochLoader,
    Packed,
    crop_resize,
    encode,
)
from torchspot_trainer.run import decode_refusal


def _photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth colour field with texture, as a photo compresses (HWC uint8)."""
    rng = np.random.default_rng(seed)
    field = Image.fromarray((rng.random((height // 16 + 2, width // 16 + 2, 3)) * 255).astype(np.uint8))
    pixels = np.asarray(field.resize((width, height), Image.Resampling.BICUBIC)).astype(np.float32)
    pixels += rng.normal(0, 4, pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def _jpeg(pixels: np.ndarray, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    image = Image.fromarray(pixels)
    (image if mode == "RGB" else image.convert(mode)).save(buffer, "JPEG", quality=92)
    return buffer.getvalue()


def _pillow_region(data: bytes, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    """The recipe as it was: Pillow decodes and resizes the box to size x size (bilinear)."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR, box=box)
        return torch.from_numpy(np.array(rgb)).permute(2, 0, 1)


def test_normalize_on_uint8_equals_the_float_formula_and_keeps_the_memory_format() -> None:
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    normalize = Normalize(IMAGENET_MEAN, IMAGENET_STD)
    got = normalize(images)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    want = (images.float() / 255.0 - mean) / std
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5)
    assert got.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(TypeError, match="uint8"):
        normalize(images.float())
    copied = pickle.loads(pickle.dumps(normalize))  # as a loader worker receives it: numbers only
    assert (copied.mean, copied.std) == (normalize.mean, normalize.std)
    assert torch.allclose(copied(images), got)


def test_data_sets_yield_uint8_a_quarter_of_the_float_bytes(tmp_path: Path) -> None:
    root = write_synthetic_imagenet(tmp_path / "imagenet", classes=2, per_class=4, size=96)
    folder = ImageFolder(root / "train", 64, augment=True)
    image, _ = folder[0]
    assert (image.dtype, image.shape) == (torch.uint8, (3, 64, 64))
    batch, labels = Collate(image.shape)([folder[i] for i in range(4)])
    assert batch.dtype == torch.uint8  # type: ignore[union-attr]
    assert batch.nbytes * 4 == folder.normalize(batch).nbytes  # type: ignore[union-attr,arg-type]
    assert labels.tolist() == [0, 0, 0, 0]
    empty, _ = Collate(image.shape)([])
    assert (empty.shape, empty.dtype) == ((0, 3, 64, 64), torch.uint8)  # type: ignore[union-attr]
    cifar = TensorImages(
        torch.full((8, 3, 32, 32), 200, dtype=torch.uint8), [0] * 8, (0.5,) * 3, (0.5,) * 3, augment=True
    )
    crops = [cifar[i][0] for i in range(8)]
    assert all(x.dtype == torch.uint8 and x.shape == (3, 32, 32) for x in crops)
    assert any((x == 0).any() for x in crops)  # the 4-pixel crop pads black, as before Normalize
    with pytest.raises(TypeError, match="uint8"):
        TensorImages(torch.zeros(1, 3, 32, 32), [0], (0.5,) * 3, (0.5,) * 3)


def test_the_crop_is_the_recipe_pillow_computed(tmp_path: Path) -> None:
    """decode_region (libjpeg-turbo, torch's uint8 resize of the box) against the pipeline it
    replaced (Pillow's decode and bilinear resize of the box) on the same boxes: the same
    image up to resampling rounding, and the eval crop is resize-shorter-side-then-centre."""
    data = _jpeg(_photo(500, 375))
    for index in range(8):
        box = resized_crop_box(500, 375, sample_generator(0, 0, index))
        ours = decode_region(data, lambda w, h, box=box: box, 224)  # type: ignore[misc]
        theirs = _pillow_region(data, box, 224)
        difference = (ours.int() - theirs.int()).abs()
        assert ours.shape == (3, 224, 224)
        assert difference.float().mean() < 1.0, index
        assert difference.max() <= 16, index
    left, top, right, bottom = eval_crop_box(500, 375, 224)
    assert (right - left, bottom - top) == (328, 328)  # 375 / (256/224)
    assert (left + right) // 2 == 250
    assert (top + bottom) // 2 == 187


def test_large_jpegs_are_shrunk_while_decoding_and_keep_their_crop() -> None:
    assert decode_reduction((0, 0, 500, 375), 224) == 1
    assert decode_reduction((0, 0, 1000, 800), 224) == 2
    assert decode_reduction((0, 0, 1000, 900), 224) == 4  # 900 / 4 still covers 224
    assert decode_reduction((0, 0, 4000, 3000), 224) == 8
    assert decode_reduction((0, 0, 9000, 9000), 224) == 8  # libjpeg-turbo's largest power of two
    data = _jpeg(_photo(1800, 1400, seed=3))
    box = (100, 200, 1300, 1300)  # 1200 x 1100: decoded at a quarter, still 275 px across
    shrunk = decode_region(data, lambda w, h: box, 224)
    full = _pillow_region(data, box, 224)
    assert (shrunk.int() - full.int()).abs().float().mean() < 2.0


def test_png_gray_and_cmyk_files_decode_as_rgb(tmp_path: Path) -> None:
    pixels = _photo(120, 90)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG")
    for data in (png.getvalue(), _jpeg(pixels, "L"), _jpeg(pixels, "CMYK")):
        image = decode_region(data, lambda w, h: (0, 0, w, h), 32)
        assert (image.dtype, image.shape) == (torch.uint8, (3, 32, 32))
    gray = decode_region(_jpeg(pixels, "L"), lambda w, h: (0, 0, w, h), 32)
    assert torch.equal(gray[0], gray[1])
    assert torch.equal(gray[1], gray[2])


class _Pids(Dataset[tuple[torch.Tensor, int]]):
    """`inner`'s images, labelled with the pid of the process that loaded them."""

    def __init__(self, inner: TensorImages) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.inner[index][0], os.getpid()


def _cifar_like(n: int = 24) -> TensorImages:
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return TensorImages(images, list(range(n)), (0.5,) * 3, (0.5,) * 3, augment=True)


def test_the_loader_keeps_its_workers_across_epochs_and_draws_each_epochs_augmentation() -> None:
    """Persistent workers (the same pids in both epochs) still crop and flip as the epoch
    says (`EpochView`); an epoch dropped halfway leaves no stale prefetched batch."""
    reference = _cifar_like()
    reference.set_epoch(0, seed=5)
    dataset = _cifar_like()
    dataset.set_epoch(0, seed=5)
    loader = EpochLoader(dataset, workers=2, pin_memory=False, worker_init=lambda _: None)
    batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    try:
        first = list(loader.epoch(0, batches))
        for (images, labels), batch in zip(first, batches, strict=True):
            assert labels.tolist() == batch
            assert torch.equal(images, torch.stack([reference[i][0] for i in batch]))
        half = loader.epoch(1, batches)
        next(half)  # dropped after one batch, with the rest prefetched
        second = list(loader.epoch(2, [[3, 2], [1, 0]]))
        reference.set_epoch(2)
        assert [labels.tolist() for _, labels in second] == [[3, 2], [1, 0]]
        assert torch.equal(second[0][0], torch.stack([reference[3][0], reference[2][0]]))
        assert not torch.equal(second[0][0][0], first[0][0][3])  # epoch 2 draws new crops
    finally:
        loader.close()
    pids = _Pids(_cifar_like())
    loader = EpochLoader(pids, workers=2, pin_memory=False, worker_init=lambda _: None)
    try:
        seen = {int(p) for epoch in range(3) for _, labels in loader.epoch(epoch, batches) for p in labels}
    finally:
        loader.close()
    assert len(seen) == 2  # two workers served all three epochs
    assert os.getpid() not in seen


def _stand_in_decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """torchvision.io.decode_jpeg's contract (1-D uint8 files -> (3, H, W) uint8 RGB on
    `device`), by libjpeg-turbo on the CPU: nvJPEG needs a GPU and torchvision."""
    return [torch.from_numpy(simplejpeg.decode_jpeg(f.numpy().tobytes())).permute(2, 0, 1).to(device) for f in files]


def test_the_gpu_decoder_crops_resizes_and_flips_as_the_cpu_path(tmp_path: Path) -> None:
    root = tmp_path / "train"
    for label in range(2):
        (root / f"c{label}").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(_photo(320, 240, seed=label * 10 + i)).save(root / f"c{label}" / f"{i}.jpg", quality=92)
    Image.fromarray(_photo(200, 150, seed=99)).save(root / "c1" / "z.png")  # decoded by the worker
    folder = ImageFolder(root, 128, augment=True)  # no crop of 320 x 240 is 256 px: full-size decodes
    folder.set_epoch(1, seed=3)
    items: list[tuple[Any, int]] = [encode(folder, i) for i in range(len(folder))]
    samples, labels = Collate(torch.Size((3, 128, 128)))(items)
    assert isinstance(samples, Packed)
    assert list(samples.decoded) == [len(folder) - 1]  # the PNG (sorted last in c1), decoded by the worker
    assert int(samples.offsets[-1]) == samples.data.numel()
    decoded, same_labels = DeviceDecoder(_stand_in_decode, torch.device("cpu"), 128)((samples, labels))
    assert torch.equal(same_labels, labels)
    expected = torch.stack([folder[i][0] for i in range(len(folder))])
    assert (decoded.dtype, decoded.shape) == (torch.uint8, expected.shape)
    difference = (decoded.int() - expected.int()).abs()
    # The device's batched area filter against the CPU path's antialiased bilinear (crop_resize):
    # 0.3 levels apart on average here, 4 at most; a wrong box or flip is tens.
    assert difference.float().mean() < 0.5
    assert difference.max() <= 6
    flipped = [i for i in range(len(folder)) if folder.region(i, 320, 240)[1]]
    assert 0 < len(flipped) < len(folder)  # both ways occur, and each matched above
    decoder = DeviceDecoder(_stand_in_decode, torch.device("cpu"), 128)
    loader = EpochLoader(folder, workers=0, pin_memory=False, worker_init=lambda _: None, decoder=decoder)
    ((through, through_labels),) = list(loader.epoch(1, [list(range(len(folder)))]))  # the trainer's way in
    assert torch.equal(through, decoded)
    assert torch.equal(through_labels, labels)
    ready = torch.stack([folder[0][0]])
    assert torch.equal(DeviceDecoder(_stand_in_decode, torch.device("cpu"), 128)((ready, labels[:1]))[0], ready)
    # Through loader processes the batch crosses as one packed tensor of files, not one per sample.
    crossed: list[Any] = []

    def seen(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        crossed.append({f.untyped_storage().data_ptr() for f in files})
        return _stand_in_decode(files, device)

    workers = EpochLoader(folder, workers=2, pin_memory=False, worker_init=lambda _: None,
                          decoder=DeviceDecoder(seen, torch.device("cpu"), 128))  # fmt: skip
    try:
        ((packed, packed_labels),) = list(workers.epoch(1, [list(range(len(folder)))]))
    finally:
        workers.close()
    assert torch.equal(packed, decoded)
    assert torch.equal(packed_labels, labels)
    assert [len(storages) for storages in crossed] == [1]  # every file a view of the one packed tensor


def _jpeg_folder(root: Path, count: int) -> ImageFolder:
    (root / "c0").mkdir(parents=True)
    for i in range(count):
        Image.fromarray(_photo(96, 80, seed=i)).save(root / "c0" / f"{i}.jpg", quality=90)
    folder = ImageFolder(root, 32, augment=True)
    folder.set_epoch(0, seed=1)
    return folder


def test_the_decode_runs_one_batch_ahead_of_the_step_and_a_new_epoch_lets_go_of_the_old(tmp_path: Path) -> None:
    """While the step holds batch k, batch k+1 is decoded on the decode thread; a new epoch started
    mid-way (a notice ended the last) gets its own batches, whole and in order; a decode error
    reaches the training thread."""
    folder = _jpeg_folder(tmp_path / "train", 6)
    calls: list[int] = []
    failing: list[int] = []

    def decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        calls.append(len(files))
        if len(calls) in failing:
            raise OSError("nvJPEG: corrupt file")
        return _stand_in_decode(files, device)

    loader = EpochLoader(folder, workers=0, pin_memory=False, worker_init=lambda _: None,
                         decoder=DeviceDecoder(decode, torch.device("cpu"), 32))  # fmt: skip
    try:
        batches = loader.epoch(0, [[0, 1], [2, 3], [4, 5]])
        first = next(batches)
        wait_for(lambda: len(calls) >= 2, 10, "batch 2 decoded while the step holds batch 1")
        assert first[0].shape == (2, 3, 32, 32)
        expected = [DeviceDecoder(_stand_in_decode, torch.device("cpu"), 32)(Collate(torch.Size((3, 32, 32)))(
            [encode(folder, i) for i in pair])) for pair in ([0, 1], [2, 3])]  # fmt: skip
        assert torch.equal(first[0], expected[0][0])
        again = list(loader.epoch(0, [[0, 1], [2, 3]]))  # the old epoch's thread is stopped first
        assert [torch.equal(got[0], want[0]) for got, want in zip(again, expected, strict=True)] == [True, True]
        failing.append(len(calls) + 2)
        broken = loader.epoch(0, [[0, 1], [2, 3], [4, 5]])
        next(broken)
        with pytest.raises(OSError, match="corrupt file"):
            next(broken)
        with pytest.raises(StopIteration):
            next(broken)
    finally:
        loader.close()


def test_batches_copied_ahead_to_the_device_are_the_batches(tmp_path: Path) -> None:
    """Without --decode gpu a GPU's batches are copied to it on the same thread, one ahead (on a CUDA
    side stream there; the CPU stands in here): the same batches, in order, labels included."""
    folder = _jpeg_folder(tmp_path / "train", 6)
    plan = [[0, 1], [2, 3], [4, 5]]
    plain = EpochLoader(folder, workers=0, pin_memory=False, worker_init=lambda _: None)
    ahead = EpochLoader(folder, workers=0, pin_memory=False, worker_init=lambda _: None, ahead=torch.device("cpu"))
    try:
        want, batches = list(plain.epoch(0, plan)), ahead.epoch(0, plan)
        assert isinstance(batches, DeviceAhead)  # the copies come from its thread (and stream, on a GPU)
        got = list(batches)
    finally:
        plain.close()
        ahead.close()
    assert len(got) == len(want) == 3
    for (images, labels), (same_images, same_labels) in zip(got, want, strict=True):
        assert torch.equal(images, same_images)
        assert torch.equal(labels, same_labels)


def test_the_file_index_is_built_once_per_node_and_memory_mapped_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first rank scans and saves the index in the node's data folder; a restart (or another
    rank) maps the same files instead of scanning again; an image added changes the key and is
    found; a folder that cannot be written leaves each process its own scan, with a warning."""
    root = tmp_path / "train"
    folder = _jpeg_folder(root, 4)
    node = tmp_path / "cache" / "index"
    first = ImageFolder(root, 32, augment=True, index_dir=node)
    again = ImageFolder(root, 32, augment=True, index_dir=node)
    assert isinstance(again.index.labels, np.memmap)  # mapped, not a list per process
    assert len(list(node.glob("index-*/"))) == 1
    scanned = [folder.index.sample(i) for i in range(len(folder))]
    assert [first.index.sample(i) for i in range(len(first))] == scanned
    assert [again.index.sample(i) for i in range(len(again))] == scanned
    again.set_epoch(0, seed=1)  # as _jpeg_folder's
    assert torch.equal(again[2][0], folder[2][0])
    Image.fromarray(_photo(96, 80, seed=9)).save(root / "c0" / "9.jpg", quality=90)
    grown = ImageFolder(root, 32, index_dir=node)
    assert len(grown) == 5
    assert grown.index.sample(4)[0] == root / "c0" / "9.jpg"
    (tmp_path / "readonly").write_text("a file where the folder should be")
    with caplog.at_level("WARNING"):
        own = ImageFolder(root, 32, index_dir=tmp_path / "readonly" / "index")
    assert len(own) == 5
    assert "data index not kept" in caplog.text


def test_the_batched_crop_resize_is_exact_where_nothing_is_resampled_across_chunks() -> None:
    """A box of the whole image at its own size samples every pixel at its centre: the image itself,
    flipped where asked, for images of different sizes and past one chunk (CROP_CHUNK)."""
    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 8 + i % 5, 8 + i % 3), dtype=torch.uint8, generator=generator)
              for i in range(CROP_CHUNK + 6)]  # fmt: skip
    boxes = [(0, 0, 8, 8) for _ in images]
    flips = [i % 2 == 1 for i in range(len(images))]
    out = crop_resize(images, boxes, flips, 8)
    assert out.shape == (len(images), 3, 8, 8)
    for slot, image in enumerate(images):
        expected = image[:, :8, :8]
        assert torch.equal(out[slot], expected.flip(-1) if flips[slot] else expected), slot


def test_decode_gpu_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="--decode 'nvjpeg'"):
        TrainConfig(dataset="imagenet", data="x", decode="nvjpeg")
    with pytest.raises(ValueError, match="--decode gpu: only JPEG folders"):
        TrainConfig(dataset="cifar10", data="x", decode="gpu")
    assert decode_refusal("gpu", torch.device("cpu")) == "--decode gpu needs a CUDA device, and this worker runs on cpu"
    assert decode_refusal("cpu", torch.device("cpu")) is None
