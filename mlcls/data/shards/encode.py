"""The images of a pack (``mlcls-data pack``): each sample's JPEG bytes, its long side at most ``max_side``,
kept byte for byte where the source already is such a JPEG, else decoded at reduced scale, resized and
re-encoded with libjpeg-turbo at a chosen chroma subsampling."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import simplejpeg
from PIL import Image, JpegImagePlugin

from mlcls.data.datasets.base import MultiLabelDataset, crop_box
from mlcls.data.images import open_image, read_image_bytes
from mlcls.data.pipeline.fast import draft_reduction, image_header, load_reduced

# JPEG chroma subsampling of re-encoded images: 444 keeps the colour at full resolution, 422 halves it
# horizontally, 420 (PIL's and most cameras' default) in both directions; auto keeps a JPEG source's own
# (4:2:0 photographs stay 4:2:0, at their decoding speed) and takes 444 for any other source (PNG, pixels a
# dataset generates), so that packing never halves the colour resolution an image had.
SUBSAMPLINGS = ("auto", "444", "422", "420")
# PIL's JpegImagePlugin.get_sampling codes; -1 (4:4:0, 4:1:1, ...) maps to 444, keeping every colour sample.
PIL_SAMPLING = {0: "444", 1: "422", 2: "420"}


def encode_jpeg(image: Image.Image, quality: int, subsampling: str = "444") -> bytes:
    """RGB JPEG bytes of ``image`` (libjpeg-turbo) at ``quality`` with chroma ``subsampling`` (444, 422 or
    420; PIL's ``save(..., quality=q, subsampling=0 | 1 | 2)``)."""
    pixels = np.ascontiguousarray(np.asarray(image.convert("RGB")))
    return simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling=subsampling)


def packed_image(
    dataset: MultiLabelDataset, index: int, max_side: int, quality: int, subsampling: str = "auto"
) -> bytes:
    """JPEG bytes of sample ``index`` (its crop box applied), long side at most ``max_side``: a JPEG file
    already within ``max_side`` (no crop) byte for byte (no second generation of JPEG loss); else decoded at
    the largest DCT reduction that keeps its output size (PIL's draft mode), resized (bilinear, antialiased)
    and encoded at ``quality`` and chroma ``subsampling`` (:data:`SUBSAMPLINGS`). A dataset that
    makes its pixels (``reads_files`` False) gives its ``picture``. Raises PIL's bad-image errors."""
    if dataset.reads_files:
        sample = dataset.samples[index]
        data = read_image_bytes(sample.path)
        width, height, jpeg = image_header(data)
        if jpeg and sample.box is None and max(width, height) <= max_side:
            return data
        opened, box = open_image(data), sample.box
    else:
        opened, box = nullcontext(dataset.picture(index)), None
    with opened as img:
        if subsampling == "auto":  # a JPEG's own, read from its header; 444 for any other image
            jpeg = isinstance(img, JpegImagePlugin.JpegImageFile)
            subsampling = PIL_SAMPLING.get(JpegImagePlugin.get_sampling(img), "444") if jpeg else "444"
        left, top, right, bottom = (0, 0, *img.size) if box is None else crop_box(box, *img.size)
        scale = min(1.0, max_side / max(right - left, bottom - top))  # never enlarged
        target = (max(1, round((right - left) * scale)), max(1, round((bottom - top) * scale)))
        reduced, scale_x, scale_y = load_reduced(img, draft_reduction(right - left, bottom - top, *target))
    region = (left / scale_x, top / scale_y, right / scale_x, bottom / scale_y)
    return encode_jpeg(reduced.resize(target, Image.Resampling.BILINEAR, box=region), quality, subsampling)
