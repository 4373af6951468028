"""The progress of a run that a checkpoint carries besides the weights and the optimizer: where training
stands, what it scored, what it counted, and every rank's random streams."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch

from mlcls.engine.checkpoint import plain


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch (and CUDA) generator states, as plain data (NumPy's key array
    as an int64 tensor) that a checkpoint loads without unpickling code."""
    state = {
        "python": random.getstate(),
        "numpy": plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (NumPy's keys as a tensor, or as an array in earlier checkpoints)."""
    random.setstate(state["python"])
    algorithm, keys, *position = state["numpy"]
    np.random.set_state((algorithm, np.asarray(keys, dtype=np.uint32), *position))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class EpochProgress:
    """One rank's sums over the steps of the current epoch so far (restored by a mid-epoch resume)."""

    loss_sum: float = 0.0  # over the applied steps
    seen: int = 0
    time_s: float = 0.0
    skipped_steps: int = 0  # non-finite steps skipped (absent from checkpoints of earlier versions: 0)


@dataclass
class TrainState:
    """Where training stands: ``epoch`` epochs complete plus ``step`` steps of the next one.

    ``partial`` holds every rank's :class:`EpochProgress` of that incomplete epoch (empty when ``step`` is
    0), ``history`` one record per finished epoch, ``best`` the best evaluation so far (epoch, mAP@class,
    mAP@sample and which ``weights``: "raw" or "ema"), ``last_metrics`` the newest evaluation's metrics,
    ``thresholds`` the per-class thresholds calibrated for the raw weights, ``counts`` the skipped steps
    and unreadable images, ``rng`` every rank's generator states, ``resumes`` how many times training
    continued from a checkpoint.
    """

    epoch: int = 0
    step: int = 0
    partial: list[EpochProgress] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    last_metrics: dict[str, Any] | None = None
    thresholds: torch.Tensor | None = None
    counts: dict[str, Any] = field(default_factory=lambda: {"skipped_steps": 0, "skipped_images": []})
    wall_time_s: float = 0.0
    rng: list[dict[str, Any]] = field(default_factory=list)
    resumes: int = 0

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["partial"] = [asdict(p) for p in self.partial]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or from the flat checkpoints of earlier versions."""
        names = {f.name for f in fields(self)}
        for key, value in state.items():
            if key in names:
                setattr(self, key, value)
        if "last_figures" in state:  # the name of earlier versions
            self.last_metrics = state["last_figures"]
        self.partial = [EpochProgress(**p) for p in state.get("partial", [])]
        if not self.partial and state.get("epoch_partial"):  # one sum for all ranks, from rank 0 only
            self.partial = [EpochProgress(**state["epoch_partial"])]

    def progress_of(self, rank: int) -> EpochProgress:
        """``rank``'s sums of the incomplete epoch (zeros when it has none)."""
        if not self.step or rank >= len(self.partial):
            return EpochProgress()
        return self.partial[rank]
