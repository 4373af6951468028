"""Image files read as data: their bytes through :func:`mlcls.io.read_regular_bytes`, decoded from memory.

A file named by someone else's list may be a FIFO or a device (the reader would block) or declare billions
of pixels in a few kilobytes. So only a regular file of at most ``CAPS["image"]`` bytes is read, and an image
of more than ``Image.MAX_IMAGE_PIXELS`` pixels (89,478,485: ~268 MB as RGB) is refused from its header
(:func:`check_pixels`), both with one of :data:`mlcls.data.datasets.base.BAD_IMAGE_ERRORS` for
``dataset.on_bad_image``.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from PIL import Image

from mlcls.io import CAPS, read_regular_bytes

# PIL warns (and lets the decode go on) for an image of 1 to 2 times MAX_IMAGE_PIXELS; check_pixels refuses
# every such image itself, so the warning would only repeat the refusal.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def read_image_bytes(path: str | Path) -> bytes:
    """The bytes of ``path``, a regular file of at most ``CAPS["image"]`` bytes (else an ``OSError`` or a
    ``ValueError``, at once)."""
    return read_regular_bytes(path, CAPS["image"], "image")


def check_pixels(width: int, height: int) -> None:
    """Raise ``Image.DecompressionBombError`` when a ``width`` x ``height`` image has more pixels than
    ``Image.MAX_IMAGE_PIXELS`` (no limit when that is None)."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise Image.DecompressionBombError(
            f"image of {width} x {height} = {width * height} pixels; at most {limit} expected "
            "(PIL.Image.MAX_IMAGE_PIXELS)"
        )


def open_image(data: bytes) -> Image.Image:
    """The image of the encoded bytes ``data``, its header read and checked (:func:`check_pixels`)."""
    image = Image.open(io.BytesIO(data))
    try:
        check_pixels(*image.size)
    except BaseException:
        image.close()
        raise
    return image


def read_image(path: str | Path) -> Image.Image:
    """:func:`open_image` of :func:`read_image_bytes` of ``path``."""
    return open_image(read_image_bytes(path))


# The most pixels one byte of a JPEG's scan can stand for: a Huffman-coded 8 x 8 block takes at least
# 2 bits (a 1-bit DC difference code and a 1-bit end-of-block code), so one greyscale component covers
# 64 pixels per 2 bits, 256 per byte; colour (three components, or subsampled chroma) covers fewer.
PIXELS_PER_BYTE = 256


def check_encoded_size(width: int, height: int, nbytes: int) -> None:
    """Raise ``Image.DecompressionBombError`` (one of the bad-image errors) when a ``width`` x ``height``
    header claims more pixels than ``nbytes`` of Huffman-coded scan can encode (:data:`PIXELS_PER_BYTE`
    per byte, plus 2**20 pixels of slack for small images): the decode would be bounded by the header, not
    by the bytes read."""
    if width * height > PIXELS_PER_BYTE * nbytes + 2**20:
        raise Image.DecompressionBombError(
            f"image header claims {width} x {height} pixels in {nbytes} bytes; at most "
            f"{PIXELS_PER_BYTE} pixels per byte (plus 2**20) expected of a JPEG"
        )
