"""The evaluation transform of a trained model (:mod:`mlcls.data.pipeline.transforms`) as a JSON-ready
*preprocess spec* that travels with the checkpoint, needing no dataset config::

    {"transform": "paper", "image_size": 224, "resize": 256, "crop": 224, "interpolation": "bilinear",
     "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}

Applied in this order: decode as RGB -> ``Resize(resize)`` (an int resizes the shorter side keeping the
aspect ratio, ``[h, w]`` resizes to exactly that size) -> ``CenterCrop(crop)`` unless ``crop`` is null ->
scale pixels to [0, 1] -> ``(x - mean) / std`` per RGB channel: float32 (B, 3, H, W), ``(H, W)`` =
:func:`input_size`. Every checkpoint holds it under ``"preprocess"`` (:func:`spec_from_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torchvision import transforms as T

from mlcls.data.pipeline.transforms import SQUASH_EVAL_KINDS, TRANSFORM_KINDS, eval_resize, normalisation
from mlcls.errors import InferenceError, shown

SPEC_KEYS = ("transform", "image_size", "resize", "crop", "interpolation", "mean", "std")
# The largest side, in pixels, a spec may resize or crop to: a (3, 4096, 4096) float32 input is 200 MB.
MAX_SIDE = 4096


def preprocess_spec(dataset_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The spec (keys :data:`SPEC_KEYS`; lists, ints and strings only) of the evaluation transform that
    ``build_dataset(dataset_cfg, train=False)`` applies: ``image_size``, ``transform`` (default ``"paper"``),
    ``mean`` and ``std`` (default ImageNet's) of the dataset config."""
    if dataset_cfg.get("image_size") is None:
        raise InferenceError("the dataset config has no image_size; cannot tell the model's input size")
    kind = dataset_cfg.get("transform") or "paper"
    size = _check_size(dataset_cfg["image_size"], "image_size", owner="dataset")
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
    """Raise :class:`InferenceError` unless ``spec`` has every key of :data:`SPEC_KEYS` in its range: a known
    transform, sizes of 1 to :data:`MAX_SIDE` pixels (``[h, w]`` too for ``resize`` and ``crop``, which may
    be null), a torchvision interpolation mode; ``mean`` and ``std`` as :func:`normalisation` checks them."""
    missing = [key for key in SPEC_KEYS if key not in spec]
    if missing:
        raise InferenceError(
            f"preprocess spec lacks {', '.join(missing)}; expected keys {', '.join(SPEC_KEYS)}"
        )
    if spec["transform"] not in TRANSFORM_KINDS:
        raise InferenceError(
            f"preprocess.transform={shown(spec['transform'])}; expected one of {', '.join(TRANSFORM_KINDS)}"
        )
    _check_size(spec["image_size"], "image_size")
    _check_size(spec["resize"], "resize", pair=True)
    if spec["crop"] is not None:
        _check_size(spec["crop"], "crop", pair=True)
    modes = tuple(mode.value for mode in T.InterpolationMode)
    if spec["interpolation"] not in modes:
        raise InferenceError(
            f"preprocess.interpolation={shown(spec['interpolation'])}; expected one of {', '.join(modes)}"
        )
    normalisation(spec["mean"], spec["std"], owner="preprocess")


def _check_size(value: Any, key: str, pair: bool = False, owner: str = "preprocess") -> Any:
    """``value`` if it is a side of 1 to :data:`MAX_SIDE` pixels (an int) or, with ``pair``, ``[h, w]`` of
    such sides; else :class:`InferenceError` naming ``{owner}.{key}``."""
    sides = list(value) if pair and isinstance(value, (list, tuple)) and len(value) == 2 else [value]
    if not all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= MAX_SIDE for s in sides):
        expected = f"a size of 1 to {MAX_SIDE} pixels" + (", or [h, w] of such sizes" if pair else "")
        raise InferenceError(f"{owner}.{key}={shown(value)}; expected {expected}")
    return value


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
    interpolation = T.InterpolationMode(spec["interpolation"])
    steps: list[Callable] = [T.Resize(resize, interpolation=interpolation)]
    if spec["crop"] is not None:
        steps.append(T.CenterCrop(spec["crop"]))
    steps += [T.ToTensor(), T.Normalize(*normalisation(spec["mean"], spec["std"], owner="preprocess"))]
    return T.Compose(steps)


def spec_from_checkpoint(state: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``"preprocess"`` spec, checked by :func:`check_spec`."""
    spec = state.get("preprocess")
    if not isinstance(spec, Mapping):
        found = " holds no preprocess spec" if spec is None else f"'s preprocess is a {type(spec).__name__}"
        raise InferenceError(
            f"the checkpoint{found}; expected a mapping with keys {', '.join(SPEC_KEYS)} (as every "
            "checkpoint of mlcls-train and mlcls-import holds)"
        )
    check_spec(spec)
    return dict(spec)
