"""Image files read as data: their bytes through the guarded door (:func:`mlcls.io.read_regular_bytes`), then
decoded from memory, never from a path PIL opens itself.

An image is named by a CSV, an annotation file or a folder of someone else's. A pipe or a device there
(a FIFO, ``/dev/zero``) would block the reader or never end, and a file of a few kilobytes can declare
billions of pixels (a "decompression bomb"). So :func:`read_image_bytes` takes only a regular file of at
most ``CAPS["image"]`` bytes, and :func:`check_pixels` refuses an image of more than PIL's
``Image.MAX_IMAGE_PIXELS`` pixels (89,478,485 unless changed: about 268 MB decoded as RGB) from its header,
before its pixels are decoded. Both raise what :data:`mlcls.data.datasets.base.BAD_IMAGE_ERRORS` holds, so
``dataset.on_bad_image`` decides: one line naming the file (``error``) or a skipped, counted sample
(``skip``).
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
    """The bytes of the image file ``path``: a regular file of at most ``CAPS["image"]`` bytes, else
    ``NotRegularFileError`` (an ``OSError``) or ``FileTooLargeError`` (a ``ValueError``), at once."""
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
    """The image of the encoded bytes ``data``, opened lazily (its header read, no pixel decoded yet) and
    checked by :func:`check_pixels`."""
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
