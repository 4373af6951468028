"""``mlcls-bench pipeline``: decode + training augmentation, images/s, of the input pipelines of
:data:`PIPELINES` side by side over the same JPEGs, interleaved within every repeat (same machine state).
docs/performance.md says what each pipeline runs; without ``--images`` it times 64 generated 640x480 JPEGs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import DataLoader
from torchvision import transforms as T

from mlcls.bench.harness import host, median_seconds, random_labels, sync, torch_threads
from mlcls.data import build_backend_transform
from mlcls.data.datasets.base import DatasetConfigError, MultiLabelDataset, Sample
from mlcls.data.images import read_image
from mlcls.data.loader import DeviceStage, available_cpus, build_train_loader, collate_batch
from mlcls.data.pipeline.fast import AugmentedImage
from mlcls.data.pipeline.transforms import IMAGENET_MEAN, IMAGENET_STD
from mlcls.data.shards.datasets import open_shards
from mlcls.data.shards.pack import SUBSAMPLINGS, pack_split, write_sidecars

PIPELINES = ("torchvision", "plain", "fast_cpu_stage", "fast", "decode_only", "shards_cpu_stage", "shards")
JPEG_EXTENSIONS = (".jpg", ".jpeg", ".JPG", ".JPEG")


def make_jpegs(
    directory: str | Path, count: int, size: tuple[int, int] = (640, 480), seed: int = 0
) -> list[Path]:
    """Write ``count`` JPEGs (quality 90) of natural-looking content, COCO's typical 640x480 by default:
    ~120 kB each, so that the entropy decoding costs what it costs on photographs (docs/performance.md)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width, height = size
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for k in range(count):
        planes = []
        for _ in range(3):
            a, b, phase = rng.uniform(-1, 1, 3)
            planes.append(128 + 60 * np.sin(a * x / 80 + b * y / 60 + 6 * phase) + rng.uniform(-40, 40))
        image = Image.fromarray(np.clip(np.stack(planes, -1), 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(25):
            cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(10, 120)
            colour = tuple(int(v) for v in rng.integers(0, 256, 3))
            if rng.random() < 0.5:
                draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
            else:
                draw.rectangle([cx - r, cy - r / 2, cx + r, cy + r / 2], fill=colour)
        pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(1.0))).astype(np.float32)
        coarse = (
            rng.normal(128, 30, (max(1, height // 4), max(1, width // 4), 3)).clip(0, 255).astype(np.uint8)
        )
        texture = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC))
        pixels += texture.astype(np.float32) - 128 + rng.normal(0, 6, pixels.shape)
        path = directory / f"image_{k:04d}.jpg"
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(path)
    return paths


def jpeg_files(images: str | None, count: int, size: tuple[int, int], folder: Path) -> list[Path]:
    """The JPEGs of the folder ``images``, or ``count`` generated ones of ``size`` (:func:`make_jpegs`, in
    parallel over the CPUs) in ``folder``."""
    if images is not None:
        paths = sorted(p for p in Path(images).iterdir() if p.suffix in JPEG_EXTENSIONS)
        if not paths:
            raise FileNotFoundError(f"no JPEG files (*.jpg, *.jpeg) in {images}")
        return paths
    parts = min(available_cpus(), max(1, count // 16))
    if parts == 1:
        return make_jpegs(folder, count, size)
    shares = [count // parts + (k < count % parts) for k in range(parts)]
    with concurrent.futures.ProcessPoolExecutor(parts) as pool:
        jobs = [pool.submit(make_jpegs, folder / f"part{k}", n, size, k) for k, n in enumerate(shares) if n]
        return [path for job in jobs for path in job.result()]


class JpegFolder(MultiLabelDataset):
    """``count`` samples (default: one per path) cycling over the JPEG ``paths``, each with a random label
    row over ``classes`` (about 3 positives, at most half), read through mlcls's own loading."""

    def __init__(
        self,
        paths: Sequence[Path],
        transform: Callable | None = None,
        count: int | None = None,
        classes: Sequence[str] = ("image",),
    ) -> None:
        super().__init__(transform)
        self.classes = list(classes)
        count = len(paths) if count is None else count
        self.samples = [Sample(str(paths[k % len(paths)])) for k in range(count)]
        self.labels = random_labels(count, len(self.classes), 3, torch.Generator().manual_seed(0))


def pack_shards(
    dataset: MultiLabelDataset,
    folder: Path,
    shard_size: int,
    max_side: int,
    subsampling: str = "auto",
    workers: int = 1,
) -> list[str]:
    """``dataset`` packed in ``folder`` as ``mlcls-data pack`` packs a training split (JPEG quality 90);
    the paths of its shards."""
    report = pack_split(
        dataset, folder, "train", shard_size, max_side, 90, subsampling, progress=False, workers=workers
    )
    write_sidecars(folder, dataset, {"train": "train"}, [report], max_side, 90, subsampling)
    return [str(folder / entry["name"]) for entry in report.shards]


class _OpenAndTransform(torch.utils.data.Dataset):
    """The reference pipeline's dataset: the image (``Image.open`` of the file's bytes, read through the
    door, :func:`read_image`: a FIFO named ``x.jpg`` is refused, never waited on) ``.convert("RGB")``, then
    ``transform``."""

    def __init__(self, paths: list[Path], transform: Callable) -> None:
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with read_image(self.paths[index]) as img:
            return self.transform(img.convert("RGB")), 0


def _no_augmentation(image: Image.Image) -> torch.Tensor:
    return torch.empty(0)


def _datasets(paths: list[Path], size: int) -> dict[str, torch.utils.data.Dataset]:
    fast = JpegFolder(paths, build_backend_transform("fast", "paper", size, train=True))
    jitter, normalize = T.ColorJitter(0.4, 0.4, 0.4), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    reference = T.Compose(
        [T.RandomResizedCrop(size), T.RandomHorizontalFlip(), jitter, T.ToTensor(), normalize]
    )
    return {
        "torchvision": _OpenAndTransform(paths, reference),
        "plain": JpegFolder(paths, build_backend_transform("torchvision", "paper", size, train=True)),
        "fast_cpu_stage": fast,
        "fast": fast,
        "decode_only": _OpenAndTransform(paths, _no_augmentation),
    }


def _time_pipeline(
    loader: Iterable, finish: Callable[[Any], Any] | None, device: torch.device, count: int
) -> float:
    """Seconds to pull ``count`` images from ``loader`` (batches), applying ``finish`` to each batch."""
    start, seen = time.perf_counter(), 0
    for batch in loader:
        images = batch[0]
        if finish is not None:
            finish(images)
        seen += len(images.pixels if isinstance(images, AugmentedImage) else images)
        if seen >= count:
            break
    sync(device)
    return time.perf_counter() - start


def _interleaved_seconds(
    loaders: dict[str, Callable[[], Iterable]],
    finishers: dict[str, Callable | None],
    device: torch.device,
    count: int,
    batch_size: int,
    repeat: int,
) -> dict[str, float]:
    """Seconds each pipeline takes for ``count`` images, one batch of each in turn (rotating order)."""
    streams = {name: iter(make()) for name, make in loaders.items()}
    totals = dict.fromkeys(loaders, 0.0)
    names = list(loaders)
    for step in range(-(-count // batch_size)):
        shift = (step + repeat) % len(names)
        for name in names[shift:] + names[:shift]:
            totals[name] += _time_pipeline(streams[name], finishers[name], device, 1)
    return totals


def _shard_batches(
    urls: list[str], size: int, batch_size: int, workers: int, device: torch.device
) -> Iterable:
    """Endless training batches of the packed shards (epoch after epoch), as ``dataset=shards`` reads them."""
    dataset = open_shards("train", urls, transform=build_backend_transform("fast", "paper", size, train=True))
    loader = build_train_loader(dataset, batch_size, workers, 0, 1, 0, device, "fast")
    if not len(loader):  # an epoch of no whole batch would loop for ever
        raise DatasetConfigError(
            f"the packed shards hold {sum(loader.sampler.shard_sizes)} readable samples, fewer than one "
            f"batch of {batch_size}: give --images more images or a smaller --batch-size"
        )
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield from loader


def run(
    images: str | Path | None = None,
    n: int = 256,
    workers: int = 0,
    size: int = 224,
    batch_size: int = 32,
    repeats: int = 3,
    seed: int = 0,
    threads: int = 1,
    max_side: int = 320,
    pack_workers: int = 2,
    subsampling: str = "auto",
) -> dict[str, Any]:
    """Images/s of every pipeline of :data:`PIPELINES` (median of ``repeats``), and ratios to the reference.

    ``workers=0`` measures one process (the issue's target); ``workers > 0`` reads through DataLoaders with
    that many persistent, prefetching workers per pipeline. Torch runs ``threads`` intra-op threads
    (default 1: every pipeline on one core, like PIL).
    """
    with tempfile.TemporaryDirectory() as tmp, torch_threads(threads):
        paths = jpeg_files(images, 64, (640, 480), Path(tmp) / "jpegs")
        start = time.perf_counter()
        urls = pack_shards(JpegFolder(paths), Path(tmp) / "shards", 16, max_side, subsampling, pack_workers)
        pack_rate = len(paths) / (time.perf_counter() - start)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        finishers: dict[str, Callable | None] = {name: None for name in PIPELINES}
        finishers["fast"] = finishers["shards"] = DeviceStage(device)
        torch.manual_seed(seed)
        prefetch = 2
        loaders: dict[str, Callable[[], Iterable]] = {}
        for name in ("shards_cpu_stage", "shards"):
            shard_stream = _shard_batches(urls, size, batch_size, workers, device)
            loaders[name] = lambda shard_stream=shard_stream: shard_stream
        for name, dataset in _datasets(paths, size).items():
            if workers == 0:  # read in this process, cycling over the dataset
                loaders[name] = lambda dataset=dataset: (
                    collate_batch(
                        [dataset[i % len(dataset)] for i in range(first, min(n, first + batch_size))]
                    )
                    for first in range(0, n, batch_size)
                )
                continue
            endless = iter(
                DataLoader(
                    dataset,
                    batch_size=batch_size,
                    sampler=torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=2**62),
                    num_workers=workers,
                    persistent_workers=True,
                    prefetch_factor=prefetch,
                    pin_memory=device.type == "cuda",
                    collate_fn=collate_batch,
                )
            )

            def drained(endless: Iterable = endless) -> Iterable:
                # Take the batches the workers prepared while other pipelines were timed (untimed), so that
                # the timing starts with every worker busy and the queue empty: steady-state throughput.
                for _ in range(prefetch * workers):
                    next(endless)
                return endless

            loaders[name] = drained
        seconds: dict[str, list[float]] = {name: [] for name in PIPELINES}
        for repeat in range(repeats):
            if workers == 0:  # batch by batch in turn, so that every pipeline sees the same machine load
                totals = _interleaved_seconds(loaders, finishers, device, n, batch_size, repeat)
                for name, value in totals.items():
                    seconds[name].append(value)
                continue
            for name in PIPELINES if repeat % 2 == 0 else PIPELINES[::-1]:
                seconds[name].append(_time_pipeline(loaders[name](), finishers[name], device, n))
        rates = {name: n / statistics.median(values) for name, values in seconds.items()}
        return {
            "images_per_s": rates["fast"],
            **{f"{name}_images_per_s": rate for name, rate in rates.items()},
            "device_stage_images_per_s": _device_stage_rate(batch_size, size, device, repeats),
            **{f"ratio_{name}_vs_torchvision": rates[name] / rates["torchvision"] for name in PIPELINES[1:]},
            "n": n,
            "files": len(paths),
            "workers": workers,
            "size": size,
            "batch_size": batch_size,
            "repeats": repeats,
            "device_stage_on": device.type,
            **host(),
            "pack_images_per_s": pack_rate,
            "pack_workers": pack_workers,
            "max_side": max_side,
            "subsampling": subsampling,
        }


def _device_stage_rate(batch_size: int, size: int, device: torch.device, repeats: int) -> float:
    """Images/s of the device stage alone on uint8 batches already on ``device``."""
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, generator=generator)
    params = torch.cat(
        [
            torch.stack([torch.randperm(3, generator=generator) for _ in range(batch_size)]).float(),
            0.6 + 0.8 * torch.rand(batch_size, 3, generator=generator),
            0.1 * torch.randn(batch_size, 3, generator=generator),
        ],
        dim=1,
    )
    batch = AugmentedImage(pixels.to(device), params.to(device))
    stage = DeviceStage(device)
    seconds = median_seconds({"stage": lambda: stage(batch)}, max(3, repeats), warmup=1, device=device)
    return batch_size / seconds["stage"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mlcls-bench pipeline``."""
    parser.add_argument("--images", help="folder of JPEGs (default: 64 generated 640x480 JPEGs)")
    parser.add_argument("--n", type=int, default=256, help="images per pipeline per repeat")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (0: in this process)")
    parser.add_argument("--size", type=int, default=224, help="output side")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in this process")
    parser.add_argument("--max-side", type=int, default=320, help="long side of the packed images")
    parser.add_argument("--pack-workers", type=int, default=2, help="processes packing the shards")
    parser.add_argument(
        "--subsampling", default="auto", choices=SUBSAMPLINGS, help="chroma of the packed JPEGs"
    )
