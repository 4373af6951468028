"""Benchmark: images/s of ``Trainer.train_step`` against a bare hand-written PyTorch loop, side by side.

Both run on the same synthetic batch (no data loading), with the same model architecture, optimizer,
loss, AMP mode, memory format and ``trainer.compile`` setting, built from the same config. The bare loop is
the minimum a training step needs::

    logits = model(images)          # under autocast for trainer.amp=bf16/fp16 on CUDA
    loss = criterion(logits.float(), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()                 # through a GradScaler for fp16
    optimizer.step()

The trainer's step adds gradient clipping with its finite check, EMA, the GradScaler bookkeeping and the
scheduler. Timed blocks of ``steps`` steps alternate between the two (order swapped every repeat).

``python -m mlcls.bench.step_bench [overrides ...] [--repeats 5] [--steps 3]``, e.g.
``model.name=resnet50 dataset.image_size=224 trainer.batch_size=32 trainer.amp=bf16 trainer.compile=true``.
The dataset config only sets the image size and the class count (the default synthetic one needs no
files). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from mlcls.cli.overrides import compose_config
from mlcls.engine.evaluate import autocast_context
from mlcls.engine.optim import build_optimizer
from mlcls.engine.trainer import Trainer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_step_fn(cfg: DictConfig, trainer: Trainer) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A hand-written training step with a fresh model of the same architecture, optimizer and loss."""
    device, amp = trainer.device, trainer.amp
    torch.manual_seed(cfg.trainer.seed)
    model: nn.Module = instantiate(cfg.model, num_classes=len(trainer.classes)).to(device)
    if trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(cfg.optim, model)
    criterion = instantiate(cfg.loss)
    if hasattr(criterion, "setup"):
        criterion.setup(trainer.train_set.labels)
    forward = torch.compile(model) if cfg.trainer.get("compile", False) else model
    scaler = torch.amp.GradScaler("cuda", enabled=amp == "fp16")
    model.train()

    def step(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if trainer.channels_last:
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
    targets = (torch.rand(batch_size, num_classes, generator=generator) < min(0.5, 3 / num_classes)).float()
    return images, targets


def run(overrides: Sequence[str] = (), repeats: int = 5, steps: int = 3, warmup: int = 2) -> dict[str, Any]:
    """Median seconds per step of the trainer and the bare loop, as images/s, and their ratio."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose_config("train", [*overrides, f"trainer.output_dir={run_dir}"])
        trainer = Trainer(cfg)
        try:
            return _measure(cfg, trainer, repeats, steps, warmup)
        finally:
            if trainer.writer is not None:
                trainer.writer.close()


def _measure(cfg: DictConfig, trainer: Trainer, repeats: int, steps: int, warmup: int) -> dict[str, Any]:
    images, targets = synthetic_batch(trainer.local_batch, int(cfg.dataset.image_size), len(trainer.classes))
    if trainer.cuda:
        images, targets = images.pin_memory(), targets.pin_memory()
    bare = bare_step_fn(cfg, trainer)
    trainer.ddp_model.train()
    contenders: dict[str, Callable] = {"trainer": lambda: trainer.train_step(images, targets)[0]}
    contenders["bare"] = lambda: bare(images, targets)
    for _ in range(warmup):  # compilation, allocator and cuDNN autotuning
        for fn in contenders.values():
            fn()
    _sync(trainer.device)
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(repeats):
        order = list(contenders) if repeat % 2 == 0 else list(contenders)[::-1]
        for name in order:
            start = time.perf_counter()
            for _ in range(steps):
                loss = contenders[name]()
            _sync(trainer.device)
            seconds[name].append((time.perf_counter() - start) / steps)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{name}: non-finite loss {loss.item()}; lower the learning rate")
    step_s = {name: statistics.median(values) for name, values in seconds.items()}
    batch = trainer.local_batch
    return {
        "trainer_images_per_s": batch / step_s["trainer"],
        "bare_images_per_s": batch / step_s["bare"],
        "trainer_step_s": step_s["trainer"],
        "bare_step_s": step_s["bare"],
        "overhead": step_s["trainer"] / step_s["bare"] - 1.0,
        "model": cfg.model.name,
        "batch_size": batch,
        "image_size": int(cfg.dataset.image_size),
        "amp": trainer.amp,
        "channels_last": trainer.channels_last,
        "compile": bool(cfg.trainer.get("compile", False)),
        "device": str(trainer.device),
        "repeats": repeats,
        "steps": steps,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options of this benchmark (shared with ``mlcls-bench step``)."""
    parser.add_argument("overrides", nargs="*", help="config overrides, as for mlcls-train")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per contender")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    # Anything the trainer prints goes to stderr: stdout holds the JSON line only.
    with contextlib.redirect_stdout(sys.stderr):
        return run(args.overrides, args.repeats, args.steps, args.warmup)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    result = run_from_args(parser.parse_args(argv))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
