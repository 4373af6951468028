"""The optimizer's parameter groups and the per-iteration schedules; both config groups are checked here.

``configs/optim/*.yaml`` are ``_partial_`` configs of a torch optimizer with its own keywords, beside
:data:`GROUP_KEYS`, taken out first: ``lr_head`` and ``lr_backbone`` (the classifier and the rest: the
paper's 0.01 and 0.001, Sec. 4.1), ``weight_decay`` and the decays of normalisation layers and other 1-D
biases (``norm_weight_decay``, ``bias_weight_decay``; null: ``weight_decay``'s, the paper's; 0.0: none).
``configs/sched/*.yaml`` are ``_partial_`` configs of ``target(optimizer, total_iters=N, **keys)``
returning an LRScheduler stepped every iteration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from mlcls.errors import ConfigError, first_line, is_integer, is_number
from mlcls.models import split_parameters

# A run of fewer iterations than this whose schedule gives less than LEARNING_SHARE_FLOOR of the learning of a
# constant rate is told so (:func:`short_run_note`): a decay anneals the end of a run that has learned, and a
# short run has little to give up. Measured (docs/report.md, "Fine-tuning from ImageNet weights"): a 12-epoch
# fine-tune of 84 iterations under the cosine to zero (51 % of a constant rate's learning) scored 7 points of
# mAP below the same run holding its rate until a late decay (87 %); a constant rate was still gaining then.
SHORT_RUN_ITERS = 1000
LEARNING_SHARE_FLOOR = 0.6
GROUP_KEYS = ("lr_head", "lr_backbone", "weight_decay", "norm_weight_decay", "bias_weight_decay")
PARTS = ("head", "backbone")
KINDS = ("weight", "norm", "bias")  # "weight": every parameter that is neither of the other two

# torch's normalisation layers; timm's LayerNorm2d, GroupNorm1, BatchNormAct2d, ... subclass them
TORCH_NORM_LAYERS = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*
    nn.GroupNorm,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
)


def is_norm_layer(module: nn.Module) -> bool:
    """One of torch's normalisation layers, or a module named ``*Norm*`` whose parameters are all its own
    vectors (timm's RmsNorm, EvoNorm, ...; not a container such as ``ConvNormAct``)."""
    if isinstance(module, TORCH_NORM_LAYERS):
        return True
    own = list(module.parameters(recurse=False))
    return (
        "Norm" in type(module).__name__
        and len(own) == len(list(module.parameters()))
        and bool(own)
        and all(p.ndim <= 1 for p in own)
    )


def parameter_kinds(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> kind``: "norm" (a normalisation layer's), "bias" (other 1-D parameters whose name
    ends in ``bias``: ``bias``, ML-Decoder's ``duplicate_pooling_bias``, ViTs' ``q_bias``) or "weight" (the
    rest)."""
    kinds: dict[int, str] = {}
    for module in model.modules():
        norm = is_norm_layer(module)
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in kinds:  # a shared parameter keeps the kind of its first owner
                kinds[id(param)] = (
                    "norm" if norm else "bias" if name.endswith("bias") and param.ndim == 1 else "weight"
                )
    return kinds


def _settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def parameter_groups(model: nn.Module, cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The optimizer's parameter groups of ``model`` from the group keys of ``cfg``: head, then backbone;
    within a part one non-empty group per decay, ``weight_decay``'s first (with null norm/bias decays two
    groups, as in the paper), named by the part (the weights') or part and kinds (``backbone_norm_bias``).
    """
    decay = {
        "weight": cfg["weight_decay"],
        "norm": cfg["weight_decay"] if cfg.get("norm_weight_decay") is None else cfg["norm_weight_decay"],
        "bias": cfg["weight_decay"] if cfg.get("bias_weight_decay") is None else cfg["bias_weight_decay"],
    }
    by_decay: dict[float, list[str]] = {}  # decay -> kinds sharing it; the weights' value first
    for kind in KINDS:
        by_decay.setdefault(decay[kind], []).append(kind)
    kinds = parameter_kinds(model)
    groups = []
    for part, params in zip(PARTS, split_parameters(model), strict=True):
        for value, shared in by_decay.items():
            members = [p for p in params if kinds[id(p)] in shared]
            if members:
                name = part if "weight" in shared else "_".join((part, *shared))
                groups.append(
                    {"params": members, "lr": cfg[f"lr_{part}"], "weight_decay": value, "name": name}
                )
    return groups


def _build(group: str, settings: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    """``settings``, a ``_partial_`` config of ``group``, instantiated and called with the arguments; an
    error is a ConfigError naming the target, with the first line of the innermost error."""
    if settings.get("_partial_") is not True:
        raise ConfigError(f"{group}._partial_ must be true: {group}._target_ is called by the trainer")
    try:
        return instantiate(settings, _convert_="all")(*args, **kwargs)
    except Exception as exc:
        innermost = exc
        while innermost.__cause__ is not None:
            innermost = innermost.__cause__
        raise ConfigError(f"{group}._target_={settings.get('_target_')}: {first_line(innermost)}") from None


def build_optimizer(
    cfg: Mapping[str, Any], model: nn.Module, loss_groups: Sequence[Mapping[str, Any]] = ()
) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` over :func:`parameter_groups`, then the ``loss_groups`` of a loss with
    learnable state (dicts of ``params``, ``name``, ``lr_scale``: at ``lr_scale * lr_head``, no decay).
    A resumed state's groups are checked against these by
    :func:`mlcls.engine.state.check_optimizer`."""
    settings = _settings(cfg)
    for key in GROUP_KEYS:
        value = settings.pop(key, None)
        if value is None and key in ("norm_weight_decay", "bias_weight_decay"):
            continue
        if not is_number(value) or value < 0:
            kind = "a number >= 0, or null for weight_decay's" if "_weight_decay" in key else "a number >= 0"
            raise ConfigError(f"optim.{key}={value!r}; expected {kind}")
    extra = [
        {"params": list(g["params"]), "lr": g["lr_scale"] * cfg["lr_head"], "weight_decay": 0.0,
         "name": g["name"]}
        for g in loss_groups
    ]  # fmt: skip
    optimizer = _build("optim", settings, parameter_groups(model, cfg) + extra)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optim._target_={settings.get('_target_')} is not a torch optimizer class")
    return optimizer


def group_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Current learning rate of each part with parameters, ``{"head": lr, "backbone": lr}``."""
    lrs: dict[str, float] = {}
    for group in optimizer.param_groups:
        lrs.setdefault(group["name"].split("_")[0], group["lr"])
    return lrs


def cosine_factor(
    iteration: int,
    total_iters: int,
    warmup_iters: int = 0,
    min_lr_ratio: float = 0.0,
    decay_start: float = 0.0,
) -> float:
    """Learning-rate multiplier at 0-based ``iteration``: with ``W = warmup_iters``, the linear warm-up
    ``(iteration + 1) / W`` for the first W iterations, then 1 until
    ``D = W + round(decay_start (total_iters - W))``, then the cosine decay
    ``r + (1 - r) (1 + cos(pi p)) / 2`` with ``r = min_lr_ratio`` and progress
    ``p = min(1, (iteration - D) / max(1, total_iters - D))``; ``decay_start`` 0 is the paper's cosine."""
    if iteration < warmup_iters:
        return (iteration + 1) / warmup_iters
    decay_from = warmup_iters + round(decay_start * (total_iters - warmup_iters))
    if iteration < decay_from:
        return 1.0
    progress = (iteration - decay_from) / max(1, total_iters - decay_from)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def cosine_schedule(
    optimizer: torch.optim.Optimizer,
    total_iters: int,
    warmup_iters: int = 0,
    min_lr_ratio: float = 0.0,
    decay_start: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Each group's lr times :func:`cosine_factor`, stepped every iteration (the paper's schedule with the
    defaults; experiment=finetune holds the rate until a late ``decay_start``)."""
    if not is_integer(warmup_iters) or warmup_iters < 0:
        raise ValueError(f"warmup_iters={warmup_iters!r}; expected an integer >= 0")
    for key, value in (("min_lr_ratio", min_lr_ratio), ("decay_start", decay_start)):
        if not is_number(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{key}={value!r}; expected a number in [0, 1]")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: cosine_factor(it, total_iters, warmup_iters, min_lr_ratio, decay_start)
    )


def onecycle_schedule(
    optimizer: torch.optim.Optimizer,
    total_iters: int,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1.0e4,
    anneal_strategy: str = "cos",
    cycle_momentum: bool = True,
) -> torch.optim.lr_scheduler.OneCycleLR:
    """torch's ``OneCycleLR`` over ``total_iters`` iterations: from ``lr / div_factor`` up to each group's
    lr over the first ``pct_start``, then down to ``lr / (div_factor x final_div_factor)``; with
    ``cycle_momentum`` the momentum moves the opposite way (0.85 to 0.95), as ML-Decoder's recipe."""
    if not isinstance(pct_start, (int, float)) or not 0.0 < pct_start < 1.0:
        raise ValueError(f"pct_start={pct_start!r}; expected a number in (0, 1)")
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=[group["lr"] for group in optimizer.param_groups],
        total_steps=max(1, total_iters),
        pct_start=pct_start,
        div_factor=div_factor,
        final_div_factor=final_div_factor,
        anneal_strategy=anneal_strategy,
        cycle_momentum=cycle_momentum,
    )


def build_scheduler(
    cfg: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    total_iters: int,
    iters_per_epoch: int = 1,
    head_warmup_epochs: float = 0,
) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule of ``cfg`` over ``total_iters`` iterations; a ``warmup_epochs`` key (null: the head's
    ``head_warmup_epochs``) becomes ``warmup_iters = round(warmup_epochs x iters_per_epoch)``."""
    settings = _settings(cfg)
    if "warmup_epochs" in settings:
        epochs = settings.pop("warmup_epochs")
        epochs = head_warmup_epochs if epochs is None else epochs
        if not is_number(epochs) or epochs < 0:
            raise ConfigError(f"sched.warmup_epochs={epochs!r}; expected a number >= 0")
        settings["warmup_iters"] = round(epochs * iters_per_epoch)
    scheduler = _build("sched", settings, optimizer, total_iters=total_iters)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        target = settings.get("_target_")
        raise ConfigError(f"sched._target_={target} does not return a learning-rate scheduler")
    return scheduler


def learning_rates(
    cfg: Mapping[str, Any], total_iters: int, iters_per_epoch: int = 1, head_warmup_epochs: float = 0
) -> list[float]:
    """The multiplier of the peak rate at each of the ``total_iters`` iterations under the schedule of
    ``cfg`` (:func:`build_scheduler`'s arguments), read off the schedule itself on a one-parameter optimizer
    at rate 1."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0, momentum=0.9)
    scheduler = build_scheduler(cfg, probe, total_iters, iters_per_epoch, head_warmup_epochs)
    rates = []
    for _ in range(total_iters):
        rates.append(probe.param_groups[0]["lr"])
        probe.step()  # no gradient: changes nothing, and keeps torch from warning about the order of steps
        scheduler.step()
    peak = max(rates, default=1.0) or 1.0
    return [rate / peak for rate in rates]


def short_run_note(
    cfg: Mapping[str, Any], total_iters: int, iters_per_epoch: int = 1, head_warmup_epochs: float = 0
) -> str | None:
    """One line when a run of ``total_iters`` iterations is short (under :data:`SHORT_RUN_ITERS`) and its
    schedule ``cfg`` gives it less than :data:`LEARNING_SHARE_FLOOR` of the learning of a constant rate at
    its peak (the mean of :func:`learning_rates`); else None."""
    if total_iters >= SHORT_RUN_ITERS or total_iters < 1:
        return None
    rates = learning_rates(cfg, total_iters, iters_per_epoch, head_warmup_epochs)
    share = sum(rates) / total_iters
    if share >= LEARNING_SHARE_FLOOR:
        return None
    low = sum(rate < 0.25 for rate in rates)
    return (
        f"sched: over this run's {total_iters} iterations the schedule gives {share:.0%} of the learning of "
        f"a constant rate at its peak ({low} iterations below a quarter of it); a run under "
        f"{SHORT_RUN_ITERS} iterations has little to give up: experiment=finetune keeps a fine-tune's "
        "learning (warm-up, then the rate held until a late decay)"
    )
