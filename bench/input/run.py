"""Input-pipeline benchmark: ImageNet JPEGs through the shipped loader against the pipeline it
replaced, in the same run, on CPU.

Data: JPEGs of ImageNet's most common size (500 x 375, quality 90, a photo-like mix of smooth
colour and texture; the mean file size is printed), in ImageNet's folder layout. Both
pipelines train-augment them to 224 x 224 (RandomResizedCrop and flip), in batches of 32,
with the same number of loader worker processes:

- stock: the loader before this change, which is torchvision's reference recipe: Pillow
  decodes, Pillow resizes the crop, the worker converts to float32 and normalises
  (ToTensor + Normalize), a new DataLoader per epoch.
- ours: `ImageFolder` + `EpochLoader` as the trainer uses them: libjpeg-turbo decodes
  (simplejpeg), the crop is resized by torch's uint8 antialiased kernel, batches stay uint8
  (normalised on the device), and the workers persist from epoch to epoch.
- ours + host normalise: ours with `Normalize` run in the training process, as on a CPU
  worker; on a GPU it runs on the device.
- ours, prepared: ours on the same images after `torchspot data prepare` (shards of JPEGs at a
  288-pixel shorter side, unpacked as a node's copy does).

Each run is a child process; its CPU time includes its loader workers' (RUSAGE_CHILDREN after
they are joined). Images per CPU-second is the per-core figure; the cores an 8-GPU node needs
are what it takes at that figure to feed 3,000 images/s per GPU (arithmetic from the measured
rate, not a GPU measurement); bytes per sample is what crosses the workers' shared memory and,
on a GPU, the host-to-device copy.

And `--decode gpu`'s hand-over: the loader's workers read the files and draw the crops, and the
training process receives each batch of 256 undecoded files, `per file` (each its own tensor, as
before) or `packed` (`Packed`: one tensor); the figure is the training process's own CPU time per
batch (the decode itself needs a GPU and is left out).

And a restart's file index: a folder of `--index-files` empty images in 1,000 classes opened as a
training process does, `list of paths` (its own scan into a list of (Path, label), as before)
against `node index` (the node's saved index, memory-mapped): seconds, and the memory the process
then holds alone (USS).

Usage: python bench/input/run.py [--images 256] [--epochs 3] [--workers 2] [--reps 3] [--index-files 100000]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import record
from torchspot_trainer.data.datasets import IMAGENET_MEAN, IMAGENET_STD, ImageFolder
from torchspot_trainer.data.fetch import fetch_prefix
from torchspot_trainer.data.imaging import resized_crop_box
from torchspot_trainer.data.loader import Collate, EpochLoader, EpochView
from torchspot_trainer.data.prepare import prepare

SIZE = 224
BATCH = 32
WIDTH, HEIGHT = 500, 375
PIPELINES = ("stock", "ours", "ours + host normalise", "ours, prepared")
PREPARED_SHORT_SIDE = 288
"""`torchspot data prepare`'s default shorter side, for the `ours, prepared` pipeline."""
GPU_IMAGES_PER_S = 3000
"""What one H100 trains of ResNet-50 in bf16, roughly (the trainer review's figure; not measured
here): the rate a node's loaders must keep up with, per GPU."""
NODE_GPUS = 8
"""GPUs per node of the sizing column: an ND H100 v5 (96 vCPUs)."""


def write_photos(root: Path, count: int, classes: int = 4, seed: int = 0) -> float:
    """`count` photo-like JPEGs in `classes` folders; returns the mean file size in KiB."""
    from PIL import Image  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    sizes = []
    for index in range(count):
        folder = root / f"n{index % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        field = rng.random((HEIGHT // 16 + 2, WIDTH // 16 + 2, 3)) * 255
        smooth = np.asarray(Image.fromarray(field.astype(np.uint8)).resize((WIDTH, HEIGHT), Image.Resampling.BICUBIC))
        texture = rng.random((HEIGHT // 2 + 1, WIDTH // 2 + 1)) * 255
        detail = np.asarray(
            Image.fromarray(texture.astype(np.uint8)).resize((WIDTH, HEIGHT), Image.Resampling.BILINEAR)
        )
        pixels = smooth * 0.5 + detail[..., None] * 0.45 + rng.normal(0, 8, smooth.shape)
        path = folder / f"img{index:05d}.JPEG"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
        sizes.append(path.stat().st_size)
    return float(np.mean(sizes)) / 1024


class StockFolder(ImageFolder):
    """The pipeline before this change (and torchvision's recipe): Pillow decode and resize,
    float32 normalised in the loader worker."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image  # noqa: PLC0415

        path, label = self.index.sample(index)
        random = self.generator(index)
        with Image.open(path) as img:
            rgb = img.convert("RGB")
            box = resized_crop_box(rgb.width, rgb.height, random)
            rgb = rgb.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
            flip = bool(torch.rand((), generator=random) < 0.5)
            array = np.asarray(rgb, dtype=np.uint8)
        image = torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255.0
        if flip:
            image = image.flip(-1)
        mean = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(-1, 1, 1)
        return (image - mean) / std, label


def _stack(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def _stock_epochs(dataset: StockFolder, batches: list[list[int]], epochs: int, workers: int) -> Iterator[Any]:
    for epoch in range(epochs):
        dataset.set_epoch(epoch, seed=0)  # before the epoch's loader forks its workers
        loader: DataLoader[Any] = DataLoader(dataset, batch_sampler=batches, num_workers=workers, collate_fn=_stack)
        yield from loader


HANDOVERS = ("per file", "packed")
HANDOVER_BATCH = 256
"""The batch of the --decode gpu hand-over figure (the trainer review's: 256 images per GPU pass)."""


def _per_file(items: list[tuple[Any, int]]) -> tuple[list[Any], torch.Tensor]:
    """--decode gpu's collate before `Packed`: each sample's file its own tensor."""
    return [x for x, _ in items], torch.tensor([y for _, y in items])


def handover(how: str, root: Path, epochs: int, workers: int) -> dict[str, Any]:
    """`--decode gpu`'s loader without the decode: the training process's own CPU time to receive
    each batch of undecoded files from the workers, `per file` (as before) or `packed`."""
    torch.set_num_threads(1)
    folder = ImageFolder(root, SIZE, augment=True)
    folder.set_epoch(0, seed=0)
    keys = [(0, i) for i in range(len(folder))]
    batches = [keys[i : i + HANDOVER_BATCH] for i in range(0, len(keys), HANDOVER_BATCH)]
    collate = Collate(torch.Size((3, SIZE, SIZE))) if how == "packed" else _per_file
    loader: DataLoader[Any] = DataLoader(EpochView(folder, encode=True), batch_sampler=batches * epochs,
                                         num_workers=workers, collate_fn=collate, persistent_workers=True)  # fmt: skip
    received = 0
    own = 0.0
    iterator = iter(loader)
    while True:
        before = resource.getrusage(resource.RUSAGE_SELF)
        try:
            _, labels = next(iterator)
        except StopIteration:
            break
        after = resource.getrusage(resource.RUSAGE_SELF)
        own += after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        received += 1
        del labels
    return {"batches": received, "own_cpu_s": own}


INDEXES = ("list of paths", "node index")


def write_empty_folder(root: Path, files: int, classes: int = 1000) -> None:
    """`files` empty .JPEG files in `classes` folders: what a folder index lists (it never reads them)."""
    for index in range(files):
        folder = root / f"n{index % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{index:08d}.JPEG").touch()


def _list_of_paths(root: Path) -> list[tuple[Path, int]]:
    """ImageFolder's index before the node index: a list of (Path, label) built in every process."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [
        (path, label)
        for label, name in enumerate(classes)
        for path in sorted((root / name).iterdir())
        if path.suffix.lower() in (".jpeg", ".jpg", ".png")
    ]


def index(how: str, root: Path, cache: Path) -> dict[str, Any]:
    """Open `root` as a training process does after a restart: `list of paths` (its own scan into a
    list of (Path, label), as before) or `node index` (map the node's saved index); the seconds it
    takes and the memory this process then holds alone (USS), with every sample looked up once."""
    import psutil  # noqa: PLC0415

    before = psutil.Process().memory_full_info().uss
    started = time.perf_counter()
    if how == "node index":
        folder = ImageFolder(root, SIZE, augment=True, index_dir=cache)
        seconds = time.perf_counter() - started
        looked_up = [folder.index.sample(i)[1] for i in range(len(folder))]  # a loader touches each once an epoch
    else:
        samples = _list_of_paths(root)
        seconds = time.perf_counter() - started
        looked_up = [label for _, label in samples]
    held = psutil.Process().memory_full_info().uss - before
    return {"seconds": seconds, "uss_mib": held / 2**20, "files": len(looked_up)}


def child(pipeline: str, root: Path, epochs: int, workers: int) -> dict[str, Any]:
    """Load `epochs` epochs of `root` through `pipeline`; CPU seconds include the workers'."""
    torch.set_num_threads(1)
    length = sum(1 for _ in root.rglob("*.JPEG"))
    batches = [list(range(i, min(i + BATCH, length))) for i in range(0, length, BATCH)]
    started_cpu = _cpu_seconds()
    started = time.perf_counter()
    images = 0
    bytes_per_sample = 0.0
    if pipeline == "stock":
        dataset: Dataset[Any] = StockFolder(root, SIZE, augment=True)
        for inputs, labels in _stock_epochs(dataset, batches, epochs, workers):  # type: ignore[arg-type]
            images += len(labels)
            bytes_per_sample = inputs.nbytes / len(labels)
    else:
        folder = ImageFolder(root, SIZE, augment=True)
        folder.set_epoch(0, seed=0)
        loader = EpochLoader(folder, workers=workers, pin_memory=False, worker_init=lambda _: None)
        for epoch in range(epochs):
            for inputs, labels in loader.epoch(epoch, batches):
                if pipeline == "ours + host normalise":
                    folder.normalize(inputs)
                images += len(labels)
                bytes_per_sample = inputs.nbytes / len(labels)
        loader.close()
    wall = time.perf_counter() - started
    cpu = _cpu_seconds() - started_cpu
    return {"pipeline": pipeline, "images": images, "wall_s": wall, "cpu_s": cpu, "bytes_per_sample": bytes_per_sample}


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # loader workers, once joined
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def index_figure(files: int, reps: int) -> dict[str, Any]:
    """A restart's file index, scanned per process against mapped from the node's saved one."""
    with tempfile.TemporaryDirectory(prefix="torchspot-index-") as tmp:
        root, cache = Path(tmp) / "train", Path(tmp) / "cache"
        print(f"\nwriting {files:,} empty files in 1,000 class folders for the index figure ...", flush=True)
        write_empty_folder(root, files)
        started = time.perf_counter()
        ImageFolder(root, SIZE, index_dir=cache)  # the node's first rank: scan and save
        first = time.perf_counter() - started
        runs: dict[str, list[dict[str, Any]]] = {how: [] for how in INDEXES}
        for _ in range(reps):
            for how in INDEXES:
                command = [sys.executable, __file__, "--index", how, "--root", str(root), "--cache", str(cache)]
                runs[how].append(json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout))
    rows = {how: {key: statistics.median(r[key] for r in results) for key in ("seconds", "uss_mib")}
            for how, results in runs.items()}  # fmt: skip
    scan, mapped = rows["list of paths"], rows["node index"]
    faster = scan["seconds"] / mapped["seconds"]
    print(f"file index of {files:,} images at a restart, per training process: a list of paths (before) "
          f"{scan['seconds']:.2f} s and "
          f"{scan['uss_mib']:.0f} MiB held alone; node index {mapped['seconds']:.3f} s and "
          f"{mapped['uss_mib']:.0f} MiB ({faster:.0f}x faster); the node's first scan and save "
          f"{first:.2f} s")  # fmt: skip
    return {"files": files, "first_scan_and_save_s": first, "per_process": rows, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", choices=PIPELINES, help=argparse.SUPPRESS)
    parser.add_argument("--handover", choices=HANDOVERS, help=argparse.SUPPRESS)
    parser.add_argument("--index-files", type=int, default=100_000, help="files of the index figure (0: skip it)")
    parser.add_argument("--index", choices=INDEXES, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/input/...)")
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.index:
        print(json.dumps(index(args.index, args.root, args.cache)))
        return
    if args.child:
        print(json.dumps(child(args.child, args.root, args.epochs, args.workers)))
        return
    if args.handover:
        print(json.dumps(handover(args.handover, args.root, args.epochs, args.workers)))
        return
    recording = record.Run("input", args.out)
    with tempfile.TemporaryDirectory(prefix="torchspot-input-") as tmp:
        root = Path(tmp) / "source" / "train"
        print(f"writing {args.images} JPEGs of {WIDTH} x {HEIGHT} ...", flush=True)
        kib = write_photos(root, args.images)
        write_photos(root.parent / "val", 4, seed=1)  # prepare wants both splits
        prepare(root.parent, str(Path(tmp) / "prepared"), short_side=PREPARED_SHORT_SIDE, workers=args.workers,
                say=lambda _: None)  # fmt: skip
        prepared = fetch_prefix(str(Path(tmp) / "prepared"), Path(tmp) / "cache") / "train"
        prepared_kib = statistics.mean(p.stat().st_size for p in prepared.rglob("*.JPEG")) / 1024
        roots = {name: prepared if name == "ours, prepared" else root for name in PIPELINES}
        print(f"mean file size {kib:.0f} KiB ({prepared_kib:.0f} KiB prepared at a {PREPARED_SHORT_SIDE}-pixel "
              f"shorter side); {args.epochs} epochs, {args.workers} workers, {args.reps} trials")  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PIPELINES}
        handovers: dict[str, list[dict[str, Any]]] = {how: [] for how in HANDOVERS}
        for trial in range(args.reps):
            for name in PIPELINES:  # interleaved, so drift in the machine hits every pipeline
                command = [sys.executable, __file__, "--child", name, "--root", str(roots[name]),
                           "--epochs", str(args.epochs), "--workers", str(args.workers)]  # fmt: skip
                result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                runs[name].append(result)
                print(f"  trial {trial + 1} {name}: {result['images'] / result['cpu_s']:.0f} images per CPU-s, "
                      f"{result['images'] / result['wall_s']:.0f} images/s", flush=True)  # fmt: skip
            for how in HANDOVERS:
                command = [sys.executable, __file__, "--handover", how, "--root", str(root),
                           "--epochs", str(args.epochs), "--workers", str(args.workers)]  # fmt: skip
                result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                handovers[how].append(result)
                print(f"  trial {trial + 1} --decode gpu hand-over, {how}: "
                      f"{1000 * result['own_cpu_s'] / result['batches']:.1f} ms per batch", flush=True)  # fmt: skip
    with recording.captured():
        summary: dict[str, Any] = {}
        for name, results in runs.items():
            summary[name] = {
                "images_per_cpu_s": statistics.median(r["images"] / r["cpu_s"] for r in results),
                "images_per_s": statistics.median(r["images"] / r["wall_s"] for r in results),
                "bytes_per_sample": results[0]["bytes_per_sample"],
            }
        stock = summary["stock"]
        need = GPU_IMAGES_PER_S * NODE_GPUS
        print(f"\n| pipeline | images per CPU-second | images/s ({args.workers} workers) "
              f"| cores an {NODE_GPUS}-GPU node needs at {GPU_IMAGES_PER_S:,} images/s per GPU "
              "| bytes per sample |")  # fmt: skip
        print("| --- | --- | --- | --- | --- |")
        for name, row in summary.items():
            per_core = row["images_per_cpu_s"] / stock["images_per_cpu_s"]
            wall = row["images_per_s"] / stock["images_per_s"]
            fewer = stock["bytes_per_sample"] / row["bytes_per_sample"]
            row["node_cores"] = need / row["images_per_cpu_s"]
            print(f"| {name} | {row['images_per_cpu_s']:.0f} ({per_core:.2f}x) "
                  f"| {row['images_per_s']:.0f} ({wall:.2f}x) | {row['node_cores']:.0f} "
                  f"| {row['bytes_per_sample']:,.0f} ({fewer:.1f}x fewer) |")  # fmt: skip
        per_batch = {how: statistics.median(1000 * r["own_cpu_s"] / r["batches"] for r in results)
                     for how, results in handovers.items()}  # fmt: skip
        print(f"\n--decode gpu, the training process's CPU time to receive a batch of {HANDOVER_BATCH} files from "
              f"{args.workers} workers: per file {per_batch['per file']:.1f} ms, packed {per_batch['packed']:.1f} ms "
              f"({per_batch['per file'] / per_batch['packed']:.1f}x less)")  # fmt: skip
        summary["handover_ms_per_batch"] = per_batch
        if args.index_files:
            summary["index"] = index_figure(args.index_files, args.reps)
    trials = [{"pipeline": name, **result} for name, results in runs.items() for result in results]
    summary["mean_file_kib"], summary["prepared_mean_file_kib"] = kib, prepared_kib
    recording.write(trials, figures=summary)


if __name__ == "__main__":
    main()
