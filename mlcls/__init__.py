"""mlcls: multi-label image classification with the Two-way Multi-Label Loss (Kobayashi, CVPR 2023)."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"


def config_dir() -> Path:
    """Directory of the Hydra configs, ``mlcls/configs`` (the top-level ``configs/`` links to it)."""
    path = Path(__file__).resolve().parent / "configs"
    if not (path / "train.yaml").is_file():
        raise FileNotFoundError(f"mlcls configs not found: expected {path / 'train.yaml'}")
    return path
