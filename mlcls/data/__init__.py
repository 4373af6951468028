"""Datasets. Each config in ``configs/dataset/`` names its class with ``_target_``.

The keys of a dataset config that are not arguments of the dataset class are read here:
``name`` (short name), ``image_size`` (network input side), ``transform`` (kind, see
:mod:`mlcls.data.transforms`), ``train_split`` and ``val_split`` (values passed as ``split``).
"""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mlcls.data.base import (
    BadImageError,
    DatasetConfigError,
    DatasetError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
)
from mlcls.data.fast import build_backend_transform

# Keys of a dataset config consumed by the framework rather than passed to the dataset class.
FRAMEWORK_KEYS = ("name", "image_size", "transform", "train_split", "val_split")

__all__ = [
    "BadImageError",
    "DatasetConfigError",
    "DatasetError",
    "DatasetFormatError",
    "DatasetLayoutError",
    "MultiLabelDataset",
    "Sample",
    "build_dataset",
]


def build_dataset(
    cfg: DictConfig | dict[str, Any], train: bool, backend: str = "torchvision"
) -> MultiLabelDataset:
    """Instantiate the training (``train=True``) or validation split of the dataset config ``cfg``, with the
    transform of the input pipeline ``backend`` (``data.backend``; see :mod:`mlcls.data.fast`)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)) if not isinstance(cfg, dict) else cfg
    cfg = OmegaConf.create(cfg)
    split = cfg.get("train_split", "train") if train else cfg.get("val_split", "val")
    transform = build_backend_transform(backend, cfg.get("transform", "paper"), int(cfg.image_size), train)
    kwargs = {k: v for k, v in cfg.items() if k not in FRAMEWORK_KEYS}
    try:
        return instantiate(kwargs, split=split, transform=transform, _convert_="all")
    except InstantiationException as exc:
        # Hydra wraps whatever the constructor raises; a dataset error is the user's one-line message.
        if isinstance(exc.__cause__, DatasetError):
            raise exc.__cause__ from None
        raise
