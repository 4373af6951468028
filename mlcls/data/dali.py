"""Optional NVIDIA DALI backend (``data.backend=dali``): JPEG decoding, crop and resize on the GPU.

Install with ``pip install 'mlcls[dali]'`` (``nvidia-dali-cuda120``) on a CUDA machine. Without DALI or
without CUDA, :func:`require_dali` raises a one-line :class:`DaliUnavailableError`.

Division of work, chosen so that the augmentation stays a function of each sample's seed:

* DataLoader workers read the encoded bytes and draw the sample's random parameters under its seed
  (:class:`mlcls.data.loader.SeededSamples`), with the calls of :class:`mlcls.data.fast.FastTrainTransform`
  in the same order: RandomResizedCrop window, flip, ColorJitter order and factors, lighting alphas;
* DALI (nvJPEG, ``decoders.image_slice``) decodes only the crop window on the GPU, resizes it to
  ``size`` x ``size`` (linear, antialiased) and flips it: uint8 (B, S, S, 3) on the GPU, handed on as a
  (B, 3, S, S) view. The same graph runs with CPU operators (``_build_pipeline(..., device="cpu")``), which
  is how the tests check it without a GPU;
* :class:`mlcls.data.fast.DeviceStage` applies colour jitter, lighting and normalisation as for ``fast``.

No DALI random operator is used, so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from mlcls.data.base import DatasetConfigError, MultiLabelDataset, crop_box
from mlcls.data.fast import AugmentedImage, FastTrainTransform
from mlcls.data.loader import ResumableSampler, SeededSamples

# DALI decoder device for each graph device: nvJPEG on the GPU ("mixed": CPU input, GPU output), or the CPU.
DECODER_DEVICES = {"gpu": "mixed", "cpu": "cpu"}


class DaliUnavailableError(DatasetConfigError):
    """``data.backend=dali`` on a machine without NVIDIA DALI or without CUDA."""


def require_dali() -> Any:
    """Return the ``nvidia.dali`` module, or raise :class:`DaliUnavailableError` saying what is missing."""
    try:
        import nvidia.dali as dali
    except ImportError:
        raise DaliUnavailableError(
            "data.backend=dali needs NVIDIA DALI: pip install 'mlcls[dali]' (CUDA 12); or data.backend=fast"
        ) from None
    if not torch.cuda.is_available():
        raise DaliUnavailableError(
            "data.backend=dali needs a CUDA device; use data.backend=fast on this machine"
        )
    return dali


class CropPlans(Dataset):
    """``plans[index]``: the encoded file, its crop window, flip and colour parameters, and its target.

    Runs inside ``SeededSamples`` (per-sample seed); draws in the order of the fast pipeline.
    """

    def __init__(self, dataset: MultiLabelDataset, transform: FastTrainTransform) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray, bool, torch.Tensor, torch.Tensor]:
        sample = self.dataset.samples[index]
        with Image.open(sample.path) as img:
            width, height = img.size
        whole = (0, 0, width, height)
        left, top, right, bottom = whole if sample.box is None else crop_box(sample.box, width, height)
        i, j, h, w = self.transform.crop_params(right - left, bottom - top)
        flip = bool(torch.rand(1) < 0.5)
        params = self.transform.colour_params()
        with open(sample.path, "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        window = np.array([left + j, top + i, w, h], dtype=np.float32)  # x, y, width, height
        return encoded, window, flip, params, self.dataset.labels[index]


def _collate(items: list[tuple]) -> tuple[list, list, list, torch.Tensor, torch.Tensor]:
    encoded, windows, flips, params, targets = zip(*items, strict=True)
    return list(encoded), list(windows), list(flips), torch.stack(params), torch.stack(targets)


class DaliTrainLoader:
    """Training batches ``(AugmentedImage on the GPU, targets)``; a drop-in for ``loader.train_loader``.

    ``sampler`` is the same :class:`ResumableSampler` (``set_epoch``, ``set_start`` for exact resume).
    """

    def __init__(
        self,
        dataset: MultiLabelDataset,
        batch_size: int,
        workers: int,
        rank: int,
        world_size: int,
        seed: int,
        size: int,
        device_id: int = 0,
    ) -> None:
        dali = require_dali()
        self.batch_size, self.size, self.device_id = batch_size, size, device_id
        self.sampler = ResumableSampler(dataset, world_size, rank, seed)
        self.plans = DataLoader(
            SeededSamples(CropPlans(dataset, FastTrainTransform(size))),
            batch_size=batch_size,
            sampler=self.sampler,
            num_workers=workers,
            drop_last=True,
            collate_fn=_collate,
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers > 0 else None,
        )
        self.pipeline = _build_pipeline(dali, batch_size, size, max(1, workers), "gpu", device_id)
        self.pipeline.build()

    def __len__(self) -> int:
        return len(self.plans)

    def __iter__(self) -> Iterator[tuple[AugmentedImage, torch.Tensor]]:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        device = torch.device("cuda", self.device_id)
        for encoded, windows, flips, params, targets in self.plans:
            images = _run_pipeline(self.pipeline, encoded, windows, flips)
            pixels = torch.empty((len(encoded), self.size, self.size, 3), dtype=torch.uint8, device=device)
            feed_ndarray(images.as_tensor(), pixels, cuda_stream=torch.cuda.current_stream(device))
            yield AugmentedImage(pixels.permute(0, 3, 1, 2), params.to(device, non_blocking=True)), targets


def _run_pipeline(
    pipeline: Any, encoded: list[np.ndarray], windows: list[np.ndarray], flips: list[bool]
) -> Any:
    """Feed one batch of :class:`CropPlans` to the graph of :func:`_build_pipeline` and run it.

    ``encoded``: B uint8 (N,) file contents; ``windows``: B float32 (4,) ``(x, y, w, h)`` in pixels;
    ``flips``: B flags. Returns the DALI ``TensorList`` of B uint8 (size, size, 3) images, on the GPU or on
    the CPU as the graph's ``device``.
    """
    pipeline.feed_input("encoded", encoded)
    pipeline.feed_input("window", windows)
    pipeline.feed_input("flip", [np.array(flip, dtype=np.int32) for flip in flips])
    (images,) = pipeline.run()
    return images


def _build_pipeline(
    dali: Any, batch_size: int, size: int, threads: int, device: str = "gpu", device_id: int = 0
) -> Any:
    """DALI graph: encoded bytes + (x, y, w, h) window + flip flag -> uint8 (size, size, 3) images.

    ``device="gpu"`` (training): nvJPEG decoding (``mixed``) and GPU resize and flip on GPU ``device_id``.
    ``device="cpu"``: the same operators on the CPU (libjpeg-turbo decoding), no GPU needed; ``device_id``
    is unused. Decoding ignores EXIF orientation, as PIL and the other backends do, so the window is in the
    coordinates of the stored pixels.
    """
    from nvidia.dali import fn, types

    if device not in DECODER_DEVICES:
        raise ValueError(f"device={device!r}; expected one of {', '.join(DECODER_DEVICES)}")

    @dali.pipeline_def(
        batch_size=batch_size,
        num_threads=threads,
        device_id=device_id if device == "gpu" else None,
        prefetch_queue_depth=1,
    )
    def crop_decode_resize() -> Any:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8)
        window = fn.external_source(name="window", dtype=types.FLOAT)
        flip = fn.external_source(name="flip", dtype=types.INT32)
        images = fn.decoders.image_slice(
            encoded,
            window[0:2],
            window[2:4],
            device=DECODER_DEVICES[device],
            output_type=types.RGB,
            adjust_orientation=False,
            jpeg_fancy_upsampling=True,  # nvJPEG upsamples chroma as libjpeg-turbo (the other backends) does
            normalized_anchor=False,
            normalized_shape=False,
            axis_names="WH",
        )
        images = fn.resize(
            images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=True
        )
        return fn.flip(images, horizontal=flip)

    return crop_decode_resize()
