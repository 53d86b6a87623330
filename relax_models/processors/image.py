"""Images: load with Pillow, resize to a patch-aligned size within a pixel budget, count LLM tokens."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from relax_models.errors import RelaxUserError

MAX_ASPECT_RATIO = 200.0


def load_image(item: Any) -> Image.Image:
    """An RGB ``PIL.Image`` from a PIL image, a path, raw bytes, an HWC uint8 array or a datasets-style dict
    (``{"bytes": ...}`` or ``{"path": ...}``)."""
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if isinstance(item, Image.Image):
        image = item
    elif isinstance(item, (bytes, bytearray)):
        image = Image.open(io.BytesIO(item))
    elif isinstance(item, (str, Path)):
        if not Path(item).is_file():
            raise RelaxUserError(f"image file {str(item)!r} does not exist")
        image = Image.open(item)
    elif isinstance(item, np.ndarray):
        image = Image.fromarray(item)
    else:
        raise RelaxUserError(f"cannot read an image from a {type(item).__name__}")
    return image.convert("RGB")


def fit_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) nearest in shape to the input with both sides multiples of ``factor`` and
    ``min_pixels <= height * width <= max_pixels`` (as far as a multiple of ``factor`` allows).

    ``factor`` is ``patch_size * merge_size``: one LLM token per ``factor x factor`` block of pixels.
    """
    if min(height, width) < 1:
        raise RelaxUserError(f"image of size {height}x{width} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RelaxUserError(
            f"image of size {height}x{width} is too elongated (aspect ratio above {MAX_ASPECT_RATIO:g})"
        )
    max_pixels = max(max_pixels, factor * factor)
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    if h * w > max_pixels:  # a thin side was held at one block: shorten the long side instead
        if h <= w:
            w = max(factor, max_pixels // (h * factor) * factor)
        else:
            h = max(factor, max_pixels // (w * factor) * factor)
    return h, w


def image_token_count(height: int, width: int, factor: int) -> int:
    """LLM placeholder tokens for an image already resized to a multiple of ``factor``."""
    return (height // factor) * (width // factor)


def resize_image(image: Image.Image, factor: int, min_pixels: int, max_pixels: int) -> Image.Image:
    """``image`` resized (bicubic) to :func:`fit_size`; unchanged if already that size."""
    h, w = fit_size(image.height, image.width, factor, min_pixels, max_pixels)
    if (h, w) == (image.height, image.width):
        return image
    return image.resize((w, h), Image.Resampling.BICUBIC)
