"""Optional NVIDIA DALI backend (``data.backend=dali``, ``pip install 'mlcls[dali]'``, CUDA only).

DataLoader workers read each file through the dataset (``dataset.on_bad_image`` applies) and draw its crop
window, flip and colour parameters with the fast pipeline's calls (:class:`CropPlans`); DALI decodes the
window, resizes and flips it (:func:`_build_pipeline`, no random operator: resume stays exact); the
:class:`mlcls.data.loader.DeviceStage` does the rest. The tests run the same graph with CPU operators.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mlcls.data.datasets.base import DatasetConfigError, MultiLabelDataset
from mlcls.data.pipeline.fast import AugmentedImage, FastTrainTransform, image_header

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


def encoded_image_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` of an encoded image, from its header; ``OSError`` (or PIL's error for a file it
    cannot identify) for what the GPU decoder would fail on and the header tells: not an image, a damaged
    header, a JPEG cut short (no end-of-image marker FFD9 after its last start-of-scan FFDA: entropy-coded
    data never holds FFD9, and an EXIF thumbnail's markers come before the image's scans)."""
    width, height, jpeg = image_header(data)
    if jpeg and data.rfind(b"\xff\xd9") < data.rfind(b"\xff\xda"):
        raise OSError("JPEG file is truncated (no end-of-image marker after its last scan)")
    return width, height


class CropPlan(NamedTuple):
    """One sample as :class:`CropPlans` serves it: ``encoded`` file bytes uint8 (N,), crop ``window``
    float32 ``(x, y, w, h)`` in pixels, ``flip``, colour ``params`` float32 (9,) and ``target`` (C,)."""

    encoded: np.ndarray
    window: np.ndarray
    flip: bool
    params: torch.Tensor
    target: torch.Tensor


class CropPlans(Dataset):
    """``plans[index]``: the :class:`CropPlan` of sample ``index``, drawn (under ``SeededSamples``' seed) in
    the fast pipeline's order; read by :meth:`MultiLabelDataset.read_sample`, so ``dataset.on_bad_image``
    applies as with the other backends."""

    def __init__(self, dataset: MultiLabelDataset, transform: FastTrainTransform) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def plan(self, index: int) -> CropPlan:
        """The plan of sample ``index`` itself; ``OSError`` when its file cannot be read."""
        data = self.dataset.image_bytes(index)
        window = self.transform.crop_window(self.dataset.samples[index].box, *encoded_image_size(data))
        flip, params = self.transform.flip_and_colour()
        encoded = np.frombuffer(data, dtype=np.uint8)
        return CropPlan(encoded, np.array(window, dtype=np.float32), flip, params, self.dataset.target(index))

    def __getitem__(self, index: int) -> CropPlan:
        plan, _ = self.dataset.read_sample(index, self.plan)
        return plan


class PlanBatch(NamedTuple):
    """A batch of B :class:`CropPlan`: ``encoded``, ``windows`` and ``flips`` as lists (what the DALI graph
    takes), ``params`` (B, 9) and ``targets`` (B, C) stacked."""

    encoded: list[np.ndarray]
    windows: list[np.ndarray]
    flips: list[np.ndarray]
    params: torch.Tensor
    targets: torch.Tensor


def collate_plans(plans: list[CropPlan]) -> PlanBatch:
    """Batch the plans; each flip becomes the int32 scalar array the graph's flip operator reads."""
    return PlanBatch(
        [plan.encoded for plan in plans],
        [plan.window for plan in plans],
        [np.array(plan.flip, dtype=np.int32) for plan in plans],
        torch.stack([plan.params for plan in plans]),
        torch.stack([plan.target for plan in plans]),
    )


class DaliTrainLoader:
    """Training batches ``(AugmentedImage on the GPU, targets)`` of ``plans``, the DataLoader of
    :class:`PlanBatch` es that :func:`mlcls.data.loader.build_train_loader` builds (its resumable sampler is
    this loader's ``sampler``). The graph keeps 2 batches scheduled ahead of the one handed out, so that
    GPU decoding overlaps the training step; each batch's copy into torch runs on the current CUDA stream
    (the ``DevicePrefetcher``'s side stream)."""

    def __init__(self, plans: DataLoader, size: int, device: torch.device) -> None:
        dali = require_dali()
        self.batch_size, self.size = plans.batch_size, size
        self.device = torch.device(
            "cuda", torch.cuda.current_device() if device.index is None else device.index
        )
        self.plans, self.sampler = plans, plans.sampler
        # The graph pulls the epoch's plan batches through this iterator; their params and targets wait in
        # ``_scheduled`` (oldest first) until the graph hands out the batch's pixels.
        self._epoch_plans: Iterator[PlanBatch] = iter(())
        self._scheduled: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        threads = max(1, plans.num_workers)
        self.pipeline = _build_pipeline(
            dali, self.batch_size, size, self._next_plans, threads, "gpu", self.device.index
        )
        self.pipeline.build()

    def __len__(self) -> int:
        return len(self.plans)

    def _next_plans(self) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        batch = next(self._epoch_plans)  # StopIteration ends the graph's epoch
        self._scheduled.append((batch.params, batch.targets))
        return batch.encoded, batch.windows, batch.flips

    def __iter__(self) -> Iterator[tuple[AugmentedImage, torch.Tensor]]:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        self._epoch_plans, self._scheduled = iter(self.plans), deque()
        try:
            while True:
                try:
                    (images,) = self.pipeline.run()
                except StopIteration:
                    return
                params, targets = self._scheduled.popleft()
                shape = (len(images), self.size, self.size, 3)
                pixels = torch.empty(shape, dtype=torch.uint8, device=self.device)
                feed_ndarray(images.as_tensor(), pixels, cuda_stream=torch.cuda.current_stream(self.device))
                params = params.to(self.device, non_blocking=True)
                yield AugmentedImage(pixels.permute(0, 3, 1, 2), params), targets
        finally:
            # Stopped early (the trainer's limit_train_batches) or at the end: drop the batches still
            # scheduled, and start the next epoch from a fresh graph epoch.
            self._epoch_plans = iter(())
            with contextlib.suppress(StopIteration):
                while True:
                    self.pipeline.run()
            self.pipeline.reset()
            self._scheduled.clear()


def _build_pipeline(
    dali: Any,
    batch_size: int,
    size: int,
    source: Callable[[], tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]],
    threads: int,
    device: str = "gpu",
    device_id: int | None = 0,
    prefetch_depth: int = 2,
) -> Any:
    """DALI graph: encoded bytes + (x, y, w, h) window + flip flag -> uint8 (size, size, 3) images, on GPU
    ``device_id`` (``device="gpu"``, nvJPEG) or the CPU, ``prefetch_depth`` batches ahead. ``source()`` gives
    the next batch: B uint8 (N,) files, B float32 (4,) windows, B int32 flips; it raises ``StopIteration`` at
    the end of an epoch, after which ``pipeline.run()`` hands out the batches still scheduled, then raises
    ``StopIteration`` until ``pipeline.reset()``. EXIF orientation is ignored, as by the other backends."""
    from nvidia.dali import fn, types

    if device not in DECODER_DEVICES:
        raise ValueError(f"device={device!r}; expected one of {', '.join(DECODER_DEVICES)}")

    @dali.pipeline_def(
        batch_size=batch_size,
        num_threads=threads,
        device_id=device_id if device == "gpu" else None,
        prefetch_queue_depth=prefetch_depth,
    )
    def crop_decode_resize() -> Any:
        encoded, window, flip = fn.external_source(source=source, num_outputs=3, batch=True)
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
