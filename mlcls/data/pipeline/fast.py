"""The fast training pipeline (``data.backend=fast``): the ``paper`` augmentation split into a CPU stage
(:class:`FastTrainTransform`: decode, at reduced scale where the crop allows, crop, resize, flip; uint8, with
the colour parameters drawn) and a device stage (:func:`colour_lighting_normalise`, on CUDA under a
:func:`side_stream` of its own, as the GPU pipeline's decoding). Every random number is
drawn in the CPU stage by the plain pipeline's torchvision calls in its order: under one seed both pipelines
pick the same augmentation (docs/performance.md, "The fast input pipeline").
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torch.utils.data import default_collate
from torchvision import transforms as T

from mlcls.data.images import Box, check_encoded_size, check_pixels, crop_box, open_image, to_rgb
from mlcls.data.pipeline.transforms import (
    IMAGENET_MEAN,
    IMAGENET_PCA_EIGVAL,
    IMAGENET_PCA_EIGVEC,
    IMAGENET_STD,
)

# JPEG DCT scaling factors PIL's draft mode offers (libjpeg scale 1/8, 1/4, 1/2), largest first.
DRAFT_REDUCTIONS = (8, 4, 2)
# JPEG colour spaces libjpeg-turbo converts to RGB exactly as PIL does (CMYK and YCCK go to PIL).
JPEG_COLORSPACES = ("YCbCr", "RGB", "Gray")
# ColorJitter operation codes, as in torchvision's ColorJitter.get_params permutation (3 = hue, unused).
BRIGHTNESS, CONTRAST, SATURATION, HUE = 0, 1, 2, 3
# Luma weights of torchvision's rgb_to_grayscale (ITU-R 601-2).
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)
# Layout of the per-sample colour parameters: 3 operation codes in order, 3 factors, 3 lighting alphas.
PARAMS_ORDER, PARAMS_FACTORS, PARAMS_ALPHA = slice(0, 3), slice(3, 6), slice(6, 9)
# Grey levels (of 255, before normalisation) the colour stage's float16 jitter may differ from float32's
# (:func:`colour_lighting_normalise`): measured at most 0.32, mean 0.03, on 240 images of 64 x 64.
HALF_PRECISION_LEVELS = 0.5


class AugmentedImage(NamedTuple):
    """Output of the CPU stage. ``pixels``: uint8 (3, H, W) or (B, 3, H, W), a view of channels-last
    (H, W, 3) memory (what decoders and the resize produce). ``params``: float32 (9,) or (B, 9): ColorJitter
    operation codes in application order (0 brightness, 1 contrast, 2 saturation), the three factors, the 3
    PCA lighting alphas."""

    pixels: Tensor
    params: Tensor

    @staticmethod
    def collate(batch: list[AugmentedImage]) -> AugmentedImage:
        """The batch of ``batch``: the pixels stacked in their channels-last memory (not transposed: ~10x
        faster), each field by ``default_collate`` (in shared memory in a DataLoader worker)."""
        pixels = default_collate([image.pixels.permute(1, 2, 0) for image in batch]).permute(0, 3, 1, 2)
        return AugmentedImage(pixels, default_collate([image.params for image in batch]))


@dataclass(frozen=True)
class PlannedCrop:
    """A decoded image and the random crop chosen for it, ``region = (left, top, right, bottom)`` in the
    image's pixels: whole pixels in a full-size uint8 (3, H, W) tensor (any strides), or fractional ones in
    a PIL image decoded at 1/2, 1/4 or 1/8 scale."""

    image: Tensor | Image.Image
    region: Box


def draft_reduction(crop_width: int, crop_height: int, out_width: int, out_height: int) -> int:
    """The largest JPEG DCT reduction (8, 4, 2, or 1 for none) that keeps the crop at least ``out_width`` x
    ``out_height`` pixels, so that resizing it to that size never enlarges what decoding shrank."""
    for reduction in DRAFT_REDUCTIONS:
        if crop_width >= reduction * out_width and crop_height >= reduction * out_height:
            return reduction
    return 1


def load_reduced(img: Image.Image, reduction: int) -> tuple[Image.Image, float, float]:
    """``(image, scale_x, scale_y)``: the just-opened ``img`` decoded as RGB at 1/``reduction`` scale where
    its format allows it (JPEG), else at full size; full-size coordinates divided by the scales are its."""
    width, height = img.size
    if reduction > 1:
        img.draft("RGB", (width // reduction, height // reduction))
    img.load()
    rgb = img if img.mode == "RGB" else to_rgb(img)
    if rgb.size == (width, height):
        return rgb, 1.0, 1.0
    if rgb.size == (math.ceil(width / reduction), math.ceil(height / reduction)):
        # libjpeg maps each reduction x reduction block of the source to one pixel (the last, partial block
        # rounds the size up): the coordinate map is exactly x / reduction.
        return rgb, float(reduction), float(reduction)
    return rgb, width / rgb.width, height / rgb.height


def image_header(data: bytes) -> tuple[int, int, bool]:
    """``(width, height, jpeg)`` of an image file from its header, checked by ``check_pixels`` and a JPEG's
    by ``check_encoded_size``: ``jpeg`` for a JPEG whose pixels :func:`decode_jpeg` decodes as PIL would
    (YCbCr, RGB or greyscale); PIL reads the header of any other file (a CMYK JPEG, another format) through
    :func:`open_image`, raising its bad-image errors."""
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        colorspace = None
    if colorspace in JPEG_COLORSPACES:
        check_pixels(width, height)
        check_encoded_size(width, height, len(data))
        return width, height, True
    with open_image(data) as img:
        return *img.size, False


def decode_jpeg(data: bytes) -> Tensor | None:
    """RGB uint8 (3, H, W) (a view of H x W x 3 memory) of a JPEG, by libjpeg-turbo through simplejpeg:
    PIL's pixels without PIL's 4-byte-per-pixel image and the copy out of it; None when the file is damaged
    (PIL then decodes it, or raises the usual bad-image ``OSError``)."""
    try:
        pixels = simplejpeg.decode_jpeg(data, "RGB")
    except ValueError:  # simplejpeg's error for a damaged file (strict: libjpeg's warnings too)
        return None
    return torch.from_numpy(pixels).permute(2, 0, 1)


def pil_to_pixels(image: Image.Image) -> Tensor:
    """RGB uint8 (3, H, W) view of a copy of the PIL image's pixels."""
    rgb = image if image.mode == "RGB" else to_rgb(image)
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1)


def resized_crop(image: Tensor | Image.Image, region: Box, size: int) -> Tensor:
    """uint8 (3, size, size), channels-last: ``region`` of ``image`` resized as PIL's ``BILINEAR`` does, by
    torch's uint8 kernel for a tensor (several times faster, fastest on a channels-last copy of the crop),
    by PIL for a PIL image (whose region may be fractional)."""
    if isinstance(image, Image.Image):
        return pil_to_pixels(image.resize((size, size), Image.Resampling.BILINEAR, box=region))
    left, top, right, bottom = (int(v) for v in region)
    crop = image[None, :, top:bottom, left:right].contiguous(memory_format=torch.channels_last)
    return F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


class FastTrainTransform:
    """CPU stage of the fast pipeline, with the paper's ranges (RandomResizedCrop's defaults, ColorJitter
    0.4, lighting std 0.1); output :class:`AugmentedImage`. ``draft``: decode JPEGs at reduced scale when
    the crop allows it."""

    torch_random_only = True  # draws from torch's CPU generator alone (``seeded_call(..., torch_only=True)``)

    def __init__(self, size: int, draft: bool = True) -> None:
        self.size, self.draft = size, draft
        self.scale, self.ratio = [0.08, 1.0], [3.0 / 4.0, 4.0 / 3.0]
        self.jitter, self.lighting_std = T.ColorJitter(0.4, 0.4, 0.4), 0.1

    def crop_window(self, box: Box | None, width: int, height: int) -> tuple[int, int, int, int]:
        """``(left, top, width, height)`` of a RandomResizedCrop of the :func:`crop_box` of ``box`` in a
        ``width`` x ``height`` image, by torchvision's sampler (it reads only the shape of the never allocated
        tensor it is given). The one crop draw of the ``paper`` augmentation, whatever the backend."""
        left, top, right, bottom = crop_box(box, width, height)
        shape_only = torch.empty(1, 1, 1).expand(3, bottom - top, right - left)
        i, j, h, w = T.RandomResizedCrop.get_params(shape_only, self.scale, self.ratio)
        return left + j, top + i, w, h

    def decode_bytes(self, data: bytes, box: Box | None = None) -> PlannedCrop:
        """Choose the random crop (inside ``box``) from the header, refusing what the datasets refuse, then
        decode at the largest reduction the crop allows (libjpeg-turbo at full size for JPEGs; PIL else)."""
        width, height, jpeg = image_header(data)
        x0, y0, w, h = self.crop_window(box, width, height)
        reduction = draft_reduction(w, h, self.size, self.size) if self.draft else 1
        if reduction == 1 and jpeg:
            pixels = decode_jpeg(data)
            if pixels is not None:
                return PlannedCrop(pixels, (x0, y0, x0 + w, y0 + h))
        with open_image(data) as img:
            image, scale_x, scale_y = load_reduced(img, reduction)  # PIL raises OSError on a bad file
        if scale_x == scale_y == 1.0:  # full size: the same resize as a JPEG's, whatever the file format
            return PlannedCrop(pil_to_pixels(image), (x0, y0, x0 + w, y0 + h))
        return PlannedCrop(image, (x0 / scale_x, y0 / scale_y, (x0 + w) / scale_x, (y0 + h) / scale_y))

    def flip_and_colour(self) -> tuple[bool, Tensor]:
        """The draws after the crop, in the plain pipeline's order: RandomHorizontalFlip's, then
        ColorJitter's random order and factors and the lighting alphas (float32 (9,))."""
        flip = bool(torch.rand(1) < 0.5)
        jitter = self.jitter
        order, *factors = jitter.get_params(jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue)
        codes = [code for code in order.tolist() if code != HUE]
        factor_values = [1.0 if f is None else f for f in factors[:3]]
        alpha = torch.randn(3) * self.lighting_std
        return flip, torch.tensor([*codes, *factor_values, *alpha.tolist()], dtype=torch.float32)

    def __call__(self, image: Image.Image | PlannedCrop) -> AugmentedImage:
        """Crop-and-resize (the crop :meth:`decode_bytes` planned, or one drawn now), flip, colour."""
        if isinstance(image, PlannedCrop):
            source, region = image.image, image.region
        else:
            x0, y0, w, h = self.crop_window(None, image.width, image.height)
            source, region = pil_to_pixels(image), (x0, y0, x0 + w, y0 + h)
        out = resized_crop(source, region, self.size)
        flip, params = self.flip_and_colour()
        return AugmentedImage(out.flip(-1) if flip else out, params)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"jitter={self.jitter.brightness}, lighting_std={self.lighting_std}, draft={self.draft})"
        )


@dataclass(frozen=True)
class ColourConstants:
    """The device stage's constants on one device, made once so that no step copies them from the host (a
    blocking copy on CUDA): ``eigval`` (3,), ``eigvec`` (3, 3), ``mean`` (3,), ``inv_std`` (1, 3, 1, 1),
    ``gray_weight`` (1, 3, 1, 1) (:data:`GRAY_WEIGHTS`)."""

    eigval: Tensor
    eigvec: Tensor
    mean: Tensor
    inv_std: Tensor
    gray_weight: Tensor

    @classmethod
    def on(
        cls,
        device: torch.device | str,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> ColourConstants:
        device = torch.device(device)
        return cls(
            eigval=IMAGENET_PCA_EIGVAL.to(device),
            eigvec=IMAGENET_PCA_EIGVEC.to(device),
            mean=torch.tensor(mean, device=device),
            inv_std=(1.0 / torch.tensor(std, device=device)).view(1, 3, 1, 1),
            gray_weight=torch.tensor(GRAY_WEIGHTS, device=device).view(1, 3, 1, 1),
        )


_SIDE_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The one CUDA stream of ``device`` (with its index) for ``role`` (``"stage"``: the device stage beside
    the step; ``"decode"``: :func:`~mlcls.data.pipeline.gpu.decode_images`) for the whole process: the
    caching allocator keeps a pool per stream, so a new stream per epoch would reserve the stage's memory
    again. The roles' streams differ: torch hands out the 32 streams of its pool in turn, and a decode
    stream that came back as the stage stream would share its pool, which the decoder writes into
    without waiting for the stage stream."""
    with _SIDE_STREAMS_LOCK:
        if (device, role) not in _SIDE_STREAMS:
            taken = {stream.cuda_stream for (on, _), stream in _SIDE_STREAMS.items() if on == device}
            stream = torch.cuda.Stream(device)
            while stream.cuda_stream in taken:
                stream = torch.cuda.Stream(device)
            _SIDE_STREAMS[device, role] = stream
        return _SIDE_STREAMS[device, role]


def cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index (the current device's when it has none): the key of :func:`side_stream`."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def colour_lighting_normalise(
    pixels: Tensor,
    params: Tensor,
    constants: ColourConstants | None = None,
    batched: bool | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """float32 (B, 3, H, W), in the memory format of ``pixels``: ColorJitter with per-sample order and
    factors, PCA lighting and normalisation of uint8 (B, 3, H, W) ``pixels``, with ``params`` (B, 9) as in
    :class:`AugmentedImage` (or (B, 0): normalisation only) and ``constants`` on their device (default:
    ImageNet's, made for this call).

    Each jitter step is torchvision's float blend ``clamp(f * x + (1 - f) * g, 0, 1)`` with g = 0
    (brightness), the mean grey level of the image (contrast) or its grey image (saturation), computed on
    the 0-255 scale (each step is linear, so the scale changes nothing but the clamp's bound, and the
    ``/ 255`` joins the last step); then ``x + eigvec @ (alpha * eigval)`` (no clamp, as ``Lighting``) and
    ``(x - mean) / std`` in one fused multiply-add. ``batched`` (default on CUDA): all images at once, no
    host sync, the jitter in ``dtype`` (default float16 on CUDA: every pass over the batch moves half the
    bytes, within :data:`HALF_PRECISION_LEVELS` grey levels of float32; float32 elsewhere); else image by
    image in float32, each step only as needed."""
    device = pixels.device
    c = ColourConstants.on(device) if constants is None else constants
    scale = c.inv_std / 255.0
    if not params.shape[1]:  # an evaluation batch, (B, 0) params: ``(pixels / 255 - mean) / std`` only
        return torch.addcmul(-(c.mean.view(1, 3, 1, 1) * c.inv_std), pixels, scale)
    rgb_shift = (params[:, PARAMS_ALPHA].float() * c.eigval) @ c.eigvec.T
    shift = (rgb_shift - c.mean).view(-1, 3, 1, 1) * c.inv_std
    if batched is None:
        batched = device.type != "cpu"
    if batched:
        dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
        x = _colour_jitter(pixels.to(dtype), params, c.gray_weight.to(dtype), known_codes=False)
        return torch.addcmul(shift, x, scale)
    out = torch.empty(pixels.shape, device=device)
    for k in range(pixels.shape[0]):
        # Contiguous: the CPU's vectorised kernels need it for the per-channel operands.
        x = _colour_jitter(
            pixels[k : k + 1].float().contiguous(), params[k : k + 1], c.gray_weight, known_codes=True
        )
        torch.addcmul(shift[k : k + 1], x, scale, out=out[k : k + 1])
    return out


def _colour_jitter(x: Tensor, params: Tensor, gray_weight: Tensor, known_codes: bool) -> Tensor:
    """The three ColorJitter steps of :func:`colour_lighting_normalise`, in place on float (B, 3, H, W)
    pixel values in [0, 255]; returns ``x``, still in [0, 255]. ``gray_weight``: (1, 3, 1, 1) luma weights
    of ``x``'s dtype. ``known_codes``: read the operation codes on the host (a sync on CUDA: CPU batches
    only) and compute only what the images of the batch need."""
    order = params[:, PARAMS_ORDER].long()
    factors = params[:, PARAMS_FACTORS].float()  # float32 for the products whatever x's dtype
    for position in range(order.shape[1]):
        code = order[:, position : position + 1]
        factor = factors.gather(1, code).view(-1, 1, 1, 1)
        code = code.view(-1, 1, 1, 1)
        needed = set(code.flatten().tolist()) if known_codes else {BRIGHTNESS, CONTRAST, SATURATION}
        if needed == {BRIGHTNESS}:
            x.mul_(factor)
        else:
            targets = {}
            if CONTRAST in needed:  # the mean of the grey image, from the channel means (it is linear)
                targets[CONTRAST] = (x.mean(dim=(2, 3), keepdim=True) * gray_weight).sum(1, keepdim=True)
            if SATURATION in needed:
                targets[SATURATION] = F.conv2d(x, gray_weight)
            target = torch.zeros_like(factor, dtype=x.dtype)
            for operation, value in targets.items():
                target = value if needed == {operation} else torch.where(code == operation, value, target)
            torch.addcmul(target.mul_(1.0 - factor), x, factor, out=x)
        x.clamp_(0.0, 255.0)
    return x
