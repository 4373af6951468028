"""What a checkpoint holds and how it is read (:func:`load_checkpoint`, the one reader, of
:data:`mlcls.formats.FORMAT` only), and the run's :class:`TrainState`.

Checkpoints hold plain data only (tensors, containers, strings, numbers, None), read with
``torch.load(weights_only=True)``: a pickle from someone else cannot run code. A file that needs more is
refused unless trusted (``trust_checkpoint=true``).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from mlcls.errors import first_line
from mlcls.formats import FORMAT, check_format
from mlcls.io import atomic_write
from mlcls.models.factory import has_text_queries
from mlcls.text import build_encoder
from mlcls.torchfile import check_nesting, open_checkpoint

TRUST_HINT = (
    "if you wrote it yourself, load it as it is with trust_checkpoint=true "
    "(trainer.trust_checkpoint=true to resume)"
)


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint needs code run to be loaded (pickled objects beyond plain data) and was not trusted."""


def plain(data: Any) -> Any:
    """``data`` with what ``torch.load(weights_only=True)`` refuses made plain: NumPy arrays become tensors
    (unsigned integers as int64), NumPy scalars Python numbers, OmegaConf configs dicts and lists."""
    if isinstance(data, (DictConfig, ListConfig)):
        return OmegaConf.to_container(data, resolve=True)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data.astype(np.int64) if data.dtype.kind == "u" else data.copy())
    if isinstance(data, np.generic):
        return data.item()
    if isinstance(data, dict):
        return {key: plain(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(plain(value) for value in data)
    return data


def text_record(cfg: DictConfig) -> dict[str, Any] | None:
    """A text-query head's encoder, ``{"source", "config"}``, with which ``mlcls-predict classes=...`` embeds
    new names the same way (:func:`mlcls.text.encoder_from_stored`); None for another head."""
    if not has_text_queries(cfg.model.head):
        return None
    return {"source": build_encoder(cfg.text).source, "config": plain(cfg.text)}


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save(state)`` to ``path`` atomically, with ``format`` :data:`FORMAT`."""
    atomic_write(Path(path), lambda f: torch.save({**state, "format": FORMAT}, f))


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", trust: bool = False
) -> dict[str, Any]:
    """A checkpoint written by :func:`save_checkpoint`, of :data:`FORMAT` (else one line). More than plain
    data is an :class:`UntrustedCheckpointError` naming the type it needs unless ``trust`` (unpickled as it
    is); a missing or unreadable file a :class:`CheckpointError`."""
    path = Path(path)
    try:
        file = open_checkpoint(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (OSError, ValueError) as exc:  # not a regular file, too large, not as torch.save writes
        raise CheckpointError(f"checkpoint {exc}" if str(exc).startswith(str(path)) else str(exc)) from None
    try:
        with file:
            state = torch.load(file, map_location=map_location, weights_only=not trust)
    except Exception as exc:  # truncated zip, wrong file type, pickling error
        needed = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if not trust and needed:
            raise UntrustedCheckpointError(
                f"checkpoint {path} holds a {needed.group(1)} object, which loading would run code for "
                f"(a crafted file, or one written before checkpoints held plain data); "
                + TRUST_HINT.format(path=path)
            ) from None
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {first_line(exc)})"
        ) from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not an mlcls checkpoint (no 'model' entry)")
    try:
        check_nesting(state, f"checkpoint {path}")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return check_format(state, "checkpoint", f"checkpoint {path}", CheckpointError)


def _finite_or_none(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite_or_none(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite_or_none(v) for v in data]
    return data


def write_json(data: Any, path: str | Path) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically; NaN and infinities become ``null``."""
    text = json.dumps(_finite_or_none(data), indent=2, allow_nan=False) + "\n"
    atomic_write(Path(path), lambda f: f.write(text.encode()))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy (keys as an int64 tensor), torch and CUDA generator states, plain data."""
    state = {
        "python": random.getstate(),
        "numpy": plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
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
    skipped_steps: int = 0  # non-finite steps skipped


@dataclass
class TrainState:
    """Where training stands: ``epoch`` epochs complete plus ``step`` steps of the next one with every
    rank's :class:`EpochProgress` (``partial``), and the run's records (bounded by
    :func:`mlcls.engine.state_checks.check_progress`)."""

    epoch: int = 0
    step: int = 0
    partial: list[EpochProgress] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None  # epoch, mAP@class, mAP@sample, weights "raw" or "ema"
    last_metrics: dict[str, Any] | None = None
    thresholds: torch.Tensor | None = None  # the raw weights' calibrated ones
    counts: dict[str, Any] = field(default_factory=lambda: {"skipped_steps": 0, "skipped_images": []})
    wall_time_s: float = 0.0
    rng: list[dict[str, Any]] = field(default_factory=list)
    resumes: int = 0

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["partial"] = [asdict(p) for p in self.partial]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}
        for key, value in state.items():
            if key in names:
                setattr(self, key, value)
        self.partial = [EpochProgress(**p) for p in state.get("partial", [])]

    def progress_of(self, rank: int) -> EpochProgress:
        """``rank``'s sums of the incomplete epoch (zeros when it has none)."""
        if not self.step or rank >= len(self.partial):
            return EpochProgress()
        return self.partial[rank]
