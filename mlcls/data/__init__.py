"""Datasets. :func:`build_dataset` takes a dataset config's training policies (:data:`POLICY_KEYS`) and
pipeline keys (:data:`PIPELINE_KEYS`) out of it, builds the transform of ``data.backend`` from the latter
(:func:`build_backend_transform`), instantiates the rest with the split and the transform (a misspelt key
fails as an unexpected argument) and, for training, wraps the split in its policies
(:func:`mlcls.data.views.apply_training_policies`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from mlcls.data.datasets.base import (
    BadImageError,
    DatasetConfigError,
    DatasetError,
    DatasetFormatError,
    DatasetLayoutError,
    MultiLabelDataset,
    check_integer,
    check_setting,
)
from mlcls.data.pipeline.fast import FastTrainTransform
from mlcls.data.pipeline.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TRANSFORM_KINDS,
    build_transform,
    normalisation,
)
from mlcls.data.views import CUT_KEYS, POLICY_KEYS, apply_training_policies, training_policies

# What building a dataset raises is importable from here, beside what builds it.
__all__ = [
    "BACKENDS",
    "PIPELINE_KEYS",
    "BadImageError",
    "DatasetConfigError",
    "DatasetError",
    "DatasetFormatError",
    "DatasetLayoutError",
    "build_backend_transform",
    "build_dataset",
]
# The keys of a dataset config that build the input pipeline's transform (:func:`build_dataset`), not data.
PIPELINE_KEYS = ("transform", "image_size", "mean", "std")
# The largest network input side a dataset config may ask for (the field's largest are 448-640 px).
MAX_IMAGE_SIZE = 4096
# data.backend: the input pipelines (docs/performance.md); build_backend_transform makes their transforms.
BACKENDS = ("torchvision", "fast", "dali", "gpu")


def build_dataset(
    cfg: DictConfig | dict[str, Any], train: bool, backend: str = "torchvision"
) -> MultiLabelDataset:
    """The training (``train=True``) or validation split of the dataset config ``cfg``, with the transform of
    ``backend`` (``data.backend``) and, for training, its policies (checked for either split)."""
    cfg = OmegaConf.create(cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True))
    if "_target_" not in cfg:
        raise DatasetConfigError(
            f"the dataset config {cfg.get('name', '')!r} names no _target_ (dataset=base holds the keys "
            "every dataset config shares, it is no dataset); expected a dataset of configs/dataset/"
        )
    policies = {key: cfg.pop(key) for key in POLICY_KEYS if key in cfg}
    training_policies(**policies)  # checked for either split, before any file is read
    try:
        target = get_object(cfg._target_) if isinstance(cfg._target_, str) else None
    except ImportError:  # instantiate says so below
        target = None
    if isinstance(target, type) and issubclass(target, MultiLabelDataset) and target.cuts_validation(cfg):
        # the held-out share is the validation split, which the dataset cuts itself: it selects nothing
        cfg.update({key: policies.pop(key) for key in CUT_KEYS if key in policies})
    pipeline = {key: cfg.pop(key) for key in PIPELINE_KEYS if key in cfg}
    split = cfg.get("train_split", "train") if train else cfg.get("val_split", "val")
    kind, size = pipeline.get("transform", "paper"), pipeline.get("image_size")
    check_setting("transform", kind, TRANSFORM_KINDS)
    check_integer("image_size", size, 1, MAX_IMAGE_SIZE)
    transform = build_backend_transform(backend, kind, size, train, pipeline.get("mean"), pipeline.get("std"))
    try:
        dataset = instantiate(cfg, split=split, transform=transform, _convert_="all")
    except InstantiationException as exc:
        # Hydra wraps whatever the constructor raises; a dataset error is the user's one-line message.
        if isinstance(exc.__cause__, DatasetError):
            raise exc.__cause__ from None
        raise
    return apply_training_policies(dataset, **policies) if train else dataset


def build_backend_transform(
    backend: str,
    kind: str,
    image_size: int,
    train: bool,
    mean: Sequence[float] | None = IMAGENET_MEAN,
    std: Sequence[float] | None = IMAGENET_STD,
) -> Callable:
    """The dataset transform of ``data.backend`` (:data:`BACKENDS`): the fast CPU stage (``fast``, ``dali``)
    or :class:`~mlcls.data.pipeline.gpu.GpuTrainTransform` for the ``paper`` training augmentation;
    :class:`~mlcls.data.pipeline.gpu.GpuEvalTransform` for ``gpu``'s evaluation; else
    :func:`~mlcls.data.pipeline.transforms.build_transform`'s. ``mean`` and ``std`` are checked in every
    case. The GPU pipeline's module is imported only when ``gpu`` is chosen."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown data.backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    mean, std = normalisation(mean, std)
    if backend == "gpu" and (not train or kind == "paper"):
        from mlcls.data.pipeline.gpu import GpuEvalTransform, GpuTrainTransform  # this backend's alone

        if not train:
            return GpuEvalTransform(image_size, kind, mean, std)
        return GpuTrainTransform(FastTrainTransform(image_size))
    if backend != "torchvision" and kind == "paper" and train:
        return FastTrainTransform(image_size)
    return build_transform(kind, image_size, train, mean, std)
