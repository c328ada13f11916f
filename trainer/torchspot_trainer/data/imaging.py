"""Image geometry and decoding for ImageNet-style data: the crop boxes of the standard recipe, and
JPEG decoding that cuts the crop before it resizes.

JPEGs are decoded by libjpeg-turbo through simplejpeg (Pillow for PNG, CMYK and anything else),
at 1/2, 1/4 or 1/8 scale in the DCT domain where the crop is at least twice the input size
(`decode_reduction`); the crop box is cut first, then resized by torch's uint8 antialiased
bilinear kernel. Boxes are (left, top, right, bottom) in the original image's pixels.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

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
