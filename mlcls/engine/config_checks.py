"""Checks of the resolved training config, before any data is read. Each key is checked once: here the
trainer's, the model's starting point and those that depend on another group; the others where they are
used (``trainer.device``: :func:`mlcls.engine.distributed.resolve_device`; optimizer and schedule:
:mod:`mlcls.engine.optim`; heads; datasets)."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mlcls.data import BACKENDS
from mlcls.engine.rundir import explicit_hydra_run_dir
from mlcls.errors import ConfigError, is_integer, is_number
from mlcls.losses.spec import loss_name
from mlcls.metrics.zero_shot import check_zsl_images
from mlcls.models.heads import TEXT_HEADS

AMP_MODES = ("auto", "none", "bf16", "fp16")
# trainer.loss_sum_scope: what a loss summed over the batch sums over under DDP (engine.build.build_loss).
LOSS_SUM_SCOPES = ("global", "process")

# trainer.<key>: (its check, what is expected); a null is refused unless the key is in NULLABLE.
TRAINER_KEYS = {
    **{
        key: (lambda v: is_integer(v) and v > 0, "a positive integer")
        for key in ("epochs", "batch_size", "eval_every", "log_every", "keep_checkpoints", "max_nonfinite")
    },
    **{key: (lambda v: is_integer(v) and v > 0, "a positive integer, or null") for key in (
        "limit_train_batches", "limit_val_batches")},
    "workers": (lambda v: is_integer(v) and v >= 0, "an integer >= 0"),
    "amp": (lambda v: v in AMP_MODES, f"one of {', '.join(AMP_MODES)}"),
    "eval_amp": (lambda v: v in AMP_MODES, f"one of {', '.join(AMP_MODES)}, or null"),
    "ema_decay": (lambda v: is_number(v) and 0.0 < v < 1.0, "a number in (0, 1), or null for no EMA"),
    "grad_clip": (lambda v: is_number(v) and v > 0, "a positive number, or null"),
    "loss_sum_scope": (lambda v: v in LOSS_SUM_SCOPES, f"one of {', '.join(LOSS_SUM_SCOPES)}"),
    **{
        key: (lambda v: isinstance(v, bool), "true or false")
        for key in ("trust_checkpoint", "compile", "sync_bn", "report", "deterministic", "ema_warmup")
    },
}  # fmt: skip
NULLABLE = ("limit_train_batches", "limit_val_batches", "eval_amp", "ema_decay", "grad_clip")


def resolve_amp(amp: str, device: torch.device) -> str:
    """The autocast of ``trainer.amp`` (or ``eval_amp``): ``auto`` is bf16 on CUDA, none elsewhere."""
    if amp == "auto":
        return "bf16" if device.type == "cuda" else "none"
    return amp


def check_config(cfg: DictConfig, world_size: int | None = None, run_dir: str | Path | None = None) -> None:
    """Raise :class:`ConfigError` for the first invalid setting; ``world_size`` defaults to the launcher's,
    ``run_dir`` is the run directory given in Python (``Trainer(cfg, run_dir=...)``), if any."""
    if world_size is None:
        from mlcls.engine.distributed import world_size_from_environment

        world_size = world_size_from_environment()
    t = cfg.trainer
    for key, (check, expected) in TRAINER_KEYS.items():
        value = t[key]
        if not (value is None and key in NULLABLE) and not check(value):
            raise ConfigError(f"trainer.{key}={value!r}; expected {expected}")
    if t.resume not in (None, "auto") and not Path(t.resume).is_file():
        raise ConfigError(f"trainer.resume={t.resume}: no such checkpoint file (or use trainer.resume=auto)")
    if t.resume == "auto" and run_dir is None and not explicit_hydra_run_dir():
        raise ConfigError(
            "trainer.resume=auto needs hydra.run.dir=<run dir> (hydra.sweep.dir=<dir> in a multirun) to know "
            "which run to resume"
        )
    if t.batch_size % world_size:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} does not divide over {world_size} processes; "
            "use a multiple of the world size"
        )
    # loss.bucket_size divides the batch it splits: per process, or the global one under loss.gather
    gathered = bool(cfg.loss.get("gather"))
    if gathered and world_size == 1:
        raise ConfigError(
            "loss.gather=true needs several processes (torchrun); without DDP it changes nothing"
        )
    split_batch = t.batch_size if gathered else t.batch_size // world_size
    bucket = cfg.loss.get("bucket_size")
    if bucket is not None and (not is_integer(bucket) or bucket <= 0):
        raise ConfigError(f"loss.bucket_size={bucket!r}; expected a positive integer")
    if bucket is not None and split_batch % bucket:
        what = "global batch" if gathered else "per-process batch"
        raise ConfigError(
            f"loss.bucket_size={bucket} does not divide the {what} {split_batch} "
            f"(trainer.batch_size={t.batch_size} over {world_size} processes)"
        )

    init_from = cfg.model.init_from
    if init_from is not None and (not isinstance(init_from, str) or not Path(init_from).is_file()):
        raise ConfigError(
            f"model.init_from={init_from!r}: no such checkpoint file; expected an mlcls checkpoint (a run's "
            "last.pt or best.pt, or mlcls-import's output), or null"
        )
    freeze = cfg.model.freeze_backbone
    if not isinstance(freeze, bool):
        raise ConfigError(f"model.freeze_backbone={freeze!r}; expected true (train the head alone) or false")
    head = cfg.model.head.get("name")  # a text-query head's classes are text: unseen ones too
    if cfg.dataset.get("unseen_classes") and head not in TEXT_HEADS:
        raise ConfigError(
            f"dataset.unseen_classes is set but model/head={head} has no text queries, so it cannot score a "
            f"class it was not trained on; use model/head={' or model/head='.join(TEXT_HEADS)}, or "
            "dataset.unseen_classes=null"
        )
    check_zsl_images(OmegaConf.select(cfg, "metrics.zsl_images", default="all"))
    if cfg.data.backend not in BACKENDS:
        raise ConfigError(f"data.backend={cfg.data.backend!r}; expected one of {', '.join(BACKENDS)}")
    if cfg.data.backend == "dali" and cfg.dataset.get("transform", "paper") != "paper":
        raise ConfigError("data.backend=dali does the paper's augmentation only; use dataset.transform=paper")

    # The loss checks its own arguments (tp > 0, known ways, ...): building it costs nothing.
    try:
        instantiate(cfg.loss)
    except Exception as exc:
        cause = " ".join(str(exc.__cause__ or exc).split())  # Hydra's import errors span several lines
        raise ConfigError(f"loss={loss_name(cfg.loss)}: {cause}") from None
