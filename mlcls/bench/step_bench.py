"""``mlcls-bench step``: images/s of the trainer against a bare hand-written PyTorch loop, side by side.

``--loop epoch`` times ``Trainer.train_one_epoch``, ``--loop step`` ``Trainer.train_step``, against the bare
step below with the same model architecture, optimizer, loss, AMP mode, memory format and
``trainer.compile``, on the same synthetic batches; timed blocks alternate. ``--heads`` times instead the
bare step of each classifier head on one backbone, with each of ``--losses``. docs/performance.md says what
the trainer adds::

    logits = model(images)          # under autocast for trainer.amp=bf16/fp16 on CUDA
    loss = criterion(logits.float(), targets)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()   # a GradScaler as the trainer's (it skips non-finite steps)
    scaler.step(optimizer)
    scaler.update()
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from mlcls.bench.harness import (
    check_names,
    host,
    median_seconds,
    mmap_allocations,
    peak_bytes,
    random_labels,
    run_with_options,
)
from mlcls.bench.loss_bench import loss_classes
from mlcls.engine.build import build_loss, build_model, build_optimization
from mlcls.engine.distributed import resolve_device
from mlcls.engine.evaluate import autocast_context
from mlcls.engine.trainer import Trainer
from mlcls.models.heads import HEADS

LOOPS = ("epoch", "step")


@contextlib.contextmanager
def temporary_trainer(cfg: DictConfig) -> Iterator[tuple[Trainer, Path]]:
    """A :class:`Trainer` of ``cfg`` writing into a temporary directory (also given), removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp) / "run")
        try:
            yield trainer, Path(tmp)
        finally:
            trainer.run_log.close()


def plain_step_fn(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scaler: torch.amp.GradScaler,
    amp: str,
    channels_last: bool,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The bare step of the module docstring for ``model`` (called through ``forward``); returns the loss."""
    device = next(model.parameters()).device
    model.train()

    def step(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast_context(device, amp):
            logits = forward(images)
        loss = criterion(logits.float(), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    return step


def synthetic_batch(
    batch_size: int, image_size: int, num_classes: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Normalised-looking float images (B, 3, S, S) and {0, 1} targets (B, C) with ~3 positives per row."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    return images, random_labels(batch_size, num_classes, 3, generator)


class RepeatedBatches:
    """``steps`` times the same batch, as a training loader (``len()``, a ``sampler`` with ``set_epoch`` and
    ``set_start``), so that the whole epoch loop runs without data loading."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> None:
        self.batch, self.steps = batch, steps
        self.sampler = SimpleNamespace(set_epoch=lambda epoch: None, set_start=lambda start: None)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.batch for _ in range(self.steps))


def run(
    cfg: DictConfig, repeats: int = 5, steps: int = 3, warmup: int = 2, loop: str = "epoch"
) -> dict[str, Any]:
    """Median seconds per step of the trainer and the bare loop, as images/s, and their ratio, for the
    training config ``cfg`` (run in a temporary directory)."""
    if loop not in LOOPS:
        raise ValueError(f"--loop {loop!r}; expected one of {', '.join(LOOPS)}")
    with temporary_trainer(cfg) as (trainer, _):
        cfg, device, batch_size = trainer.cfg, trainer.device, trainer.data.local_batch
        batch = synthetic_batch(batch_size, int(cfg.dataset.image_size), len(trainer.classes))
        if device.type == "cuda":
            batch = tuple(tensor.pin_memory() for tensor in batch)
        torch.manual_seed(cfg.trainer.seed)  # the bare side: a fresh model of the same architecture
        model = build_model(cfg.model, len(trainer.classes), device, trainer.channels_last)
        optimizer, _ = build_optimization(cfg, model, trainer.iters_per_epoch)
        criterion = build_loss(cfg.loss, trainer.data.train_set, device)
        forward = torch.compile(model) if cfg.trainer.get("compile", False) else model
        scaler = torch.amp.GradScaler(device.type, init_scale=trainer.scaler.get_scale())
        bare = plain_step_fn(model, forward, optimizer, criterion, scaler, trainer.amp, trainer.channels_last)
        contenders: dict[str, Callable[[], torch.Tensor]]
        if loop == "step":

            def trainer_step(*batch: torch.Tensor) -> torch.Tensor:
                return trainer.train_step(*trainer.device_stage.finish(batch))[0]  # moved as bare moves it

            contenders = {"trainer": partial(_repeat_step, trainer_step, batch, steps)}
        else:
            trainer.data.train_loader, trainer.iters_per_epoch = RepeatedBatches(batch, steps), steps
            contenders = {"trainer": lambda: torch.tensor(trainer.train_one_epoch(0)["loss"])}
        contenders["bare"] = partial(_repeat_step, bare, batch, steps)
        trainer.ddp_model.train()
        step_s = median_step_seconds(contenders, device, repeats, steps, warmup)
        return {
            "loop": loop,
            "trainer_images_per_s": batch_size / step_s["trainer"],
            "bare_images_per_s": batch_size / step_s["bare"],
            "trainer_step_s": step_s["trainer"],
            "bare_step_s": step_s["bare"],
            "overhead": step_s["trainer"] / step_s["bare"] - 1.0,
            **trainer_fields(trainer),
            "repeats": repeats,
            "steps": steps,
            **host(),
        }


def trainer_fields(trainer: Trainer) -> dict[str, Any]:
    """The settings of ``trainer`` its speed depends on, for a benchmark's result."""
    return {
        "model": trainer.cfg.model.name,
        "batch_size": trainer.data.local_batch,
        "image_size": int(trainer.cfg.dataset.image_size),
        "amp": trainer.amp,
        "channels_last": trainer.channels_last,
        "compile": bool(trainer.cfg.trainer.get("compile", False)),
        "device": str(trainer.device),
    }


def median_step_seconds(
    contenders: dict[str, Callable[[], torch.Tensor]],
    device: torch.device,
    repeats: int,
    steps: int,
    warmup: int,
) -> dict[str, float]:
    """Median seconds per step of each contender, a block of ``steps`` steps returning its last loss
    (:func:`~mlcls.bench.harness.median_seconds`; the ``warmup`` blocks: compilation, allocator and cuDNN
    autotuning). A non-finite loss raises :class:`FloatingPointError`."""

    def checked(name: str) -> Callable[[], None]:
        def block() -> None:
            loss = contenders[name]()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{name}: non-finite loss {loss.item()}; lower the learning rate")

        return block

    seconds = median_seconds({name: checked(name) for name in contenders}, repeats, warmup, device)
    return {name: value / steps for name, value in seconds.items()}


def run_heads(
    cfg: DictConfig,
    heads: Sequence[str] = HEADS,
    num_classes: int = 80,
    repeats: int = 5,
    steps: int = 3,
    warmup: int = 2,
    losses: Sequence[str] = ("bce",),
    memory: bool = False,
) -> dict[str, Any]:
    """Median seconds per bare training step of each of ``heads`` on the backbone of the training config
    (``model.name``, ``dataset.image_size``, ``trainer.batch_size``, ``trainer.amp``, ``optim``), with
    ``num_classes`` outputs (``<head>_step_s``), as images/s, and relative to the first head's
    (``<head>_relative``). Each head trains with each of ``losses`` (their defaults), under the name
    ``<head>_<loss>`` where there are several. The memory of each head's parameters
    (``<head>_head_parameters_mib``; its gradients, AdamW moments and an EMA copy take as much again each);
    with ``memory``, the peak one more step adds (``<head>_step_peak_mib``: activations, gradients,
    temporaries; :func:`peak_bytes`, on the CPU on Linux or on CUDA)."""
    check_names("--heads", list(heads), HEADS)
    check_names("--losses", list(losses), tuple(loss_classes()))
    device = resolve_device(cfg.trainer.device)
    amp = cfg.trainer.amp if device.type == "cuda" else "none"
    channels_last = bool(cfg.trainer.channels_last) and device.type == "cuda"
    batch = synthetic_batch(int(cfg.trainer.batch_size), int(cfg.dataset.image_size), num_classes)
    bare_steps, head_bytes = {}, {}
    for head in heads:
        for loss in losses:
            name = head if len(losses) == 1 else f"{head}_{loss}"
            torch.manual_seed(cfg.trainer.seed)
            model = build_model(cfg.model, num_classes, device, channels_last, head=head, pretrained=False)
            head_bytes[name] = sum(p.numel() * p.element_size() for p in model.get_classifier().parameters())
            optimizer, _ = build_optimization(cfg, model, iters_per_epoch=1)
            scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
            criterion = loss_classes()[loss]().to(device)
            bare_steps[name] = plain_step_fn(model, model, optimizer, criterion, scaler, amp, channels_last)
    contenders = {name: partial(_repeat_step, step, batch, steps) for name, step in bare_steps.items()}
    step_s = median_step_seconds(contenders, device, repeats, steps, warmup)
    first = step_s[next(iter(bare_steps))]
    measure_memory = memory and (device.type == "cuda" or sys.platform == "linux")
    if device.type == "cpu" and measure_memory:
        mmap_allocations()  # after the timings, which it would slow down
    timings = {}
    for name, seconds in step_s.items():
        timings[f"{name}_step_s"] = seconds
        timings[f"{name}_images_per_s"] = len(batch[0]) / seconds
        timings[f"{name}_relative"] = seconds / first
        timings[f"{name}_head_parameters_mib"] = head_bytes[name] / 2**20
        if measure_memory:
            one_step = partial(bare_steps[name], *batch)
            timings[f"{name}_step_peak_mib"] = peak_bytes(one_step, device) / 2**20
    return {
        **timings,
        "model": cfg.model.name,
        "classes": num_classes,
        "batch_size": len(batch[0]),
        "image_size": int(cfg.dataset.image_size),
        "amp": amp,
        "device": str(device),
        "repeats": repeats,
        "steps": steps,
        **host(),
    }


def _repeat_step(step: Callable, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> torch.Tensor:
    for _ in range(steps):
        loss = step(*batch)
    return loss


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options of ``mlcls-bench step``."""
    parser.add_argument("overrides", nargs="*", help="config overrides, as for mlcls-train")
    parser.add_argument(
        "--loop", choices=LOOPS, default="epoch", help="the whole epoch loop, or the step function alone"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per contender")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed blocks per contender first")
    parser.add_argument(
        "--heads", help="compare the bare step of these model.head values instead, e.g. linear,mldecoder,csra"
    )
    parser.add_argument("--classes", type=int, default=80, help="outputs of the heads compared by --heads")
    parser.add_argument(
        "--losses", default="bce", help="the losses each head of --heads trains with, e.g. twoway,bce"
    )
    parser.add_argument("--memory", action="store_true", help="--heads: the peak memory of a step too")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark ``args`` ask for, on the training config ``args.cfg`` (of ``args.overrides``)."""
    if args.heads:
        heads, losses = args.heads.split(","), args.losses.split(",")
        options = (args.classes, args.repeats, args.steps, args.warmup, losses, args.memory)
        return run_heads(args.cfg, heads, *options)
    return run_with_options(run, args)
