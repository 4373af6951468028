"""``mlcls-bench e2e``: the whole training loop fed by the real loader, against the same loop on batches
already on the device: the share of the device's rate each input pipeline reaches, in steady state.

One :class:`~mlcls.engine.trainer.Trainer` runs one epoch per contender (``gpu_only``, before and after the
backends, then each of ``--backends``) of the steps :func:`steady_state_plan` gives: a warm-up that drains
the loader's buffer, then at least :data:`MIN_TIMED_STEPS` timed steps. The timed span runs from the end of
the last warm-up step to the end of the last step, on CUDA by events on the compute stream (input waits
count, no host sync is added), on the CPU by the clock. docs/performance.md says what each contender reads
and what each key means.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torchvision
from omegaconf import DictConfig

from mlcls.bench.harness import check_names, host
from mlcls.bench.pipeline_bench import JpegFolder, jpeg_files, pack_shards
from mlcls.bench.step_bench import RepeatedBatches, synthetic_batch, temporary_trainer, trainer_fields
from mlcls.data import build_backend_transform
from mlcls.data.loader import (
    PREFETCH_FACTOR,
    DevicePrefetcher,
    available_cpus,
    build_train_loader,
    loader_workers,
)
from mlcls.data.pipeline.gpu import input_stage_bytes
from mlcls.data.shards.datasets import open_shards
from mlcls.engine.trainer import Trainer
from mlcls.errors import ConfigError

log = logging.getLogger("mlcls")
T = TypeVar("T")

BACKENDS = ("fast", "gpu", "torchvision", "dali", "shards", "shards_gpu")
# The fewest timed steps of a steady-state figure: a timed span of several seconds at a GPU's step rate.
MIN_TIMED_STEPS = 100
# Finished batches a device prefetcher may hold beyond the loader's buffer (a producer stays up to two ahead).
DEVICE_AHEAD = 2
# Batches of the input stage alone whose peak GPU memory is measured (CUDA).
MEMORY_BATCHES = 3
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class SteadyStatePlan:
    """One contender's epoch: ``warmup`` untimed steps, then ``steps`` timed ones; ``buffer`` the batches its
    loader keeps ready; ``note`` how the plan falls short of the steady-state rule (None: it follows it)."""

    buffer: int
    warmup: int
    steps: int
    note: str | None

    @property
    def steady(self) -> bool:
        return self.note is None


def steady_state_plan(
    workers: int, prefetch_factor: int, steps: int | None = None, warmup: int | None = None
) -> SteadyStatePlan:
    """The steady-state rule for a loader of ``workers`` processes, each keeping ``prefetch_factor`` batches
    ready: the warm-up drains what they buffer at an epoch's start and what a device prefetcher holds beyond
    it (``workers x prefetch_factor + DEVICE_AHEAD`` steps), then :data:`MIN_TIMED_STEPS` steps are timed.

    ``steps`` and ``warmup``, when given, replace the rule's numbers (tests, quick looks); the plan's ``note``
    then says where they fall short of it. :class:`ConfigError` for fewer than one step of either.
    """
    buffer = workers * prefetch_factor
    drained = buffer + DEVICE_AHEAD
    warmup = drained if warmup is None else warmup
    steps = MIN_TIMED_STEPS if steps is None else steps
    if warmup < 1 or steps < 1:
        raise ConfigError(f"--warmup {warmup} --steps {steps}; expected at least 1 of each")
    short = []
    if warmup < drained:
        short.append(
            f"{warmup} warm-up steps, fewer than the {drained} that drain the loader's buffer "
            f"({workers} workers x {prefetch_factor} batches, + {DEVICE_AHEAD} on the device)"
        )
    if steps < MIN_TIMED_STEPS:
        short.append(f"{steps} timed steps, fewer than {MIN_TIMED_STEPS}")
    return SteadyStatePlan(buffer, warmup, steps, "; ".join(short) or None)


def step_gaps(marks: Sequence[tuple[T, T]], elapsed: Callable[[T, T], float]) -> list[float]:
    """For the ``(start, end)`` marks of consecutive steps: the time from each step's end to the next step's
    start (``elapsed(earlier, later)``), one fewer than the marks."""
    return [elapsed(previous[1], current[0]) for previous, current in itertools.pairwise(marks)]


def idle_share(marks: Sequence[tuple[T, T]], elapsed: Callable[[T, T], float]) -> float:
    """The share of the span from the end of the first marked step to the end of the last during which no
    step ran: the sum of :func:`step_gaps` over that span."""
    return sum(step_gaps(marks, elapsed)) / elapsed(marks[0][1], marks[-1][1])


@dataclasses.dataclass(frozen=True)
class EpochTiming:
    """One contender's timed steps: ``seconds`` in all; the main thread's seconds per batch between a step's
    return and the next step's call (the next batch and the loop's bookkeeping: ``host_s``) and inside the
    step (queueing it: ``step_host_s``); on CUDA the share of the span the compute stream had no step queued
    (``gpu_idle_share``) and the peak reserved memory of the epoch (``reserved_bytes``)."""

    seconds: float
    host_s: float
    step_host_s: float
    gpu_idle_share: float | None = None
    reserved_bytes: float | None = None


def mean_timing(timings: Sequence[EpochTiming]) -> EpochTiming:
    """Each field's mean over ``timings`` (None where they have none)."""
    fields = [field.name for field in dataclasses.fields(EpochTiming)]
    values = [[getattr(timing, name) for timing in timings] for name in fields]
    return EpochTiming(*(None if None in column else statistics.fmean(column) for column in values))


def _empty_peaks(device: torch.device) -> None:
    """Free the allocator's cached blocks and reset its peaks, so that the next peak is the next work's."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def timed_epoch(trainer: Trainer, loader: Any, plan: SteadyStatePlan) -> EpochTiming:
    """:class:`EpochTiming` of the last ``plan.steps`` steps of one epoch of ``plan.warmup + plan.steps``
    steps of the trainer's own loop (``Trainer.train_one_epoch``) over ``loader``."""
    trainer.data.train_loader, trainer.iters_per_epoch = loader, plan.warmup + plan.steps
    device, step = trainer.device, trainer.train_step
    cuda = device.type == "cuda"
    clock: list[tuple[float, float]] = []  # the host's clock at each step's call and return
    events: list[tuple[Any, Any]] = []  # on CUDA, events on the current stream before and after each step

    def marked_step(*batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        called = time.perf_counter()
        if cuda:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        out = step(*batch)
        if cuda:
            events[-1][1].record()
        clock.append((called, time.perf_counter()))
        return out

    if cuda:
        _empty_peaks(device)
    trainer.train_step = marked_step  # type: ignore[method-assign]
    try:
        trainer.train_one_epoch(0)
    finally:
        del trainer.train_step
    if len(clock) != plan.warmup + plan.steps:
        raise ConfigError(f"the loader gave {len(clock)} batches; {plan.warmup + plan.steps} expected")
    timed = clock[plan.warmup - 1 :]  # from the end of the last warm-up step
    host_s = statistics.fmean(step_gaps(timed, lambda earlier, later: later - earlier))
    step_host_s = statistics.fmean(end - start for start, end in timed[1:])
    if not cuda:
        return EpochTiming(timed[-1][1] - timed[0][1], host_s, step_host_s)
    events[-1][1].synchronize()
    marks = events[plan.warmup - 1 :]
    seconds = marks[0][1].elapsed_time(marks[-1][1]) / 1000.0
    idle = idle_share(marks, lambda earlier, later: earlier.elapsed_time(later))
    return EpochTiming(seconds, host_s, step_host_s, idle, torch.cuda.max_memory_reserved(device))


def input_stage_memory(trainer: Trainer, loader: Any) -> dict[str, float]:
    """MiB that ``loader``'s input stage alone (no step) adds on CUDA over :data:`MEMORY_BATCHES` batches
    through the trainer's prefetcher, each dropped as the next arrives: its peak allocated
    (``input_alone_allocated_mib``) and reserved (``input_alone_reserved_mib``) memory."""
    device = trainer.device
    _empty_peaks(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    loader.sampler.set_epoch(1)
    batches = iter(DevicePrefetcher(loader, trainer.device_stage))
    try:
        for _ in range(MEMORY_BATCHES):
            next(batches)
    finally:
        getattr(batches, "close", lambda: None)()
    torch.cuda.synchronize(device)
    return {
        "input_alone_allocated_mib": (torch.cuda.max_memory_allocated(device) - allocated) / MIB,
        "input_alone_reserved_mib": (torch.cuda.max_memory_reserved(device) - reserved) / MIB,
    }


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


def contender_figures(
    timing: EpochTiming,
    plan: SteadyStatePlan,
    batch_size: int,
    gpu_only: EpochTiming | None,
    alone: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One contender's figures (docs/performance.md, ``e2e``); ``gpu_only``: the reference's timing (None:
    this is the reference, which holds no loader buffer); ``alone``: its :func:`input_stage_memory`."""
    rate = plan.steps * batch_size / timing.seconds
    reference_rate = rate if gpu_only is None else plan.steps * batch_size / gpu_only.seconds
    reserved = None if timing.reserved_bytes is None else timing.reserved_bytes / MIB
    input_reserved = None
    if gpu_only is not None and reserved is not None and gpu_only.reserved_bytes is not None:
        input_reserved = reserved - gpu_only.reserved_bytes / MIB
    return {
        "images_per_s": rate,
        "share": rate / reference_rate,
        "steps": plan.steps,
        "warmup_steps": plan.warmup,
        "buffer_batches": 0 if gpu_only is None else plan.buffer,
        "host_ms_per_batch": 1000.0 * timing.host_s,
        "step_host_ms_per_batch": 1000.0 * timing.step_host_s,
        "gpu_idle_share": timing.gpu_idle_share,
        "reserved_mib": reserved,
        "input_reserved_mib": input_reserved,
        "input_alone_reserved_mib": None,
        "input_alone_allocated_mib": None,
        **(alone or {}),
    }


def run(
    cfg: DictConfig,
    backends: Sequence[str],
    images: str | None = None,
    count: int = 512,
    jpeg_size: tuple[int, int] = (640, 480),
    steps: int | None = None,
    warmup: int | None = None,
    max_side: int = 320,
) -> dict[str, Any]:
    """Images/s of the trainer's loop on device-resident batches and fed by each of ``backends``, each
    backend's share of the former and the figures of :func:`contender_figures` (see the module docstring),
    for the training config ``cfg``. A plan short of the steady-state rule is warned about and marked
    (``steady_state``: false, ``steady_state_note``)."""
    check_names("--backends", list(backends), BACKENDS)
    workers = loader_workers(int(cfg.trainer.workers))
    plan = steady_state_plan(workers, PREFETCH_FACTOR, steps, warmup)
    if not plan.steady:
        log.warning("mlcls-bench e2e: not a steady-state figure: %s", plan.note)
    with temporary_trainer(cfg) as (trainer, tmp):
        paths = jpeg_files(images, count, jpeg_size, tmp / "jpegs")
        cfg, device, batch_size = trainer.cfg, trainer.device, trainer.data.local_batch
        samples = (plan.warmup + plan.steps) * batch_size
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

        def resident_epoch() -> EpochTiming:
            return timed_epoch(trainer, RepeatedBatches(resident, plan.warmup + plan.steps), plan)

        timings, memory, gpu_only = {}, {}, [resident_epoch()]  # the first also compiles and autotunes
        for backend in backends:
            loader = _loader(backend, trainer, paths, samples, shard_urls)
            timings[backend] = timed_epoch(trainer, loader, plan)
            if device.type == "cuda":
                memory[backend] = input_stage_memory(trainer, loader)
            trainer.data.train_loader = loader = None
            gc.collect()  # the loader's persistent workers end here, before the next loader's start
        gpu_only.append(resident_epoch())
        reference = mean_timing(gpu_only)
        contenders = {"gpu_only": contender_figures(reference, plan, batch_size, None)}
        for backend in backends:
            contenders[backend] = contender_figures(
                timings[backend], plan, batch_size, reference, memory.get(backend)
            )
        seconds = {name: timing.seconds for name, timing in [*timings.items(), ("gpu_only", reference)]}
        return {
            "gpu_only_images_per_s": contenders["gpu_only"]["images_per_s"],
            **{f"{name}_images_per_s": contenders[name]["images_per_s"] for name in backends},
            **{f"{name}_share": contenders[name]["share"] for name in backends},
            "contenders": contenders,
            "gpu_only_runs_images_per_s": [plan.steps * batch_size / timing.seconds for timing in gpu_only],
            "seconds": seconds,
            "images": plan.steps * batch_size,
            "backends": list(backends),
            "steady_state": plan.steady,
            "steady_state_note": plan.note,
            "warmup_steps": plan.warmup,
            "steps": plan.steps,
            "buffer_batches": plan.buffer,
            "prefetch_factor": PREFETCH_FACTOR,
            "workers": workers,
            "jpegs": {
                "source": images or "generated",
                "files": len(paths),
                "mean_kib": float(np.mean([p.stat().st_size for p in paths]) / 1024),
            },
            "gpu_input_bound_mib": input_stage_bytes(batch_size, size) / MIB,
            **trainer_fields(trainer),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            **host(),
            "cpus": available_cpus(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
        }


# The columns of contender_table: key, heading, format.
COLUMNS = (
    ("images_per_s", "images/s", "{:,.1f}"),
    ("share", "share", "{:.3f}"),
    ("steps", "timed steps", "{}"),
    ("buffer_batches", "buffer", "{}"),
    ("host_ms_per_batch", "host ms/batch", "{:.2f}"),
    ("step_host_ms_per_batch", "step host ms", "{:.2f}"),
    ("gpu_idle_share", "GPU idle", "{:.3f}"),
    ("reserved_mib", "reserved MiB", "{:,.0f}"),
    ("input_reserved_mib", "input reserved MiB", "{:,.0f}"),
    ("input_alone_reserved_mib", "alone reserved MiB", "{:,.0f}"),
    ("input_alone_allocated_mib", "alone allocated MiB", "{:,.0f}"),
)


def contender_table(result: dict[str, Any]) -> str:
    """The contenders of an ``e2e`` result as a Markdown table, a figure the run has none of (the CUDA-only
    ones on the CPU) as ``n/a``, after a line saying whether the plan was the steady-state rule's."""
    steady = "steady state" if result["steady_state"] else f"NOT steady state: {result['steady_state_note']}"
    lines = [
        f"{result['warmup_steps']} warm-up + {result['steps']} timed steps of {result['batch_size']}, "
        f"{result['workers']} workers x {result['prefetch_factor']} batches buffered ({steady})",
        "",
        "| contender | " + " | ".join(heading for _, heading, _ in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for name, figures in result["contenders"].items():
        cells = ["n/a" if figures.get(key) is None else form.format(figures[key]) for key, _, form in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options of ``mlcls-bench e2e``."""
    parser.add_argument("overrides", nargs="*", help="config overrides, as for mlcls-train")
    parser.add_argument(
        "--backends", default="fast,gpu,torchvision", help=f"comma-separated, of {', '.join(BACKENDS)}"
    )
    parser.add_argument("--images", help="folder of JPEGs (default: --count generated JPEGs)")
    parser.add_argument("--count", type=int, default=512, help="JPEGs to generate (cycled over)")
    parser.add_argument("--jpeg-size", default="640x480", help="WIDTHxHEIGHT of the generated JPEGs")
    parser.add_argument(
        "--steps", type=int, default=MIN_TIMED_STEPS, help="timed steps per contender (fewer: not steady)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help=f"steps before the timed ones (default: workers x {PREFETCH_FACTOR} + {DEVICE_AHEAD}; fewer: "
        "not steady)",
    )
    parser.add_argument("--max-side", type=int, default=320, help="long side of the packed images (shards)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark ``args`` ask for, on the training config ``args.cfg`` (of ``args.overrides``); its
    :func:`contender_table` goes to stderr."""
    try:
        width, height = (int(v) for v in args.jpeg_size.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--jpeg-size {args.jpeg_size!r}; expected WIDTHxHEIGHT, e.g. 640x480") from None
    backends = [name for name in args.backends.split(",") if name]
    size = (width, height)
    result = run(args.cfg, backends, args.images, args.count, size, args.steps, args.warmup, args.max_side)
    print(contender_table(result), file=sys.stderr, flush=True)
    return result
