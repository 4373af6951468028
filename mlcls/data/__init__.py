"""Datasets. Each config in ``configs/dataset/`` names its class with ``_target_`` and is instantiated as it
is, the split added: ``hydra.utils.instantiate(cfg.dataset, split=cfg.dataset.train_split)``.

Besides the class's own arguments (``root``, ``year``, ...), every dataset config holds the keys the rest of
mlcls reads: ``name`` (short name), ``image_size`` (network input side), ``transform`` (a transform name of
:mod:`mlcls.data.pipeline.transforms`), ``mean`` and ``std`` (the input normalisation, 3 numbers each,
ImageNet's in every config: absent, as in a checkpoint's config of before the keys, they default to it),
``train_split`` and ``val_split`` (the ``split`` values of training and evaluation). The base class
:class:`MultiLabelDataset` takes them as arguments (each subclass passes them on with ``**config_keys``)
and builds the named transform for its split. Chosen over the alternatives because
it keeps every key path users type (``dataset.root``, ``dataset.image_size``, ...), keeps ``_target_``
pointing straight at the dataset class, and a plain ``instantiate`` gives a working dataset; a misspelt key
still fails as an unexpected argument. (``_partial_`` would not remove the keys: Hydra passes every key of
the node to the target, partial or not.)

:func:`build_dataset` adds what a config does not hold: the split (train or validation) and the transform of
the input pipeline ``data.backend`` (:mod:`mlcls.data.pipeline.fast`), which replaces the named one.
"""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mlcls.data.datasets.base import (
    BadImageError,
    DatasetConfigError,
    DatasetError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    Sample,
)
from mlcls.data.pipeline.fast import build_backend_transform
from mlcls.data.pipeline.transforms import TRANSFORM_KINDS
from mlcls.errors import shown


def _shards_source(key: str, fallback: Any, *, _parent_: DictConfig) -> Any:
    from mlcls.data.shards.datasets import source_setting  # imported when a shards config is resolved

    return source_setting(key, fallback, _parent_)


# ``${shards_source:image_size,224}`` in configs/dataset/shards.yaml: the packed source's setting.
OmegaConf.register_new_resolver("shards_source", _shards_source, replace=True)

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


# The largest network input side a dataset config may ask for (the field's largest are 448-640 px).
MAX_IMAGE_SIZE = 4096


def check_input_settings(kind: Any, size: Any) -> None:
    """Raise :class:`DatasetConfigError` unless ``kind`` (``dataset.transform``) names a transform and
    ``size`` (``dataset.image_size``) is an integer in [1, :data:`MAX_IMAGE_SIZE`]."""
    if not isinstance(kind, str) or kind not in TRANSFORM_KINDS:
        raise DatasetConfigError(
            f"dataset.transform={shown(kind)}; expected one of {', '.join(TRANSFORM_KINDS)}"
        )
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_IMAGE_SIZE:
        raise DatasetConfigError(
            f"dataset.image_size={shown(size)}; expected an integer from 1 to {MAX_IMAGE_SIZE}"
        )


def build_dataset(
    cfg: DictConfig | dict[str, Any], train: bool, backend: str = "torchvision"
) -> MultiLabelDataset:
    """Instantiate the training (``train=True``) or validation split of the dataset config ``cfg``, with the
    transform of the input pipeline ``backend`` (``data.backend``; see :mod:`mlcls.data.pipeline.fast`)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)) if not isinstance(cfg, dict) else cfg
    cfg = OmegaConf.create(cfg)
    split = cfg.get("train_split", "train") if train else cfg.get("val_split", "val")
    kind, size = cfg.get("transform", "paper"), cfg.get("image_size")
    check_input_settings(kind, size)
    transform = build_backend_transform(backend, kind, size, train, cfg.get("mean"), cfg.get("std"))
    try:
        return instantiate(cfg, split=split, transform=transform, _convert_="all")
    except InstantiationException as exc:
        # Hydra wraps whatever the constructor raises; a dataset error is the user's one-line message.
        if isinstance(exc.__cause__, DatasetError):
            raise exc.__cause__ from None
        raise
