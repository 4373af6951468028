"""Everything a run is made of, built from the composed config (data, model, loss, optimizer, schedule)
and the whole training run (:func:`build_run`); the trainer, the audit and the benchmarks share it."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, Subset

from mlcls.data import build_dataset
from mlcls.data.datasets.labels import label_counts
from mlcls.data.loader import DeviceStage, build_eval_loader, build_train_loader
from mlcls.data.pipeline.preprocess import preprocess_spec
from mlcls.data.views import split_holdout
from mlcls.engine.checkpoint import Checkpointer, carry_loss_state, init_from_checkpoint
from mlcls.engine.config_checks import check_config, resolve_amp
from mlcls.engine.distributed import DistInfo, init_distributed
from mlcls.engine.ema import ModelEma
from mlcls.engine.evaluate import evaluated_classes
from mlcls.engine.logging import RunLog, open_run_log
from mlcls.engine.optim import build_optimizer, build_scheduler, short_run_note
from mlcls.engine.rundir import close_run_dir, discard_if_empty, hydra_run_dir, resolve_run_dir
from mlcls.engine.state import TrainState, seed_everything
from mlcls.errors import ConfigError
from mlcls.models.factory import TRAINING_KEYS, freeze_backbone, has_text_queries
from mlcls.text import class_embeddings

log = logging.getLogger("mlcls")


@dataclass
class RunData:
    """The splits of a run and their loaders for this process."""

    train_set: Dataset  # what trains: the training split's view, less the held-out share if any
    val_set: Dataset  # the validation split, or its first samples under trainer.limit_val_batches
    train_loader: Any  # a DataLoader, or the DALI loader; both have len() and .sampler
    val_loader: Any
    classes: list[str]
    iters_per_epoch: int
    local_batch: int  # samples per step of this process: trainer.batch_size over the world size
    # dataset.val_fraction > 0: the held-out share of the training split that selects the best epoch
    # (under trainer.limit_val_batches its first samples), and its evaluation loader; else None
    holdout_set: Dataset | None = None
    holdout_loader: Any = None


def pin_dataset_root(dataset_cfg: DictConfig) -> None:
    """``dataset.root`` made absolute now, so that the config a run saves finds its data from any
    directory (``mlcls-eval``, ``mlcls-predict``)."""
    root = dataset_cfg.get("root")
    if isinstance(root, str) and root:
        dataset_cfg.root = os.path.abspath(os.path.expanduser(root))


def build_data(
    cfg: DictConfig, dist: DistInfo, with_index: bool = False, channels_last: bool = False
) -> RunData:
    """Both splits of ``cfg.dataset`` (and the held-out share of the training split, :func:`split_holdout`)
    with this rank's loaders; ``with_index``: training batches hold their samples' indices too."""
    pin_dataset_root(cfg.dataset)
    tcfg, backend = cfg.trainer, cfg.data.backend
    local_batch = tcfg.batch_size // dist.world_size
    train_set = build_dataset(cfg.dataset, train=True, backend=backend)
    val_set: Dataset = build_dataset(cfg.dataset, train=False, backend=backend)
    holdout_set: Dataset | None = None
    if train_set.selection_split.fraction:
        train_set, holdout_set = split_holdout(train_set, val_set.transform)
    if tcfg.limit_val_batches:  # the first batches of the evaluated sets only
        keep = tcfg.limit_val_batches * local_batch * dist.world_size
        val_set = Subset(val_set, range(min(len(val_set), keep)))
        if holdout_set is not None:
            holdout_set = Subset(holdout_set, range(min(len(holdout_set), keep)))
    args = (local_batch, tcfg.workers, dist.rank, dist.world_size)
    loader = build_train_loader(train_set, *args, tcfg.seed, dist.device, backend, with_index=with_index)
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
    eval_args = (*args, dist.device, channels_last)
    return RunData(
        train_set=train_set,
        val_set=val_set,
        train_loader=loader,
        val_loader=build_eval_loader(val_set, *eval_args),
        classes=list(train_set.classes),
        iters_per_epoch=iters,
        local_batch=local_batch,
        holdout_set=holdout_set,
        holdout_loader=None if holdout_set is None else build_eval_loader(holdout_set, *eval_args),
    )


def build_model(
    model_cfg: DictConfig | dict[str, Any],
    num_classes: int,
    device: torch.device,
    channels_last: bool = False,
    **overrides: Any,
) -> nn.Module:
    """The ``model`` config's network with ``num_classes`` outputs on ``device``, ``overrides`` replacing
    config keys (``init_from`` is :func:`init_from_checkpoint`'s)."""
    fields = {key: value for key, value in model_cfg.items() if key not in TRAINING_KEYS}
    model: nn.Module = instantiate(fields, num_classes=num_classes, **overrides).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def class_queries(cfg: DictConfig, classes: list[str]) -> dict[str, Any]:
    """A text-query head's ``class_embeddings`` of ``classes`` from ``cfg.text``, as a keyword of
    :func:`build_model`; nothing for another head (``cfg.text`` then unread)."""
    if not has_text_queries(cfg.model.head):
        return {}
    if cfg.get("text") is None:
        raise ConfigError(
            f"model/head={cfg.model.head.name} needs a text config (text=words, configs/text/); none is set"
        )
    return {"class_embeddings": class_embeddings(cfg.text, classes)}


def sync_batchnorm(model: nn.Module, dist: DistInfo) -> nn.Module:
    """``trainer.sync_bn``: ``model`` with SyncBatchNorm (the same state-dict keys), whose statistics span
    the global batch, when several processes run on CUDA; else as it is (on the CPU said in one line:
    torch's SyncBatchNorm refuses CPU tensors)."""
    if not dist.distributed:
        return model
    if dist.device.type != "cuda":
        if dist.is_main:
            log.info(
                "trainer.sync_bn: SyncBatchNorm needs CUDA devices; on the %s each of the %d processes keeps "
                "BatchNorm over its own share of the batch",
                dist.device.type,
                dist.world_size,
            )
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


class GlobalBatchSum(nn.Module):
    """A loss that sums over the batch, times the number of processes: DDP averages the gradients of sums
    over shares of the batch, which without the factor give ``1 / world_size`` of the gradient one process
    with the whole batch takes (and Adam's coupled L2 decay would weigh ``world_size`` times more)."""

    def __init__(self, loss: nn.Module, world_size: int) -> None:
        super().__init__()
        self.loss, self.world_size = loss, world_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return self.loss(logits, targets, *extra) * self.world_size

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}"


def build_loss(
    loss_cfg: DictConfig | nn.Module, train_set: Dataset, device: torch.device, world_size: int = 1
) -> nn.Module:
    """The ``loss`` config's criterion (or one instantiated already) on ``device``, set up with the training
    set's label counts; scaled by :class:`GlobalBatchSum` if it sums over the batch (a mean needs no factor:
    DDP's average of the means of equal shares is the mean)."""
    criterion = loss_cfg if isinstance(loss_cfg, nn.Module) else instantiate(loss_cfg)
    if hasattr(criterion, "setup"):
        try:
            criterion.setup(label_counts(train_set))
        except ValueError as exc:  # e.g. a per-sample table over its size limit: one line, before training
            raise ConfigError(f"loss={getattr(criterion, 'name', type(criterion).__name__)}: {exc}") from None
    if world_size > 1 and getattr(criterion, "sums_over_batch", False):
        criterion = GlobalBatchSum(criterion, world_size)
    return criterion.to(device)


def build_optimization(
    cfg: DictConfig, model: nn.Module, iters_per_epoch: int, criterion: nn.Module | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer of ``cfg.optim`` over ``model`` and ``criterion``'s ``parameter_groups()`` (ROLE's label
    table), and the per-iteration schedule of ``cfg.sched``."""
    loss_groups = criterion.parameter_groups() if hasattr(criterion, "parameter_groups") else []
    optimizer = build_optimizer(cfg.optim, model, loss_groups)
    total_iters, head_warmup = cfg.trainer.epochs * iters_per_epoch, cfg.model.head.warmup_epochs
    scheduler = build_scheduler(cfg.sched, optimizer, total_iters, iters_per_epoch, head_warmup)
    note = None if "protocol" in cfg else short_run_note(cfg.sched, total_iters, iters_per_epoch, head_warmup)
    if note:  # a preset with a protocol block runs a published schedule as published
        log.info(note)
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
    """Warn when a paper preset runs where BatchNorm sees another batch than the paper's 128 per GPU."""
    if "protocol" in cfg and world_size == 1 and cfg.trainer.batch_size > 128:
        log.warning(
            "experiment=paper* on one process: BatchNorm normalises over all %d samples of a batch where "
            "the paper's 4 GPUs saw 128 each; for comparable figures launch "
            "torchrun --nproc_per_node=4 (docs/reproduce.md)",
            cfg.trainer.batch_size,
        )


@dataclass
class Run:
    """The parts of a training run."""

    cfg: DictConfig  # the composed configs/train.yaml, dataset.root made absolute
    dist: DistInfo  # this process's rank, world size and device
    amp: str  # the training step's autocast: "none", "bf16" or "fp16" (resolve_amp)
    eval_amp: str  # the evaluation's
    channels_last: bool  # NHWC images and weights (CUDA only)
    data: RunData
    model: nn.Module  # the plain model: what checkpoints, EMA and evaluation use
    criterion: nn.Module
    run_dir: Path  # chosen by rank 0, created and locked (rundir.py)
    ema: ModelEma | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # stepped every iteration
    scaler: torch.amp.GradScaler  # fp16's dynamic loss scale (disabled otherwise: scale 1)
    device_stage: DeviceStage  # copies a batch to the device and finishes the fast pipeline there
    state: TrainState  # fresh, or restored by trainer.resume
    checkpointer: Checkpointer  # writes the state of the parts above, and restored it
    ddp_model: nn.Module  # what the training step runs: the model, DDP-wrapped and compiled as configured
    run_log: RunLog


def build_run(cfg: DictConfig, run_dir: str | Path | None = None) -> Run:
    """The training run of ``cfg``, built in the order its parts depend on: process group -> config check
    -> seed -> data -> model and loss -> run directory -> EMA, optimizer, schedule, loss scale -> resume
    (or a seed per rank) -> DDP -> compile -> run log. Every rank returns or raises together; a failure
    leaves no empty directory and no run directory without a checkpoint (:func:`close_run_dir`)."""
    tcfg = cfg.trainer
    hydra_dir = hydra_run_dir()
    try:
        # The process group first: under SLURM the world size exists only once it is set up.
        dist = init_distributed(tcfg.device)
        check_config(cfg, world_size=dist.world_size, run_dir=run_dir)
        device, cuda = dist.device, dist.device.type == "cuda"
        amp = resolve_amp(tcfg.amp, device)
        eval_amp = amp if tcfg.get("eval_amp") is None else resolve_amp(tcfg.eval_amp, device)
        channels_last = bool(tcfg.channels_last) and cuda
        if cuda:
            torch.backends.cudnn.benchmark = not tcfg.deterministic
        if tcfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        warn_protocol(cfg, dist.world_size)
        seed_everything(tcfg.seed)
        loss = instantiate(cfg.loss)  # before the data: a loss with a row per sample needs their indices
        with_index = bool(getattr(loss, "needs_sample_index", False))
        data = build_data(cfg, dist, with_index, channels_last)
        preprocess = preprocess_spec(cfg.dataset)
        init_from = cfg.model.get("init_from")
        # starting from a checkpoint, the hub's pretrained weights would be replaced: none are fetched
        fresh = {"pretrained": False, "checkpoint_path": None} if init_from else {}
        queries = class_queries(cfg, data.classes)  # a text-query head's class embeddings, else none
        model = build_model(cfg.model, len(data.classes), device, channels_last, **fresh, **queries)
        started_from = None
        if init_from:
            trust = bool(tcfg.get("trust_checkpoint"))
            started_from = init_from_checkpoint(model, init_from, data.classes, trust)
        if cfg.model.get("freeze_backbone"):
            frozen = freeze_backbone(model)
            log.info(
                "model.freeze_backbone: %s backbone parameters frozen, the head trains alone", f"{frozen:,}"
            )
        if tcfg.get("sync_bn", False):
            model = sync_batchnorm(model, dist)
        summed_processes = dist.world_size if tcfg.get("loss_sum_scope", "global") == "global" else 1
        criterion = build_loss(loss, data.train_set, device, summed_processes)
        if started_from is not None:
            carry_loss_state(criterion, started_from, init_from, cfg.loss.get("_target_"))
    except BaseException:
        discard_if_empty(hydra_dir)  # Hydra made it at start-up; a failed check leaves nothing behind
        raise
    run_dir = resolve_run_dir(run_dir, hydra_dir, dist.is_main, cfg)
    try:
        ema = ModelEma(model, tcfg.ema_decay, warmup=tcfg.ema_warmup) if tcfg.ema_decay else None
        optimizer, scheduler = build_optimization(cfg, model, data.iters_per_epoch, criterion)
        scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
        # Copies each batch to the device and finishes the fast pipeline there (colour, lighting, normalise).
        device_stage = DeviceStage(device, channels_last, mean=preprocess["mean"], std=preprocess["std"])
        state = TrainState()
        resumable = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loss": criterion}
        if ema is not None:
            resumable["ema"] = ema
        checkpointer = Checkpointer(
            cfg, run_dir, resumable, scaler, state, dist, data.classes, preprocess, data.iters_per_epoch
        )
        if not checkpointer.resume():
            seed_everything(tcfg.seed + dist.rank)
        ddp_model = (
            DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
            if dist.distributed
            else model
        )
        if tcfg.compile:  # the training forward only; the plain model serves checkpoints, EMA and evaluation
            ddp_model = torch.compile(ddp_model)
        run_log = open_run_log(run_dir, dist.is_main, tcfg.epochs, data.iters_per_epoch, cfg)
    except BaseException:
        close_run_dir(run_dir, dist.is_main)
        raise
    warn_unscored_classes(data.val_set, evaluated_classes(data.val_set))  # all, under dataset.unseen_classes
    return Run(
        cfg=cfg,
        dist=dist,
        amp=amp,
        eval_amp=eval_amp,
        channels_last=channels_last,
        data=data,
        model=model,
        criterion=criterion,
        run_dir=run_dir,
        ema=ema,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        device_stage=device_stage,
        state=state,
        checkpointer=checkpointer,
        ddp_model=ddp_model,
        run_log=run_log,
    )
