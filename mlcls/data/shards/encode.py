"""The images of a pack (``mlcls-data pack``): each sample's JPEG bytes, its long side at most ``max_side``,
kept byte for byte where the source already is such a JPEG, else decoded at reduced scale, resized and
re-encoded with libjpeg-turbo at a chosen chroma subsampling."""

from __future__ import annotations

import numpy as np
import simplejpeg
from PIL import Image, JpegImagePlugin

from mlcls.data.datasets.base import MultiLabelDataset, crop_box
from mlcls.data.images import check_pixels, open_image, read_image_bytes
from mlcls.data.pipeline.fast import DRAFT_REDUCTIONS, jpeg_header, load_reduced

# JPEG chroma subsampling of re-encoded images: 444 keeps the colour at full resolution, 422 halves it
# horizontally, 420 (PIL's and most cameras' default) in both directions; auto keeps a JPEG source's own
# (4:2:0 photographs stay 4:2:0, at their decoding speed) and takes 444 for any other source (PNG, pixels a
# dataset generates), so that packing never halves the colour resolution an image had.
SUBSAMPLINGS = ("auto", "444", "422", "420")
# PIL's JpegImagePlugin.get_sampling codes; -1 (4:4:0, 4:1:1, ...) maps to 444, keeping every colour sample.
PIL_SAMPLING = {0: "444", 1: "422", 2: "420"}


def bounded_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """``(width, height)`` scaled so that the long side is at most ``max_side`` (never enlarged)."""
    scale = max_side / max(width, height)
    if scale >= 1:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def encode_jpeg(image: Image.Image, quality: int, subsampling: str = "444") -> bytes:
    """RGB JPEG bytes of ``image`` (libjpeg-turbo) at ``quality`` with chroma ``subsampling`` (444, 422 or
    420; PIL's ``save(..., quality=q, subsampling=0 | 1 | 2)``)."""
    pixels = np.ascontiguousarray(np.asarray(image.convert("RGB")))
    return simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling=subsampling)


def source_subsampling(image: Image.Image, subsampling: str) -> str:
    """The subsampling to re-encode ``image`` with: ``subsampling`` itself, or for ``auto`` the JPEG's own
    (read from its header) and 444 for any other image."""
    if subsampling != "auto":
        return subsampling
    if isinstance(image, JpegImagePlugin.JpegImageFile):
        return PIL_SAMPLING.get(JpegImagePlugin.get_sampling(image), "444")
    return "444"


def packed_image(
    dataset: MultiLabelDataset, index: int, max_side: int, quality: int, subsampling: str = "auto"
) -> bytes:
    """JPEG bytes of sample ``index`` (its crop box applied), long side at most ``max_side``.

    Image files are read directly: a JPEG already within ``max_side`` (no crop) is kept byte for byte (no
    second generation of JPEG loss); a larger one is decoded at the largest DCT reduction that keeps it at
    least ``max_side`` on its long side (PIL's draft mode), then resized (bilinear, antialiased) and encoded
    at ``quality`` and chroma ``subsampling`` (:func:`source_subsampling`), as is any other image.
    Datasets that make their pixels (the synthetic one, ``reads_files`` False) give their ``picture``.
    Raises the bad-image errors of PIL (``OSError``, ...) for unreadable files.
    """
    sample = dataset.samples[index]
    if not dataset.reads_files:  # generated pixels
        image = dataset.picture(index)
        subsampling = source_subsampling(image, subsampling)
    else:
        data = read_image_bytes(sample.path)
        header = jpeg_header(data)
        if header is not None:
            check_pixels(*header)
        if sample.box is None and header is not None and max(header) <= max_side:
            return data
        with open_image(data) as img:
            subsampling = source_subsampling(img, subsampling)
            width, height = img.size
            left, top, right, bottom = (
                (0, 0, width, height) if sample.box is None else crop_box(sample.box, width, height)
            )
            target = bounded_size(right - left, bottom - top, max_side)
            reduction = next(
                (
                    r
                    for r in DRAFT_REDUCTIONS
                    if right - left >= r * target[0] and bottom - top >= r * target[1]
                ),
                1,
            )
            reduced, scale_x, scale_y = load_reduced(img, reduction)
        box = (left / scale_x, top / scale_y, right / scale_x, bottom / scale_y)
        image = reduced.resize(target, Image.Resampling.BILINEAR, box=box)
        return encode_jpeg(image, quality, subsampling)
    target = bounded_size(image.width, image.height, max_side)
    if target != image.size:
        image = image.resize(target, Image.Resampling.BILINEAR)
    return encode_jpeg(image, quality, subsampling)
