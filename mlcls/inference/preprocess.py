"""The evaluation preprocessing of a trained model, as a JSON-ready dict that travels with the checkpoint.

A *preprocess spec* describes, without any dataset config, how an image must be turned into the network's
input tensor -- exactly the evaluation transform of :mod:`mlcls.data.pipeline.transforms`::

    {"transform": "paper", "image_size": 224, "resize": 256, "crop": 224, "interpolation": "bilinear",
     "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}

Applied in this order: decode as RGB -> ``Resize(resize)`` (an int resizes the shorter side keeping the
aspect ratio, ``[h, w]`` resizes to exactly that size) -> ``CenterCrop(crop)`` unless ``crop`` is null ->
scale pixels to [0, 1] -> subtract ``mean`` and divide by ``std`` per RGB channel (the dataset config's
``dataset.mean`` and ``dataset.std``). The network input is a float32 (B, 3, H, W) tensor with ``(H, W)`` =
:func:`input_size`.

The trainer stores the spec in every checkpoint under ``"preprocess"``; checkpoints written before that are
read through :func:`spec_from_checkpoint`, which derives it from the checkpoint's dataset config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torchvision import transforms as T

from mlcls.data.pipeline.transforms import SQUASH_EVAL_KINDS, TRANSFORM_KINDS, eval_resize, normalisation
from mlcls.inference.errors import InferenceError

SPEC_KEYS = ("transform", "image_size", "resize", "crop", "interpolation", "mean", "std")


def preprocess_spec(dataset_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The spec of the evaluation transform that ``build_dataset(dataset_cfg, train=False)`` applies.

    Args:
        dataset_cfg: a dataset config (DictConfig or dict) with ``image_size`` and optionally ``transform``
            (default ``"paper"``, as in :func:`mlcls.data.build_dataset`), ``mean`` and ``std`` (default
            ImageNet's; checked by :func:`mlcls.data.pipeline.transforms.normalisation`).

    Returns:
        A dict with the keys :data:`SPEC_KEYS` (lists, ints and strings only: JSON-ready).
    """
    if dataset_cfg.get("image_size") is None:
        raise InferenceError("the dataset config has no image_size; cannot tell the model's input size")
    kind = dataset_cfg.get("transform") or "paper"
    size = int(dataset_cfg["image_size"])
    if kind not in TRANSFORM_KINDS:
        raise InferenceError(f"unknown transform {kind!r}; expected one of {', '.join(TRANSFORM_KINDS)}")
    if kind in SQUASH_EVAL_KINDS:  # light, strong: squash-resize to size x size, no crop
        resize, crop = [size, size], None
    else:
        resize, crop = eval_resize(size), size
    mean, std = normalisation(dataset_cfg.get("mean"), dataset_cfg.get("std"))
    return {
        "transform": kind,
        "image_size": size,
        "resize": resize,
        "crop": crop,
        "interpolation": "bilinear",
        "mean": list(mean),
        "std": list(std),
    }


def check_spec(spec: Mapping[str, Any]) -> None:
    """Raise :class:`InferenceError` unless ``spec`` has every key of :data:`SPEC_KEYS`."""
    missing = [key for key in SPEC_KEYS if key not in spec]
    if missing:
        raise InferenceError(
            f"preprocess spec lacks {', '.join(missing)}; expected keys {', '.join(SPEC_KEYS)}"
        )


def input_size(spec: Mapping[str, Any]) -> tuple[int, int]:
    """``(H, W)`` of the network input the spec produces."""
    check_spec(spec)
    if spec["crop"] is not None:
        crop = spec["crop"]
        return (crop, crop) if isinstance(crop, int) else (int(crop[0]), int(crop[1]))
    resize = spec["resize"]
    if isinstance(resize, int):
        raise InferenceError("a preprocess spec without crop must resize to a fixed [h, w]")
    return int(resize[0]), int(resize[1])


def build_eval_transform(spec: Mapping[str, Any]) -> Callable:
    """The torchvision transform (PIL RGB image -> float32 (3, H, W) tensor) that ``spec`` describes."""
    check_spec(spec)
    resize = spec["resize"] if isinstance(spec["resize"], int) else tuple(spec["resize"])
    try:
        interpolation = T.InterpolationMode(spec["interpolation"])
    except ValueError as exc:
        raise InferenceError(f"unknown interpolation {spec['interpolation']!r} in preprocess spec") from exc
    steps: list[Callable] = [T.Resize(resize, interpolation=interpolation)]
    if spec["crop"] is not None:
        steps.append(T.CenterCrop(spec["crop"]))
    steps += [T.ToTensor(), T.Normalize(*normalisation(spec["mean"], spec["std"], owner="preprocess"))]
    return T.Compose(steps)


def spec_from_checkpoint(state: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``"preprocess"`` spec, else (older checkpoints) the one of its dataset config."""
    if state.get("preprocess") is not None:
        spec = dict(state["preprocess"])
        check_spec(spec)
        return spec
    dataset_cfg = (state.get("config") or {}).get("dataset")
    if dataset_cfg is None:
        raise InferenceError("the checkpoint holds neither a preprocess spec nor a dataset config")
    return preprocess_spec(dataset_cfg)
