"""mlcls: multi-label image classification with the Two-way Multi-Label Loss (Kobayashi, CVPR 2023)."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"


def config_dir() -> Path:
    """Directory of the Hydra configs: ``configs/`` of the source tree, or the copy inside an installed wheel."""
    for candidate in (
        Path(__file__).resolve().parent / "configs",
        Path(__file__).resolve().parents[1] / "configs",
    ):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError("mlcls configs not found: expected configs/train.yaml next to the mlcls package")
