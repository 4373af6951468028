"""Checks of the resolved config, run before any data is read or any process group is joined."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mlcls.data.pipeline.fast import BACKENDS
from mlcls.engine.optim import GROUP_KEYS, build_scheduler, optimizer_factory
from mlcls.engine.rundir import explicit_hydra_run_dir
from mlcls.errors import ConfigError  # noqa: F401 - re-exported: raised by validate_config
from mlcls.losses.spec import loss_name

AMP_MODES = ("auto", "none", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
# trainer.loss_sum_scope: what a loss summed over the batch sums over under DDP (engine.build.build_loss).
LOSS_SUM_SCOPES = ("global", "process")


def resolve_amp(amp: str, device: torch.device) -> str:
    """The autocast of ``trainer.amp`` (or ``eval_amp``) on ``device``: ``auto`` is bf16 on CUDA and none
    (float32) elsewhere; none, bf16 and fp16 are what they say on every device."""
    if amp == "auto":
        return "bf16" if device.type == "cuda" else "none"
    return amp


def _positive(value, key: str, integer: bool = False) -> None:
    ok = (
        isinstance(value, int) and not isinstance(value, bool) if integer else isinstance(value, (int, float))
    )
    if not ok or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ConfigError(f"{key}={value!r}; expected {kind}")


def _check_optimization(cfg: DictConfig) -> None:
    """The parameter-group keys of ``optim``, then the optimizer and the schedule built on one parameter:
    they check their own keywords (an unknown one, momentum out of range, ...) at no cost."""
    for key in GROUP_KEYS:
        value = cfg.optim.get(key)
        if value is None and key in ("norm_weight_decay", "bias_weight_decay"):
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            kind = "a number >= 0, or null for weight_decay's" if "_weight_decay" in key else "a number >= 0"
            raise ConfigError(f"optim.{key}={value!r}; expected {kind}")
    for group in ("optim", "sched"):
        if cfg[group].get("_partial_") is not True:
            raise ConfigError(f"{group}._partial_ must be true: {group}._target_ is called by the trainer")
    try:
        optimizer = optimizer_factory(cfg.optim)([{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    except Exception as exc:
        raise ConfigError(f"optim._target_={cfg.optim.get('_target_')}: {_first_line(exc)}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optim._target_={cfg.optim._target_} is not a torch optimizer class")
    _check_head_warmup(cfg)
    try:
        scheduler = build_scheduler(cfg.sched, optimizer, total_iters=1)
    except Exception as exc:
        raise ConfigError(f"sched._target_={cfg.sched.get('_target_')}: {_first_line(exc)}") from None
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(f"sched._target_={cfg.sched._target_} does not return a learning-rate scheduler")


def _check_head_warmup(cfg: DictConfig) -> None:
    """``sched.warmup_epochs`` read from ``sched.head_warmup_epochs`` (configs/sched/cosine.yaml) needs an
    entry for ``model.head``."""
    table = cfg.sched.get("head_warmup_epochs")
    head = cfg.model.get("head")
    if table is None or not OmegaConf.is_interpolation(cfg.sched, "warmup_epochs") or head in table:
        return
    raise ConfigError(
        f"model.head={head!r}; expected one of {', '.join(table)} (the heads of sched.head_warmup_epochs), "
        "or set sched.warmup_epochs"
    )


def _first_line(exc: Exception) -> str:
    """The first line of the innermost message (Hydra wraps the target's error in a few lines of its own)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def validate_config(cfg: DictConfig, world_size: int | None = None) -> None:
    """Raise :class:`ConfigError` with a one-line message for the first invalid setting.

    ``world_size`` defaults to the number of processes torchrun, or SLURM through submitit, starts (1
    without either); the trainer passes the size of the process group it joined.
    """
    if world_size is None:
        from mlcls.engine.distributed import world_size_from_environment

        world_size = world_size_from_environment()
    t = cfg.trainer
    for key in ("epochs", "batch_size", "eval_every", "log_every", "keep_checkpoints", "max_nonfinite"):
        _positive(t[key], f"trainer.{key}", integer=True)
    if not isinstance(t.workers, int) or t.workers < 0:
        raise ConfigError(f"trainer.workers={t.workers!r}; expected an integer >= 0")
    for key in ("limit_train_batches", "limit_val_batches"):
        if t[key] is not None:
            _positive(t[key], f"trainer.{key}", integer=True)
    if t.amp not in AMP_MODES:
        raise ConfigError(f"trainer.amp={t.amp!r}; expected one of {', '.join(AMP_MODES)}")
    if t.get("eval_amp") not in (None, *AMP_MODES):
        raise ConfigError(f"trainer.eval_amp={t.eval_amp!r}; expected one of {', '.join(AMP_MODES)}, or null")
    if t.device not in DEVICES:
        raise ConfigError(f"trainer.device={t.device!r}; expected one of {', '.join(DEVICES)}")
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available; use trainer.device=cpu")
    if t.ema_decay is not None and not 0.0 < t.ema_decay < 1.0:
        raise ConfigError(
            f"trainer.ema_decay={t.ema_decay!r}; expected a number in (0, 1), or null for no EMA"
        )
    if t.grad_clip is not None:
        _positive(t.grad_clip, "trainer.grad_clip")
    if t.resume not in (None, "auto") and not Path(t.resume).is_file():
        raise ConfigError(f"trainer.resume={t.resume}: no such checkpoint file (or use trainer.resume=auto)")
    if t.resume == "auto" and not t.output_dir and not explicit_hydra_run_dir():
        raise ConfigError(
            "trainer.resume=auto needs trainer.output_dir=<run dir> (or hydra.run.dir=<run dir>) to know "
            "which run to resume"
        )
    if not isinstance(t.get("trust_checkpoint", False), bool):
        raise ConfigError(f"trainer.trust_checkpoint={t.trust_checkpoint!r}; expected true or false")

    if t.batch_size % world_size:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} does not divide over {world_size} processes; "
            "use a multiple of the world size"
        )
    # Buckets split the per-process batch, or the global batch when the loss gathers it from all processes.
    gathered = bool(cfg.loss.get("gather"))
    split_batch = t.batch_size if gathered else t.batch_size // world_size
    bucket = cfg.loss.get("bucket_size")
    if bucket is not None:
        _positive(bucket, "loss.bucket_size", integer=True)
        if split_batch % bucket:
            what = "global batch" if gathered else "per-process batch"
            raise ConfigError(
                f"loss.bucket_size={bucket} does not divide the {what} {split_batch} "
                f"(trainer.batch_size={t.batch_size} over {world_size} processes)"
            )
    if cfg.loss.get("gather") and world_size == 1:
        raise ConfigError(
            "loss.gather=true needs several processes (torchrun); without DDP it changes nothing"
        )

    init_from = cfg.model.get("init_from")
    if init_from is not None and (not isinstance(init_from, str) or not Path(init_from).is_file()):
        raise ConfigError(
            f"model.init_from={init_from!r}: no such checkpoint file; expected an mlcls checkpoint (a run's "
            "last.pt or best.pt, or mlcls-import's output), or null"
        )
    freeze = cfg.model.get("freeze_backbone", False)
    if not isinstance(freeze, bool):
        raise ConfigError(f"model.freeze_backbone={freeze!r}; expected true (train the head alone) or false")
    _positive(cfg.dataset.image_size, "dataset.image_size", integer=True)
    if cfg.data.backend not in BACKENDS:
        raise ConfigError(f"data.backend={cfg.data.backend!r}; expected one of {', '.join(BACKENDS)}")
    if cfg.data.backend == "dali" and cfg.dataset.get("transform", "paper") != "paper":
        raise ConfigError("data.backend=dali does the paper's augmentation only; use dataset.transform=paper")
    if t.get("loss_sum_scope", "global") not in LOSS_SUM_SCOPES:
        raise ConfigError(
            f"trainer.loss_sum_scope={t.loss_sum_scope!r}; expected one of {', '.join(LOSS_SUM_SCOPES)}"
        )
    for key in ("compile", "sync_bn", "report"):
        if not isinstance(t.get(key, False), bool):
            raise ConfigError(f"trainer.{key}={t[key]!r}; expected true or false")
    _check_optimization(cfg)

    # The loss checks its own arguments (tp > 0, known ways, ...): building it costs nothing.
    try:
        instantiate(cfg.loss)
    except Exception as exc:
        cause = " ".join(str(exc.__cause__ or exc).split())  # Hydra's import errors span several lines
        raise ConfigError(f"loss={loss_name(cfg.loss)}: {cause}") from None
