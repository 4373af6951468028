"""``mlcls-bench e2e``: the whole training loop fed by the real loader, against the same loop on batches
already on the device: the share of the device's rate each input pipeline reaches.

One :class:`~mlcls.engine.trainer.Trainer` runs one epoch of ``warmup + steps`` steps per contender
(``gpu_only``, before and after the backends, then each of ``--backends``); the last ``steps`` are timed on
CUDA by events on the compute stream (input waits count, no host sync is added), on the CPU by the clock.
docs/performance.md says what each contender reads and what each key means.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from omegaconf import DictConfig

from mlcls.bench.harness import check_names, host
from mlcls.bench.pipeline_bench import JpegFolder, jpeg_files, pack_shards
from mlcls.bench.step_bench import RepeatedBatches, synthetic_batch, temporary_trainer, trainer_fields
from mlcls.data import build_backend_transform
from mlcls.data.loader import available_cpus, build_train_loader, loader_workers
from mlcls.data.pipeline.gpu import input_stage_bytes
from mlcls.data.shards.datasets import open_shards
from mlcls.engine.trainer import Trainer
from mlcls.errors import ConfigError

BACKENDS = ("fast", "gpu", "torchvision", "dali", "shards", "shards_gpu")
# Batches of the input stage alone whose peak GPU memory is measured (data.backend=gpu, CUDA).
MEMORY_BATCHES = 3


def timed_epoch(trainer: Trainer, loader: Any, warmup: int, steps: int) -> float:
    """Seconds of the last ``steps`` steps of one epoch of ``warmup + steps`` steps of the trainer's loop
    over ``loader``."""
    trainer.data.train_loader, trainer.iters_per_epoch = loader, warmup + steps
    marks: list[Any] = []
    step = trainer.train_step

    def marked_step(*batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = step(*batch)
        if trainer.device.type != "cuda":
            marks.append(time.perf_counter())
            return out
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()  # on the current stream: the compute stream, after the step's work
        return out

    trainer.train_step = marked_step  # type: ignore[method-assign]
    try:
        trainer.train_one_epoch(0)
    finally:
        del trainer.train_step
    if len(marks) != warmup + steps:
        raise ConfigError(f"the loader gave {len(marks)} batches; {warmup + steps} expected")
    if trainer.device.type != "cuda":
        return marks[-1] - marks[warmup - 1]
    marks[-1].synchronize()
    return marks[warmup - 1].elapsed_time(marks[-1]) / 1000.0


def _loader(backend: str, trainer: Trainer, paths: list[Path], count: int, shards: Callable[[], list[str]]):
    size, batch, device = int(trainer.cfg.dataset.image_size), trainer.data.local_batch, trainer.device
    pipeline = "gpu" if backend.endswith("gpu") else "fast" if backend in ("shards", "dali") else backend
    transform = build_backend_transform(pipeline, "paper", size, train=True)
    if backend.startswith("shards"):
        dataset: Any = open_shards("train", shards(), transform=transform)
    else:
        dataset = JpegFolder(paths, transform, count, trainer.classes)
    workers, seed = trainer.cfg.trainer.workers, trainer.cfg.trainer.seed
    return build_train_loader(
        dataset, batch, workers, 0, 1, seed, device, "dali" if backend == "dali" else pipeline
    )


def run(
    cfg: DictConfig,
    backends: Sequence[str],
    images: str | None = None,
    count: int = 512,
    jpeg_size: tuple[int, int] = (640, 480),
    steps: int = 20,
    warmup: int | None = None,
    max_side: int = 320,
) -> dict[str, Any]:
    """Images/s of the trainer's loop on device-resident batches and fed by each of ``backends``, and each
    backend's share of the former (see the module docstring), for the training config ``cfg``."""
    check_names("--backends", list(backends), BACKENDS)
    workers = loader_workers(int(cfg.trainer.workers))
    warmup = 2 * workers + 2 if warmup is None else warmup
    if warmup < 1 or steps < 1:
        raise ConfigError(f"--warmup {warmup} --steps {steps}; expected at least 1 of each")
    with temporary_trainer(cfg) as (trainer, tmp):
        paths = jpeg_files(images, count, jpeg_size, tmp / "jpegs")
        cfg, device, batch_size = trainer.cfg, trainer.device, trainer.data.local_batch
        samples = (warmup + steps) * batch_size
        size = int(cfg.dataset.image_size)
        # on the device, finished: no input work left
        resident = trainer.device_stage.finish(synthetic_batch(batch_size, size, len(trainer.classes)))
        packed: list[str] = []

        def shard_urls() -> list[str]:
            if not packed:
                folder = JpegFolder(paths, None, samples, trainer.classes)
                packed.extend(
                    pack_shards(folder, tmp / "shards", 256, max_side, workers=min(8, available_cpus()))
                )
            return packed

        seconds, gpu_only = {}, []
        timed_epoch(trainer, RepeatedBatches(resident, warmup + steps), warmup, steps)  # compile, autotune
        gpu_only.append(timed_epoch(trainer, RepeatedBatches(resident, warmup + steps), warmup, steps))
        peak = None
        for backend in backends:
            loader = _loader(backend, trainer, paths, samples, shard_urls)
            seconds[backend] = timed_epoch(trainer, loader, warmup, steps)
            if backend.endswith("gpu") and device.type == "cuda":  # the device stage's peak, above before
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                loader.sampler.set_epoch(1)
                for _, batch in zip(range(MEMORY_BATCHES), loader, strict=False):
                    trainer.device_stage.finish(batch)
                torch.cuda.synchronize(device)
                peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            trainer.data.train_loader = loader = None
            gc.collect()  # the loader's persistent workers end here, before the next loader's start
        gpu_only.append(timed_epoch(trainer, RepeatedBatches(resident, warmup + steps), warmup, steps))
        seconds["gpu_only"] = sum(gpu_only) / len(gpu_only)
        rates = {name: steps * batch_size / value for name, value in seconds.items()}
        return {
            "gpu_only_images_per_s": rates["gpu_only"],
            **{f"{name}_images_per_s": rates[name] for name in backends},
            **{f"{name}_share": rates[name] / rates["gpu_only"] for name in backends},
            "gpu_only_runs_images_per_s": [steps * batch_size / value for value in gpu_only],
            "seconds": seconds,
            "images": steps * batch_size,
            "backends": list(backends),
            "warmup_steps": warmup,
            "steps": steps,
            "workers": workers,
            "jpegs": {
                "source": images or "generated",
                "files": len(paths),
                "mean_kib": float(np.mean([p.stat().st_size for p in paths]) / 1024),
            },
            "gpu_input_peak_mib": peak,
            "gpu_input_bound_mib": input_stage_bytes(batch_size, size) / 2**20,
            **trainer_fields(trainer),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            **host(),
            "cpus": available_cpus(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options of ``mlcls-bench e2e``."""
    parser.add_argument("overrides", nargs="*", help="config overrides, as for mlcls-train")
    parser.add_argument(
        "--backends", default="fast,gpu,torchvision", help=f"comma-separated, of {', '.join(BACKENDS)}"
    )
    parser.add_argument("--images", help="folder of JPEGs (default: --count generated JPEGs)")
    parser.add_argument("--count", type=int, default=512, help="JPEGs to generate (cycled over)")
    parser.add_argument("--jpeg-size", default="640x480", help="WIDTHxHEIGHT of the generated JPEGs")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, help="steps before the timed ones (2 x workers + 2)")
    parser.add_argument("--max-side", type=int, default=320, help="long side of the packed images (shards)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark ``args`` ask for, on the training config ``args.cfg`` (of ``args.overrides``)."""
    try:
        width, height = (int(v) for v in args.jpeg_size.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--jpeg-size {args.jpeg_size!r}; expected WIDTHxHEIGHT, e.g. 640x480") from None
    backends = [name for name in args.backends.split(",") if name]
    jpeg_size = (width, height)
    return run(args.cfg, backends, args.images, args.count, jpeg_size, args.steps, args.warmup, args.max_side)
