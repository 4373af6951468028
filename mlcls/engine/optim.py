"""Optimizer with separate head/backbone learning rates, and the per-iteration cosine schedule."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mlcls.models import split_parameters

OPTIMIZERS = ("sgd", "adamw")


def build_optimizer(cfg: Mapping[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """Two parameter groups: the classifier head at ``lr_head``, the rest at ``lr_backbone``.

    Group 0 is the head, group 1 the backbone (``model.get_classifier()`` decides which is which).
    """
    name = cfg["name"]
    head, backbone = split_parameters(model)
    groups = [{"params": head, "lr": cfg["lr_head"]}, {"params": backbone, "lr": cfg["lr_backbone"]}]
    if name == "sgd":
        return torch.optim.SGD(
            groups,
            lr=cfg["lr_head"],
            momentum=cfg.get("momentum", 0.9),
            nesterov=cfg.get("nesterov", True),
            weight_decay=cfg["weight_decay"],
        )
    if name == "adamw":
        return torch.optim.AdamW(
            groups,
            lr=cfg["lr_head"],
            betas=tuple(cfg.get("betas", (0.9, 0.999))),
            weight_decay=cfg["weight_decay"],
        )
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")


def cosine_factor(
    iteration: int, total_iters: int, warmup_iters: int = 0, min_lr_ratio: float = 0.0
) -> float:
    """Learning-rate multiplier: linear warm-up from 0, then cosine from 1 down to ``min_lr_ratio``."""
    if iteration < warmup_iters:
        return (iteration + 1) / warmup_iters
    progress = (iteration - warmup_iters) / max(1, total_iters - warmup_iters)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(
    cfg: Mapping[str, Any], optimizer: torch.optim.Optimizer, total_iters: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Cosine schedule stepped every iteration (the paper's), with optional warm-up."""
    if cfg["name"] != "cosine":
        raise ValueError(f"unknown schedule {cfg['name']!r}; expected cosine")
    warmup, floor = int(cfg.get("warmup_iters", 0)), float(cfg.get("min_lr_ratio", 0.0))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: cosine_factor(it, total_iters, warmup, floor)
    )
