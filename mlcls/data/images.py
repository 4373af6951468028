"""Image files read as data: their bytes through :func:`mlcls.io.read_regular_bytes`, decoded from memory.

A file named by someone else's list may be a FIFO or a device (the reader would block) or declare billions
of pixels in a few kilobytes. So only a regular file of at most ``CAPS["image"]`` bytes is read, and an image
of more than ``Image.MAX_IMAGE_PIXELS`` pixels (89,478,485: ~268 MB as RGB) is refused from its header
(:func:`check_pixels`), all with one of :data:`mlcls.data.datasets.base.BAD_IMAGE_ERRORS` for
``dataset.on_bad_image``. A JPEG is also refused before PIL parses it when its header holds more fill bytes
or markers than an encoder writes (:func:`check_jpeg_header`), and from its header when it claims more
pixels than its bytes can encode (:func:`check_encoded_size`): what a JPEG makes a reader hold is bounded by
its size. That bound, :data:`PIXELS_PER_BYTE`: a sequential Huffman-coded JPEG spends at least 2 bits on every
8 x 8 block of every component, so greyscale holds at most 256 pixels a byte (met only by a flat image, the
header's bytes keeping a real file under it), 4:2:0 colour 170.7 (6 blocks per 16 x 16 pixels), 4:4:4 85.3;
a progressive file can code a greyscale block in 1 bit and arithmetic coding has no per-block floor, so such
flat files beyond 256 pixels a byte and 2**20 pixels are refused, which no photograph is. Decoded as RGB
(3 bytes a pixel) a JPEG then holds at most 768 times its bytes plus 3 MiB (PIL's RGB image, 4 bytes a
pixel: 1,024 times plus 4 MiB). Other formats (PNG, GIF, ...) code a flat image in far fewer bytes, so they
keep PIL's cap alone.

Then what is kept of an image: a sample's crop ``box`` ``(x, y, w, h)`` clamped to it (:func:`crop_box`, the
one crop every pipeline makes, refusing a region too thin to resize: :func:`check_aspect_ratio`), and its
pixels as 8-bit RGB (:func:`to_rgb`, :func:`rgb_picture`).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, JpegImagePlugin

from mlcls.io import CAPS, read_regular_bytes

# PIL warns (and lets the decode go on) for an image of 1 to 2 times MAX_IMAGE_PIXELS; check_pixels refuses
# every such image itself, so the warning would only repeat the refusal.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

# Files a folder search picks up (case-insensitive): mlcls-predict's folders, a caption folder's images.
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm"}
)
JPEG_START = b"\xff\xd8\xff"  # SOI and a marker's first byte: what PIL takes for a JPEG
# Before its first scan a JPEG holds a few dozen markers (up to 255 more for a chunked ICC profile) and few or
# no bytes outside segments; PIL's parser takes each such byte in a Python loop (~0.6 s per MB).
MAX_HEADER_MARKERS = 1024
MAX_SKIPPED_BYTES = 1024
# The longest an image's long side may be, in multiples of its short side. This bounds what the evaluation
# resize of the shorter side to s pixels makes, s x 100 s pixels (256 x 25,600 RGB, 20 MB, at image_size
# 224), where a 138-byte 1 x 30,000 PNG would become 256 x 7.68 M (5.9 GB). Photos, panoramas and banners
# stay far below it.
MAX_ASPECT_RATIO = 100
Box = tuple[float, float, float, float]  # a sample's crop box: (x, y, w, h) in pixels


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


def jpeg_markers(data: bytes, strict: bool = False) -> Iterator[tuple[int, int, int]]:
    """``(marker, position, length)`` of each marker of the JPEG ``data`` after its start, to its first scan
    (0xDA) or its end (0xD9), both yielded, or to a segment cut short: ``length`` the segment's stated length
    (0 for a marker without one). Bytes outside segments are skipped: fill bytes (0xFF, which the standard
    allows in any number) and, unless ``strict``, stray bytes. The walk looks at most at
    :data:`MAX_SKIPPED_BYTES` such bytes and :data:`MAX_HEADER_MARKERS` markers; past either, or at a stray
    byte when ``strict``, an ``OSError``."""
    position, skipped, markers = 2, 0, 0
    while position + 1 < len(data):
        marker = data[position + 1]
        if data[position] != 0xFF or marker in (0x00, 0xFF):  # a stray byte, an escaped 0xFF or a fill byte
            if strict and (data[position] != 0xFF or marker == 0x00):
                raise OSError(f"JPEG header with a stray byte at {position}")
            position, skipped = position + 1, skipped + 1
            if skipped > MAX_SKIPPED_BYTES:
                raise OSError(
                    f"JPEG header with more than {MAX_SKIPPED_BYTES} fill or stray bytes before its first "
                    "scan; encoders write a few at most"
                )
            continue
        markers += 1
        if markers > MAX_HEADER_MARKERS:
            raise OSError(f"JPEG header of more than {MAX_HEADER_MARKERS} markers before its first scan")
        if 0xD0 <= marker <= 0xD8 or marker == 0x01:  # markers without a length
            yield marker, position, 0
            position += 2
            continue
        if marker != 0xD9 and position + 3 >= len(data):
            return
        length = 0 if marker == 0xD9 else (data[position + 2] << 8) | data[position + 3]
        yield marker, position, length
        if marker in (0xDA, 0xD9):  # the first scan (where PIL's parser stops) or the end of the image
            return
        position += 2 + length


def check_jpeg_header(data: bytes) -> None:
    """Raise an ``OSError`` when the segments of the JPEG ``data`` before its first scan hold more than
    :data:`MAX_SKIPPED_BYTES` bytes outside segments (fill bytes 0xFF, stray bytes) or more than
    :data:`MAX_HEADER_MARKERS` markers (:func:`jpeg_markers`). PIL's header parser reads fill bytes one at a
    time, so 1 MB of them held a reader for 0.6 s (a 256 MB image for minutes). A header cut short is left to
    PIL, which refuses it."""
    for _ in jpeg_markers(data):
        pass


def open_image(data: bytes) -> Image.Image:
    """The image of the encoded bytes ``data``, its header read and checked: a JPEG's segments before PIL
    parses them (:func:`check_jpeg_header`), its size against its bytes (:func:`check_encoded_size`); the
    pixels of any image (:func:`check_pixels`), PIL's decompression-bomb cap for the formats (PNG, GIF, ...)
    that code a flat image in far fewer bytes than a JPEG can."""
    if data[:3] == JPEG_START:
        check_jpeg_header(data)
    image = Image.open(io.BytesIO(data))
    try:
        check_pixels(*image.size)
        if isinstance(image, JpegImagePlugin.JpegImageFile):  # MPO, a camera's multi-picture JPEG, too
            check_encoded_size(*image.size, len(data))
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


# ---- Crop geometry and colour: what every pipeline keeps of a sample's image.


def check_aspect_ratio(width: int, height: int) -> None:
    """Raise ``ValueError`` (one of the bad-image errors the datasets' ``on_bad_image`` handles) when one
    side of a ``width`` x ``height`` image exceeds :data:`MAX_ASPECT_RATIO` times the other."""
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ValueError(
            f"an image of {width} x {height} pixels: one side is over {MAX_ASPECT_RATIO} times the other "
            "(too thin to resize)"
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB. Greyscale of more than 8 bits (modes ``I;16*`` and ``I``) is scaled, ``v >> 8``
    for 16-bit values, where PIL's own conversion clips every value above 255 to white. Mode ``I`` (16-bit
    values in most files) is taken as 8-bit when no value exceeds 255, as 16-bit up to 65535, else as 31-bit
    (``v >> 23``); negative values become 0."""
    if image.mode.startswith("I;16"):
        values = np.asarray(image).astype(np.uint16) >> 8
    elif image.mode == "I":
        values = np.clip(np.asarray(image), 0, None)
        top = int(values.max(initial=0))
        values = values >> (0 if top <= 255 else 8 if top <= 65535 else 23)
    else:
        return image.convert("RGB")  # a loaded copy, also of an RGB image
    return Image.fromarray(values.astype(np.uint8)).convert("RGB")


def rgb_picture(data: bytes, box: Box | None) -> Image.Image:
    """The RGB image of the encoded ``data``, cropped to ``box`` ``(x, y, w, h)`` (clamped); refused with a
    ``ValueError`` from its header, before decoding, when too thin (:func:`check_aspect_ratio`)."""
    with open_image(data) as img:
        region = crop_box(box, *img.size)
        rgb = to_rgb(img)
    return rgb if box is None else rgb.crop(region)


def crop_box(box: Box | None, width: int, height: int) -> tuple[int, int, int, int]:
    """Pixel crop ``(left, top, right, bottom)`` of box ``(x, y, w, h)`` clamped to a ``width`` x ``height``
    image; the whole image when ``box`` is None or the clamped box is empty. A region too thin to resize is
    refused with a ``ValueError``, a bad image (:func:`check_aspect_ratio`): every pipeline crops here."""
    x, y, w, h = (0, 0, width, height) if box is None else box
    left, top = max(0, int(x)), max(0, int(y))
    right, bottom = min(width, int(round(x + w))), min(height, int(round(y + h)))
    if not (right > left and bottom > top):
        left, top, right, bottom = 0, 0, width, height
    check_aspect_ratio(right - left, bottom - top)
    return left, top, right, bottom


def nonempty_boxes(boxes: np.ndarray) -> np.ndarray:
    """bool (N,): the ``(x, y, w, h)`` boxes (N, 4) with a positive width and height (something to crop)."""
    return (boxes[:, 2] > 0) & (boxes[:, 3] > 0)
