"""JPEG files decoded on the training device (``data.backend=gpu``): torchvision's batched ``decode_jpeg``
(nvJPEG on CUDA, libjpeg-turbo on the CPU), one by one and then by PIL when a batch's call fails, on CUDA
under a stream of its own whose pool stays bounded (:func:`decode_images`).

Written here, not taken whole from torchvision: its CUDA decode writes its outputs on a stream that waits for
no other, so the ordering with the stream that reads them is ours to make.
"""

from __future__ import annotations

import functools
import threading
import warnings

import numpy as np
import torch
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg

from mlcls.data.datasets.base import BadImageError
from mlcls.data.images import open_image, to_rgb
from mlcls.data.pipeline.fast import cuda_device, side_stream

# torchvision 0.29 deprecates its image codecs for TorchCodec (not a dependency): its nvJPEG decode stays.
warnings.filterwarnings(
    "ignore", "The image decoding and encoding capabilities of TorchVision", DeprecationWarning
)


def decode_images(files: list[Tensor], device: torch.device) -> list[Tensor]:
    """uint8 (3, H, W) images on ``device`` of the JPEG ``files`` (uint8 (N,) host tensors), in one batched
    ``decode_jpeg`` call; when it fails (a file damaged beyond its header), one by one, then by PIL.

    On CUDA the images are ready for the current stream. torchvision's nvJPEG decode allocates its outputs
    from the current stream's pool but writes them on a stream of its own (one taken from torch's pool when
    its decoder is made), which waits for no other stream; it returns once that stream has finished (the
    host waits) and makes the current stream wait for it (an event). So the call runs under the
    :func:`side_stream` ``"decode"``, whose pool holds nothing but decoded images, each recorded on the
    calling stream before that stream reads it: the allocator gives such a block out again only once the
    calling stream's work queued before its release has run, so the decoder never writes over pixels still
    to be read. The calling stream then waits for the decode stream. A failed call raises without waiting
    for the decoder's stream: the device is synchronised before anything else is allocated.

    The pool's size: before it decodes, the host waits until the calling stream has run what it had queued
    at the previous call (the reads of every earlier call's images but the last's, long queued by then), so
    the pool holds the images of two calls at most, however far that stream lags."""
    if device.type != "cuda":
        return _decode_batched(files, device)
    device = cuda_device(device)
    current, decoding = torch.cuda.current_stream(device), side_stream(device, "decode")
    queued, (lock, calls) = current.record_event(), _previous_call(device)
    with lock:  # one thread decodes at a time in mlcls; the lock keeps the pair whole if two did
        previous = calls.pop() if calls else None
        calls.append(queued)
    if previous is not None:
        previous.synchronize()
    with torch.cuda.stream(decoding):
        images = _decode_batched(files, device)
    current.wait_stream(decoding)
    for image in images:
        image.record_stream(current)
    return images


@functools.cache
def _previous_call(device: torch.device) -> tuple[threading.Lock, list[torch.cuda.Event]]:
    """The event :func:`decode_images` recorded on its calling stream at its previous call on ``device``,
    and the lock that guards it."""
    return threading.Lock(), []


def _decode_batched(files: list[Tensor], device: torch.device) -> list[Tensor]:
    try:
        return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        _settle(device)
        return [_decode_one(data, device) for data in files]


def _decode_one(data: Tensor, device: torch.device) -> Tensor:
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError as device_error:
        _settle(device)
        try:
            with open_image(data.numpy().tobytes()) as img:
                rgb = np.array(img if img.mode == "RGB" else to_rgb(img))
            return torch.from_numpy(rgb).permute(2, 0, 1).contiguous().to(device)
        except (OSError, ValueError, SyntaxError) as exc:
            raise BadImageError(
                f"a JPEG of this batch cannot be decoded ({device_error}; PIL: {exc}); its header is sound, "
                "so the workers could not skip it: find it with `mlcls-data stats --check`"
            ) from exc


def _settle(device: torch.device) -> None:
    if device.type == "cuda":  # a failed nvJPEG call leaves its own stream writing what it dropped
        torch.cuda.synchronize(device)
