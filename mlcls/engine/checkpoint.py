"""Atomic checkpoint and result files.

Every file is written to a temporary file in the same directory, flushed to disk and renamed over the
target, so a crash mid-write leaves the previous complete file in place, never a truncated one.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from mlcls.io import atomic_write  # re-exported: checkpoints, results and plots use it

log = logging.getLogger("mlcls")


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be read."""


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save(state)`` to ``path`` atomically."""
    atomic_write(Path(path), lambda f: torch.save(state, f))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`; raise :class:`CheckpointError` if unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # truncated zip, wrong file type, pickling error
        raise CheckpointError(f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not an mlcls checkpoint (no 'model' entry)")
    return state


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


def _link_or_copy(src: Path, dst: Path) -> None:
    """Make ``dst`` the same file as ``src`` atomically (a hard link where possible, else a copy)."""
    tmp = dst.with_name(f".{dst.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        import shutil

        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def save_training_checkpoint(state: dict[str, Any], directory: str | Path, iteration: int, keep: int) -> Path:
    """Write ``iter_<iteration>.pt`` atomically, point ``last.pt`` at it, keep the newest ``keep`` of them.

    Returns the path written. ``best.pt`` and unrelated files are never touched.
    """
    directory = Path(directory)
    path = directory / f"iter_{iteration:09d}.pt"
    save_checkpoint(state, path)
    _link_or_copy(path, directory / "last.pt")
    for old in sorted(directory.glob("iter_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def resume_candidates(directory: str | Path) -> list[Path]:
    """Checkpoints to try for ``resume=auto``, newest first: ``last.pt``, then the numbered ones."""
    directory = Path(directory)
    candidates = [directory / "last.pt"] if (directory / "last.pt").is_file() else []
    return candidates + sorted(directory.glob("iter_*.pt"), reverse=True)


def choose_resume_checkpoint(resume: str, directory: str | Path) -> str | None:
    """The checkpoint ``trainer.resume`` names: a file as given, or for ``auto`` the newest readable one in
    ``directory`` (an unreadable one, e.g. truncated by a crash, is reported and the previous one tried);
    None when there is none."""
    if resume != "auto":
        return str(resume)
    for path in resume_candidates(directory):
        try:
            load_checkpoint(path)
        except CheckpointError as exc:
            log.warning("%s; trying the previous checkpoint", exc)
            continue
        return str(path)
    return None
