"""The GPU input pipeline (``data.backend=gpu``): JPEGs decoded, cropped and resized on the training device.

DataLoader workers plan each file with the fast pipeline's draws (exact resume); the device
(:func:`decode_on_device`) decodes the batch in chunks of at most :data:`DECODE_PIXELS` pixels, gathers the
windows of similar size into zero-padded tensors and resizes them by two batched matrix products
(:func:`resize_weights`): no launch per image. A file the device does not take from its header and first
segments (:mod:`mlcls.data.pipeline.jpeg`) takes the fast pipeline's CPU path in the worker; one whose
damage only decoding finds is decoded again one by one, then by PIL
(:mod:`~mlcls.data.pipeline.device_decode`; docs/performance.md, "JPEGs decoded on the GPU").

One private torch call stays, ``_typed_storage()._new_shared`` (:meth:`EncodedImage.collate`): it allocates a
batch's files in shared memory at once, as torch's own collation does, and no public call does without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import default_collate, get_worker_info
from torchvision import transforms as T

from mlcls.data.images import Box, check_encoded_size, check_pixels, crop_box, rgb_picture
from mlcls.data.pipeline.device_decode import decode_images
from mlcls.data.pipeline.fast import AugmentedImage, FastTrainTransform, PlannedCrop
from mlcls.data.pipeline.jpeg import BASELINE, SEQUENTIAL_SCAN, ends_after_its_last_scan, read_jpeg_header
from mlcls.data.pipeline.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SQUASH_EVAL_KINDS,
    eval_resize,
    eval_steps,
    normalisation,
)

# Decoded pixels one decode call holds at most (a chunk of the batch; an image alone may reach
# MAX_DEVICE_PIXELS): 64 Mi pixels, 192 MiB as RGB, bounding the input stage's memory (input_stage_bytes).
DECODE_PIXELS = 2**26
# Larger JPEGs go through the CPU path (reduced-scale decoding there makes them cheap): 16 Mi pixels.
MAX_DEVICE_PIXELS = 2**24
# Chroma subsamplings of the JPEGs the device decodes (simplejpeg's names), all nvJPEG's.
DEVICE_SUBSAMPLINGS = ("444", "422", "420", "440", "411")
MAX_PADDING = 2  # a resize group's padded windows (count x tallest x widest) over its windows' own pixels
# Columns of a sample's geometry (int64): the image's size; the window (left, top, width, height) in its
# pixels; the grid the window is resized to and the offset of the S x S output in it; the flip; S.
IMAGE_W, IMAGE_H, LEFT, TOP, WIDTH, HEIGHT, GRID_W, GRID_H, OFFSET_X, OFFSET_Y, FLIP, SIZE = range(12)
GEOMETRY_FIELDS = 12


class EncodedImage(NamedTuple):
    """One sample as the workers make it. ``data``: the JPEG file for the device (``b""`` when ``pixels``
    holds the sample); ``pixels``: uint8 (3, S, S) made on the CPU path, else None; ``geometry``: int64
    (:data:`GEOMETRY_FIELDS`,); ``params``: float32 (9,), the fast pipeline's colour parameters, or (0,) in
    evaluation."""

    data: bytes
    pixels: Tensor | None
    geometry: np.ndarray
    params: Tensor

    @staticmethod
    def collate(batch: list[EncodedImage]) -> EncodedBatch:
        """The :class:`EncodedBatch` of ``batch``: the files copied once, into shared memory in a DataLoader
        worker (as ``default_collate`` places its tensors), the CPU-path pixels stacked channels-last."""
        lengths = np.array([len(sample.data) for sample in batch], dtype=np.int64)
        encoded = torch.empty(int(lengths.sum()), dtype=torch.uint8)
        if get_worker_info() is not None and len(encoded):
            encoded = encoded.new(encoded._typed_storage()._new_shared(len(encoded), device="cpu"))
        files, position = encoded.numpy(), 0
        for sample in batch:
            files[position : position + len(sample.data)] = np.frombuffer(sample.data, dtype=np.uint8)
            position += len(sample.data)
        decoded = [sample.pixels.permute(1, 2, 0) for sample in batch if sample.pixels is not None]
        size = int(batch[0].geometry[SIZE])
        stacked = default_collate(decoded) if decoded else torch.empty(0, size, size, 3, dtype=torch.uint8)
        params = default_collate([sample.params for sample in batch])
        geometry = np.stack([sample.geometry for sample in batch])
        return EncodedBatch(encoded, lengths, geometry, stacked.permute(0, 3, 1, 2), params)


class EncodedBatch(NamedTuple):
    """A batch of B :class:`EncodedImage`: ``encoded`` uint8 (N,) the device samples' files one after the
    other, ``lengths`` int64 (B,) their sizes (0: made on the CPU path), ``geometry`` int64 (B, 12),
    ``pixels`` uint8 (K, 3, S, S) the K CPU-path samples in batch order, ``params`` float32 (B, 9) or
    (B, 0). ``lengths`` and ``geometry`` are NumPy arrays, read on the host without waiting for the GPU."""

    encoded: Tensor
    lengths: np.ndarray
    geometry: np.ndarray
    pixels: Tensor
    params: Tensor

    def pin_memory(self) -> EncodedBatch:
        """The batch with its pixel tensors pinned (what the DataLoader's ``pin_memory`` calls): ``encoded``
        stays in pageable memory, since nvJPEG reads the files on the host and copies them itself."""
        return self._replace(pixels=self.pixels.pin_memory(), params=self.params.pin_memory())

    def on_device(self, device: torch.device) -> AugmentedImage:
        """The batch as the fast pipeline's device stage takes it: its pixels made on ``device``
        (:func:`decode_on_device`), its colour parameters."""
        return AugmentedImage(decode_on_device(self, device), self.params)


class PlannedJpeg(NamedTuple):
    """A JPEG the device decodes, read and planned in the worker: its bytes, size, and the window
    ``(left, top, width, height)`` the sample keeps."""

    data: bytes
    width: int
    height: int
    window: tuple[int, int, int, int]


def device_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of a file the device decodes: a baseline YCbCr JPEG of a subsampling of
    :data:`DEVICE_SUBSAMPLINGS`, 8-bit, its quantisation tables defined, its first scan sequential, not cut
    short, of at most :data:`MAX_DEVICE_PIXELS` pixels; else None (the worker's CPU path decodes it, and
    ``dataset.on_bad_image`` applies when that fails). A header claiming more pixels than the file's bytes
    can encode is refused (:func:`~mlcls.data.images.check_encoded_size`)."""
    try:
        height, width, colorspace, subsampling = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace != "YCbCr" or subsampling not in DEVICE_SUBSAMPLINGS or width * height > MAX_DEVICE_PIXELS:
        return None
    header = read_jpeg_header(data)
    if (
        header is None
        or header.marker != BASELINE
        or header.precision != 8
        or not header.tables <= header.defined
        or header.progression != SEQUENTIAL_SCAN
        or not ends_after_its_last_scan(data)
    ):
        return None
    check_pixels(width, height)
    check_encoded_size(width, height, len(data))
    return width, height


def encoded_image(
    image: PlannedJpeg | Tensor,
    params: Tensor,
    size: int,
    grid: tuple[int, int, int, int] = (0, 0, 0, 0),
    flip: bool = False,
) -> EncodedImage:
    """The :class:`EncodedImage` of uint8 (3, S, S) pixels of the CPU path, or of a planned JPEG whose window
    the device resizes to ``grid`` = ``(grid_w, grid_h, offset_x, offset_y)`` and flips (the geometry's
    columns in order)."""
    if isinstance(image, Tensor):
        return EncodedImage(
            b"", image, np.array([0] * (GEOMETRY_FIELDS - 1) + [size], dtype=np.int64), params
        )
    geometry = np.array([image.width, image.height, *image.window, *grid, int(flip), size], dtype=np.int64)
    return EncodedImage(image.data, None, geometry, params)


class GpuEvalTransform:
    """The evaluation transform of ``kind`` with ``data.backend=gpu``: JPEGs the device takes are planned
    for it (the window: the image, or the sample's box); other files are decoded here and resized as the
    plain evaluation transform does, to uint8 (3, S, S). ``mean`` and ``std`` normalise on the device."""

    normalises_on_device = True  # the loader's device stage normalises with ``mean`` and ``std``

    def __init__(
        self,
        size: int,
        kind: str = "paper",
        mean: Sequence[float] | None = IMAGENET_MEAN,
        std: Sequence[float] | None = IMAGENET_STD,
    ) -> None:
        self.size, self.kind = size, kind
        self.mean, self.std = normalisation(mean, std)
        self.cpu_path = T.Compose([*eval_steps(kind, size), T.PILToTensor()])

    def decode_bytes(self, data: bytes, box: Box | None = None) -> PlannedJpeg | Image.Image:
        """A :class:`PlannedJpeg` whose window is the :func:`crop_box` of ``box``, or the RGB PIL image
        (cropped to the box) of a file the device does not take."""
        size = device_jpeg_size(data)
        if size is None:
            return rgb_picture(data, box)
        left, top, right, bottom = crop_box(box, *size)
        return PlannedJpeg(data, *size, (left, top, right - left, bottom - top))

    def grid(self, width: int, height: int) -> tuple[int, int, int, int]:
        """``(grid_w, grid_h, offset_x, offset_y)`` of a ``width`` x ``height`` window: torchvision's
        shorter-side ``Resize`` and ``CenterCrop`` (or the squash-resize)."""
        s = self.size
        if self.kind in SQUASH_EVAL_KINDS:
            return s, s, 0, 0
        short = eval_resize(s)
        if width <= height:
            grid_w, grid_h = short, int(short * height / width)
        else:
            grid_w, grid_h = int(short * width / height), short
        return grid_w, grid_h, int(round((grid_w - s) / 2.0)), int(round((grid_h - s) / 2.0))

    def __call__(self, image: PlannedJpeg | Image.Image) -> EncodedImage:
        if not isinstance(image, PlannedJpeg):
            return encoded_image(self.cpu_path(image), torch.zeros(0), self.size)
        return encoded_image(image, torch.zeros(0), self.size, self.grid(*image.window[2:]))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, kind={self.kind!r}, mean={self.mean}, std={self.std})"
        )


class GpuTrainTransform:
    """The worker's part of the ``paper`` training augmentation with ``data.backend=gpu``: read and plan
    (the datasets' ``decode_bytes`` hook), then draw the flip and colour parameters with the fast pipeline's
    calls in its order; output :class:`EncodedImage`."""

    torch_random_only = True

    def __init__(self, fast: FastTrainTransform) -> None:
        self.fast, self.size = fast, fast.size

    def decode_bytes(self, data: bytes, box: Box | None = None) -> PlannedJpeg | PlannedCrop:
        """A :class:`PlannedJpeg` with the fast pipeline's crop window, or the fast pipeline's own
        ``decode_bytes`` (the CPU path, the same draw)."""
        size = device_jpeg_size(data)
        if size is None:
            return self.fast.decode_bytes(data, box)
        return PlannedJpeg(data, *size, self.fast.crop_window(box, *size))

    def __call__(self, image: PlannedJpeg | PlannedCrop | Image.Image) -> EncodedImage:
        if not isinstance(image, PlannedJpeg):
            return encoded_image(*self.fast(image), self.size)  # its (pixels, params)
        flip, params = self.fast.flip_and_colour()
        return encoded_image(image, params, self.size, (self.size, self.size, 0, 0), flip)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, crop and colour of {self.fast!r})"


def input_stage_bytes(batch_size: int, size: int) -> int:
    """A bound of the GPU memory torch reserves for the input stage of training batches of ``batch_size``
    images of ``size`` x ``size`` (nvJPEG's own buffers, allocated outside torch, come on top); the parts
    are docs/performance.md's ("Memory"), each held at most by construction.

    Per pixel of a decode chunk (:data:`DECODE_PIXELS`): 6 bytes in the decode stream's pool (the decoded
    RGB of two chunks, :func:`~mlcls.data.pipeline.device_decode.decode_images`), 16.5 at the largest phase
    of :func:`resize_windows`. Per
    output value: 16 bytes for the batch in the making (the uint8 copies, the colour stage's float16 and
    float32 output) and 8 for two finished float32 batches (the one queued, the one the step uses: the stage
    waits for the step two batches back, :func:`~mlcls.data.loader.beside_the_step`). A quarter more for
    what the caching allocator reserves beyond what is allocated (rounding)."""
    output = batch_size * 3 * size * size
    allocated = (6 + 16.5) * DECODE_PIXELS + 16 * output + 2 * 4 * output
    return int(allocated * 1.25)


def resize_weights(
    in_size: Tensor, grid: Tensor, offset: Tensor, taps: int, size: int, dtype: torch.dtype
) -> Tensor:
    """The antialiased bilinear resize as matrices: (n, size, taps) weights of output rows ``offset`` to
    ``offset + size`` of a resize of ``in_size`` source pixels to ``grid`` (each (n,) int), over source
    pixels ``0 .. taps - 1`` (zero from ``in_size`` on).

    PIL's ``BILINEAR`` and torch's ``interpolate(..., antialias=True)``: with ``scale = in / grid``, output
    pixel ``i`` averages source pixel ``j`` with weight ``max(0, 1 - |j + 0.5 - scale (i + 0.5)| / max(scale,
    1))``, normalised over the pixels inside the source. Computed in float32 in place (7 bytes per weight
    at the peak, with the mask and the copy), returned as ``dtype``."""
    device = in_size.device
    scale = in_size.float() / grid.float()
    stretch = torch.clamp(scale, min=1.0).view(-1, 1, 1)
    rows = offset[:, None].float() + torch.arange(size, device=device, dtype=torch.float32)
    centre = (scale[:, None] * (rows + 0.5) - 0.5)[:, :, None]
    source = torch.arange(taps, device=device, dtype=torch.float32).view(1, 1, -1)
    weights = (source - centre).div_(stretch).abs_().neg_().add_(1.0).clamp_(min=0.0)
    weights.mul_(source < in_size.view(-1, 1, 1))
    return weights.div_(weights.sum(-1, keepdim=True)).to(dtype)


def _to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """A host array on ``device``, copied asynchronously (from pinned memory on CUDA): no host sync."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def chunks(geometry: np.ndarray, budget: int = DECODE_PIXELS) -> list[np.ndarray]:
    """Positions of the rows of ``geometry`` (device samples) in decode chunks: sorted by window height
    (so that each chunk's padded windows waste little), cut before a sample that would take the chunk's
    decoded pixels, or its padded windows (count x tallest x widest), over ``budget``, or its resize
    weights (count x S x (tallest + widest)) over half of it; an image alone may pass it (at most
    :data:`MAX_DEVICE_PIXELS` pixels)."""
    order = np.argsort(-geometry[:, HEIGHT], kind="stable")
    out, start, decoded, widest = [], 0, 0, 0
    for k, row in enumerate(order):
        pixels, width = int(geometry[row, IMAGE_W] * geometry[row, IMAGE_H]), int(geometry[row, WIDTH])
        count, tallest, wider = k - start + 1, int(geometry[order[start], HEIGHT]), max(widest, width)
        weights = count * int(geometry[row, SIZE]) * (tallest + wider)
        if k > start and (
            decoded + pixels > budget or count * tallest * wider > budget or 2 * weights > budget
        ):
            out.append(order[start:k])
            start, decoded, widest = k, 0, 0
        decoded, widest = decoded + pixels, max(widest, width)
    if len(order):
        out.append(order[start:])
    return out


def window_groups(geometry: np.ndarray) -> list[np.ndarray]:
    """Positions of the rows of ``geometry`` (a decode chunk) in groups resized together: sorted by window
    height, cut before a window that would make the group's padded windows (count x tallest x widest) more
    than :data:`MAX_PADDING` times its windows' own pixels."""
    order = np.argsort(-geometry[:, HEIGHT], kind="stable")
    heights, widths = geometry[order, HEIGHT], geometry[order, WIDTH]
    out, start, area, widest = [], 0, 0, 0
    for k in range(len(order)):
        count, wider = k - start + 1, max(widest, int(widths[k]))
        window = int(heights[k] * widths[k])
        if k > start and count * int(heights[start]) * wider > MAX_PADDING * (area + window):
            out.append(order[start:k])
            start, area, wider = k, 0, int(widths[k])
        area, widest = area + window, wider
    if len(order):
        out.append(order[start:])
    return out


def resize_windows(images: list[Tensor], geometry: np.ndarray, device: torch.device) -> Tensor:
    """uint8 (n, 3, S, S): each image's window resized to its grid, the output's S x S cut, flipped where
    the geometry says; ``images`` is emptied once read. Batched: one gather of the windows into a
    zero-padded (3, n, h, w) tensor, two matrix products (float16 on CUDA, float32 on the CPU), rounding,
    flip."""
    n, size = len(images), int(geometry[0, SIZE])
    taps_h, taps_w = int(geometry[:, HEIGHT].max()), int(geometry[:, WIDTH].max())
    starts = np.concatenate([[0], np.cumsum(geometry[:, IMAGE_W] * geometry[:, IMAGE_H])[:-1]])
    flat = torch.cat([image.reshape(3, -1) for image in images], dim=1)  # (3, pixels of the chunk)
    images.clear()  # the decoded images are released once their copy is queued
    meta = _to_device(np.column_stack([starts, geometry]).astype(np.int32), device)
    start, columns = meta[:, 0], meta[:, 1:]
    rows = columns[:, TOP, None] + torch.minimum(
        torch.arange(taps_h, device=device, dtype=torch.int32)[None], columns[:, HEIGHT, None] - 1
    )
    cols = columns[:, LEFT, None] + torch.minimum(
        torch.arange(taps_w, device=device, dtype=torch.int32)[None], columns[:, WIDTH, None] - 1
    )
    index = (start.view(-1, 1, 1) + rows[:, :, None] * columns[:, IMAGE_W].view(-1, 1, 1)) + cols[:, None]
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    windows = flat.index_select(1, index.view(-1)).view(3, n, taps_h, taps_w).to(dtype)
    del flat, index
    vertical = resize_weights(
        columns[:, HEIGHT], columns[:, GRID_H], columns[:, OFFSET_Y], taps_h, size, dtype
    )
    horizontal = resize_weights(
        columns[:, WIDTH], columns[:, GRID_W], columns[:, OFFSET_X], taps_w, size, dtype
    )
    horizontal = horizontal.transpose(1, 2)  # (n, taps_w, S)
    if taps_w <= taps_h:  # the cheaper order: the second product runs over the shorter side
        resized = torch.matmul(torch.matmul(vertical, windows), horizontal)
    else:
        resized = torch.matmul(vertical, torch.matmul(windows, horizontal))
    pixels = resized.round_().clamp_(0, 255).to(torch.uint8).permute(1, 0, 2, 3)  # (n, 3, S, S)
    flips = columns[:, FLIP].bool().view(-1, 1, 1, 1)
    return torch.where(flips, pixels.flip(-1), pixels)


def decode_on_device(batch: EncodedBatch, device: torch.device | str) -> Tensor:
    """uint8 (B, 3, S, S) on ``device``: the batch's JPEGs decoded, cut and resized there
    (:func:`decode_images` chunk by chunk, :func:`chunks`; :func:`resize_windows` group by group,
    :func:`window_groups`), its CPU-path samples copied, all in batch order. Reads no device value on the
    host. Each group's decoded images are released once :func:`resize_windows` has queued its copy."""
    device = torch.device(device)
    lengths, geometry = batch.lengths, batch.geometry
    on_device = np.flatnonzero(lengths)
    files = batch.encoded.split(lengths[on_device].tolist())  # views, in the order of on_device
    parts, order = [], []
    if len(batch.pixels):
        parts.append(batch.pixels.to(device, non_blocking=True))
        order.append(np.flatnonzero(lengths == 0))
    for chunk in chunks(geometry[on_device], DECODE_PIXELS):
        images = decode_images([files[k] for k in chunk], device)
        for group in window_groups(geometry[on_device[chunk]]):
            positions = on_device[chunk[group]]
            taken = [images[k] for k in group]
            for k in group:
                images[k] = None
            parts.append(resize_windows(taken, geometry[positions], device))
            order.append(positions)
    pixels = torch.cat(parts) if len(parts) > 1 else parts[0]
    return pixels.index_select(0, _to_device(np.argsort(np.concatenate(order)), device))
