"""Resuming a run: rank 0 chooses the checkpoint, every rank restores the same one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from mlcls.engine import distributed as dist_utils
from mlcls.engine.checkpoint import CheckpointError, choose_resume_checkpoint, load_checkpoint
from mlcls.engine.state import TrainState, set_rng_state

log = logging.getLogger("mlcls")


def resume_run(
    cfg: DictConfig,
    run_dir: Path,
    parts: dict[str, Any],
    scaler: torch.amp.GradScaler,
    state: TrainState,
    rank: int,
) -> bool:
    """Restore ``trainer.resume`` (a file, or ``auto``: the newest readable checkpoint of ``run_dir``) into
    ``parts`` (name -> object with ``load_state_dict``: model, optimizer, scheduler, ema), ``scaler`` and
    ``state``; True if a checkpoint was loaded.

    Checkpoints are read as plain data (:func:`load_checkpoint`) unless ``trainer.trust_checkpoint``.
    Rank 0 chooses the file and every rank loads that one (ranks that chose for themselves could load
    different files when one is being written or a node's file system lags). A checkpoint written with
    another ``trainer.amp`` is resumed with a warning and a fresh loss scale.
    """
    resume = cfg.trainer.resume
    if not resume:
        return False
    checkpoints = run_dir / "checkpoints"
    trust = bool(cfg.trainer.get("trust_checkpoint", False))
    path = dist_utils.on_main(lambda: choose_resume_checkpoint(resume, checkpoints, trust), rank == 0)
    path = dist_utils.broadcast_object(path)
    if path is None:
        log.info("trainer.resume=auto: no readable checkpoint in %s, starting from scratch", run_dir)
        return False
    with dist_utils.all_or_none():
        restore(load_checkpoint(path, trust=trust), Path(path), parts, scaler, state, cfg.trainer.amp, rank)
    return True


def restore(
    checkpoint: dict[str, Any],
    path: Path,
    parts: dict[str, Any],
    scaler: torch.amp.GradScaler,
    state: TrainState,
    amp: str,
    rank: int,
) -> None:
    """Load a full training checkpoint (``last.pt``, ``iter_*.pt``) into the run's objects."""
    if "optimizer" not in checkpoint:
        raise CheckpointError(f"{path} holds weights only (best.pt?); resume needs last.pt or iter_*.pt")
    for name, part in parts.items():
        if checkpoint.get(name) is not None:
            part.load_state_dict(checkpoint[name])
    saved_amp = checkpoint.get("config", {}).get("trainer", {}).get("amp", amp)
    if saved_amp != amp:
        log.warning(
            "%s was trained with trainer.amp=%s; continuing with trainer.amp=%s (fresh loss scale)",
            path,
            saved_amp,
            amp,
        )
    elif checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    state.load_state_dict(checkpoint)
    state.resumes += 1
    world_size = torch.distributed.get_world_size() if dist_utils.initialized() else 1
    if len(state.rng) != world_size and rank == 0:
        log.warning(
            "%s was written by %d processes and resumes on %d: rank r continues the random streams of rank "
            "min(r, %d), and the rest of an epoch stopped midway is not what an uninterrupted run would read",
            path,
            len(state.rng),
            world_size,
            len(state.rng) - 1,
        )
    set_rng_state(state.rng[min(rank, len(state.rng) - 1)])
    where = f"epoch {state.epoch + 1}" + (f", step {state.step + 1}" if state.step else "")
    log.info("resumed from %s: continuing at %s", path, where)
