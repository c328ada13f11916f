"""`torchspot data prepare` and the node's copy of a prepared data set: real Blob API calls against
Azurite, real JPEGs, the trainer's own ImageFolder reading the result."""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from torchspot.cli import main
from torchspot_lab.azurite import Azurite
from torchspot_trainer.checkpoint.storage import open_storage
from torchspot_trainer.data.datasets import ImageFolder
from torchspot_trainer.data.fetch import fetch_prefix
from torchspot_trainer.data.prepare import MANIFEST, target_size, unpack


def _source(root: Path) -> None:
    """train/ and val/ with two classes: large JPEGs, one small enough already, and a PNG."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 5), ("val", 2)):
        for label in ("n01", "n02"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = (rng.random((90, 120, 3)) * 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"img{i}.JPEG", quality=92)
    Image.fromarray((rng.random((40, 50, 3)) * 255).astype(np.uint8)).save(root / "train" / "n01" / "small.JPEG")
    Image.fromarray((rng.random((80, 100, 3)) * 255).astype(np.uint8)).save(root / "train" / "n02" / "z.png")


def test_a_prepared_data_set_is_shards_that_a_node_unpacks_into_the_trainers_layout(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "imagenet"
    _source(source)
    for key, value in azurite.env().items():
        monkeypatch.setenv(key, value)
    dest = f"az://datasets/{uuid.uuid4().hex}"
    argv = ["data", "prepare", str(source), dest, "--short-side", "48", "--shard-images", "4", "--workers", "2"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "train 12 images in 3 shards, val 4 images in 1 shards" in said, said
    names = sorted(open_storage(dest).list())
    assert names == [
        "torchspot-data.json", "train/shard-000000.tar", "train/shard-000001.tar", "train/shard-000002.tar",
        "val/shard-000000.tar",
    ]  # fmt: skip
    assert json.loads(open_storage(dest).get(MANIFEST))["short_side"] == 48

    cache = fetch_prefix(dest, tmp_path / "cache")
    original, prepared = ImageFolder(source / "train", 32), ImageFolder(cache / "train", 32)
    assert prepared.classes == original.classes
    assert len(prepared) == len(original) == 12
    # The same samples in the same order (the exact-once sampler's indices mean the same images),
    # each a JPEG whose shorter side is 48, or smaller where it already was.
    for i in range(len(original)):
        (before, label), (after, same_label) = original.index.sample(i), prepared.index.sample(i)
        assert (after.parent.name, after.stem, same_label) == (before.parent.name, before.stem, label)
        height, width = simplejpeg.decode_jpeg_header(after.read_bytes())[:2]
        with Image.open(before) as img:
            assert (width, height) == target_size(img.width, img.height, 48)
    assert (cache / "train" / "n01" / "small.JPEG").read_bytes() == (
        source / "train" / "n01" / "small.JPEG"
    ).read_bytes()
    assert prepared[0][0].shape == (3, 32, 32)
    assert len(ImageFolder(cache / "val", 32)) == 4
    assert fetch_prefix(dest, tmp_path / "cache") == cache  # once per node


def test_prepare_refuses_what_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "prepare", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "expected train/ and val/ folders" in capsys.readouterr().err
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    assert main(["data", "prepare", str(tmp_path), str(tmp_path / "out"), "--short-side", "8"]) == 2
    assert "--short-side 8: must be at least 32" in capsys.readouterr().err
    assert target_size(500, 375, 288) == (384, 288)
    assert target_size(200, 150, 288) == (200, 150)  # never enlarged


def test_a_shard_that_reaches_outside_its_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("n01/fine.JPEG", "../../escaped.JPEG"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    into = tmp_path / "cache" / "train"
    with pytest.raises(tarfile.OutsideDestinationError):
        unpack(buffer.getvalue(), into)
    assert not (tmp_path / "escaped.JPEG").exists()
    assert not (into / "n01" / "fine.JPEG").exists()  # checked whole before any member is written
