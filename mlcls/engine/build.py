"""Everything a run is made of, built from the composed config: data, model, loss, optimizer, schedule.

Shared by the trainer, ``mlcls-eval`` and the benchmarks, so that each builds the same objects the same way.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import Dataset, Subset

from mlcls.data import MultiLabelDataset, build_dataset
from mlcls.data.datasets.labels import label_counts
from mlcls.data.loader import build_eval_loader, build_train_loader
from mlcls.engine.distributed import DistInfo
from mlcls.engine.optim import build_optimizer, build_scheduler
from mlcls.engine.validate import ConfigError

log = logging.getLogger("mlcls")


@dataclass
class RunData:
    """The two splits of a run and their loaders for this process."""

    train_set: MultiLabelDataset
    val_set: Dataset  # the validation split, or its first samples under trainer.limit_val_batches
    train_loader: Any  # a DataLoader, or the DALI loader; both have len() and .sampler
    val_loader: Any
    classes: list[str]
    iters_per_epoch: int


def pin_dataset_root(dataset_cfg: DictConfig) -> None:
    """Write ``dataset.root`` as an absolute path, resolved against the working directory now: the config
    a run saves (config.yaml, checkpoints, results.json) then finds its data from any directory, so that
    ``mlcls-eval`` and ``mlcls-predict`` work wherever they are started. A dataset without ``root`` (the
    synthetic one, shards) is left as it is."""
    root = dataset_cfg.get("root")
    if isinstance(root, str) and root:
        dataset_cfg.root = os.path.abspath(os.path.expanduser(root))


def build_data(cfg: DictConfig, dist: DistInfo) -> RunData:
    """Both splits of ``cfg.dataset`` with the ``data.backend`` pipeline, and this rank's loaders;
    ``cfg.dataset.root`` made absolute first (:func:`pin_dataset_root`), before the run saves its config."""
    pin_dataset_root(cfg.dataset)
    tcfg, backend = cfg.trainer, cfg.data.backend
    local_batch = tcfg.batch_size // dist.world_size
    train_set = build_dataset(cfg.dataset, train=True, backend=backend)
    val_set: Dataset = build_dataset(cfg.dataset, train=False, backend=backend)
    if tcfg.limit_val_batches:
        keep = min(len(val_set), tcfg.limit_val_batches * local_batch * dist.world_size)
        val_set = Subset(val_set, range(keep))
    args = (local_batch, tcfg.workers, dist.rank, dist.world_size)
    loader = build_train_loader(train_set, *args, tcfg.seed, dist.device, backend)
    iters = len(loader)
    if tcfg.limit_train_batches:
        iters = min(iters, tcfg.limit_train_batches)
    if iters == 0:
        per_process = len(train_set) // dist.world_size
        fits = dist.world_size * 2 ** int(math.log2(per_process)) if per_process else None
        hint = f"use trainer.batch_size={fits} or less" if fits else "add training samples"
        raise ConfigError(
            f"the training set has {len(train_set)} samples, fewer than one batch of {local_batch} per "
            f"process (trainer.batch_size={tcfg.batch_size} over {dist.world_size}); {hint}"
        )
    return RunData(
        train_set=train_set,
        val_set=val_set,
        train_loader=loader,
        val_loader=build_eval_loader(val_set, *args, dist.device),
        classes=list(train_set.classes),
        iters_per_epoch=iters,
    )


def build_model(
    model_cfg: DictConfig | dict[str, Any],
    num_classes: int,
    device: torch.device,
    channels_last: bool = False,
    **overrides: Any,
) -> nn.Module:
    """The ``model`` config's network with ``num_classes`` outputs on ``device`` (``overrides`` replace
    config keys, e.g. ``pretrained=False`` when a checkpoint's weights are loaded afterwards)."""
    model: nn.Module = instantiate(model_cfg, num_classes=num_classes, **overrides).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def build_loss(loss_cfg: DictConfig, train_set: Dataset, device: torch.device) -> nn.Module:
    """The ``loss`` config's criterion on ``device``, set up with the training set's label counts where it
    needs them (class-frequency weights)."""
    criterion = instantiate(loss_cfg)
    if hasattr(criterion, "setup"):
        criterion.setup(label_counts(train_set))
    return criterion.to(device)


def build_optimization(
    cfg: DictConfig, model: nn.Module, iters_per_epoch: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer of ``cfg.optim`` over ``model`` and the per-iteration schedule of ``cfg.sched``."""
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.sched, optimizer, cfg.trainer.epochs * iters_per_epoch)
    return optimizer, scheduler


def classes_without_positives(dataset: Dataset, classes: list[str]) -> list[str]:
    """Names of the classes without a single positive label in ``dataset`` (empty when it has no labels)."""
    counts = label_counts(dataset)
    if counts is None or counts.num_samples == 0:
        return []
    return [name for name, positives in zip(classes, counts.positives.tolist(), strict=True) if not positives]


def warn_unscored_classes(val_set: Dataset, classes: list[str]) -> None:
    """Say once, by name, which classes the validation split cannot score (no positive label)."""
    missing = classes_without_positives(val_set, classes)
    if missing:
        log.warning(
            "%d of %d classes have no positive in the validation split (%s): their AP is undefined and "
            "predict never reports them (no calibrated threshold)",
            len(missing),
            len(classes),
            ", ".join(missing[:10]) + (", ..." if len(missing) > 10 else ""),
        )


def warn_protocol(cfg: DictConfig, world_size: int) -> None:
    """Warn when a paper preset (``experiment=paper*``) runs where BatchNorm sees another batch than the
    paper's 128 samples per GPU."""
    if "protocol" in cfg and world_size == 1 and cfg.trainer.batch_size > 128:
        log.warning(
            "experiment=paper* on one process: BatchNorm normalises over all %d samples of a batch where "
            "the paper's 4 GPUs saw 128 each; for comparable figures launch "
            "torchrun --nproc_per_node=4 (docs/reproduce.md)",
            cfg.trainer.batch_size,
        )
