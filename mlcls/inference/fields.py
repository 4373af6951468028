"""The fields of a checkpoint that build its model, checked before anything the size of the model is made:
a checkpoint is data from someone else, and its class count and model options decide how much memory the
model takes. The real model is built only once its ``meta`` twin fits the stored weights
(:func:`check_weights_fit`), so it takes no more memory than the weights in the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlcls.engine.checkpoint import weights_difference
from mlcls.errors import InferenceError, is_integer, is_number, plural, shown
from mlcls.metrics.thresholds import SPLIT_NAMES


def stored_classes(state: Mapping[str, Any], path: str | Path) -> list[str]:
    """The class names of checkpoint ``state`` (read from ``path``): a non-empty list of strings."""
    classes = state.get("classes")
    if not isinstance(classes, Sequence) or isinstance(classes, (str, bytes)):
        raise InferenceError(
            f"{path}: 'classes' is a {type(classes).__name__}; expected the list of class names "
            "(is it an mlcls checkpoint?)"
        )
    if not classes:
        raise InferenceError(f"{path} has no class names ('classes' is empty); is it an mlcls checkpoint?")
    odd = next((name for name in classes if not isinstance(name, str)), None)
    if odd is not None:
        raise InferenceError(
            f"{path}: 'classes' holds {repr(odd)[:40]} ({type(odd).__name__}); expected class names (strings)"
        )
    return list(classes)


def stored_config(state: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    """The run config of checkpoint ``state``: a dict of sections (``{}`` when the file has none)."""
    config = state.get("config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise InferenceError(
            f"{path}: 'config' is a {type(config).__name__}; expected the run's config as a mapping of "
            "sections (model, dataset, ...)"
        )
    return config


def stored_weights(state: Mapping[str, Any], path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of checkpoint ``state``: names to dense tensors, each backed by one stored value per
    element. A sparse or a ``meta`` tensor does not hold the values it stands for, and one whose storage
    is smaller than its elements (a stride-0 expansion or an overlapping view, which ``torch.save`` keeps
    as such) would let a few stored bytes stand for a model of any size: both are refused."""
    weights = state.get("model")
    if not isinstance(weights, dict):
        raise InferenceError(
            f"{path}: 'model' is a {type(weights).__name__}; expected the state dict (names to tensors)"
        )
    for name, tensor in weights.items():
        kind = None
        if not isinstance(tensor, torch.Tensor):
            kind = type(tensor).__name__
        elif tensor.is_meta or tensor.layout != torch.strided:
            kind = "meta tensor" if tensor.is_meta else f"{tensor.layout} tensor"
        if kind is not None:
            raise InferenceError(f"{path}: the weights {name!r} are a {kind}; expected a dense tensor")
        stored = tensor.untyped_storage().nbytes()
        if tensor.numel() * tensor.element_size() > stored:
            raise InferenceError(
                f"{path}: the weights {name} {tuple(tensor.shape)} are backed by {stored} stored bytes, "
                f"fewer than their {tensor.numel()} values need; expected one stored value per element"
            )
    return weights


def check_weights_fit(
    skeleton: nn.Module, weights: Mapping[str, torch.Tensor], num_classes: int, path: str | Path
) -> None:
    """Raise :class:`InferenceError`, naming the first key that differs, unless ``weights`` has exactly the
    keys and shapes of the state dict of ``skeleton``, the model of ``num_classes`` outputs built on the
    ``meta`` device."""
    difference = weights_difference(skeleton.state_dict(), weights, "the model")
    if difference is not None:
        raise InferenceError(
            f"{path}: weights do not fit the model its config describes for "
            f"{plural(num_classes, 'class name')}: {difference}"
        )


# Where a text-query head keeps its class embeddings in a checkpoint's weights (HeadedModel's ``head``).
CLASS_EMBEDDINGS_KEY = "head.class_embeddings"
# How far from 1 the norm of a stored class embedding may be (they are written as float32 unit rows).
UNIT_NORM_TOLERANCE = 1e-3


def stored_class_embeddings(
    weights: Mapping[str, torch.Tensor], classes: Sequence[str], head: str, path: str | Path
) -> torch.Tensor:
    """The class embeddings of a checkpoint with the text-query ``head``, checked against its class list
    before the model is built: one finite floating-point row per class name, each of unit norm (within
    :data:`UNIT_NORM_TOLERANCE`); their width is checked by :func:`check_weights_fit`."""
    embeddings = weights.get(CLASS_EMBEDDINGS_KEY)
    if embeddings is None:
        raise InferenceError(
            f"{path}: its {head} head scores class embeddings, but the weights hold no {CLASS_EMBEDDINGS_KEY}"
        )
    if embeddings.ndim != 2 or embeddings.shape[0] != len(classes) or not embeddings.is_floating_point():
        raise InferenceError(
            f"{path}: the class embeddings are {embeddings.dtype} {tuple(embeddings.shape)} for "
            f"{plural(len(classes), 'class name')}; expected a floating-point row per class"
        )
    if not torch.isfinite(embeddings).all():
        raise InferenceError(f"{path}: the class embeddings hold a non-finite value; expected unit rows")
    off = (embeddings.double().norm(dim=1) - 1).abs()
    if off.max() > UNIT_NORM_TOLERANCE:
        row = int(off.argmax())
        raise InferenceError(
            f"{path}: the class embedding of {shown(classes[row])} has norm {float(off[row]) + 1:.4g}; "
            "expected unit rows"
        )
    return embeddings


def stored_thresholds(state: Mapping[str, Any], num_classes: int, path: str | Path) -> torch.Tensor | None:
    """The calibrated per-class logit thresholds of checkpoint ``state`` as float64 (C,), or None when it
    has none; one number per class, none of them NaN (``±inf``: always / never predicted)."""
    thresholds = state.get("thresholds")
    if thresholds is None:
        return None
    try:
        thresholds = torch.as_tensor(thresholds, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InferenceError(
            f"{path}: 'thresholds' is a {type(thresholds).__name__} that is not a list of numbers ({exc})"
        ) from exc
    if thresholds.numel() != num_classes:
        raise InferenceError(
            f"{path}: {thresholds.numel()} thresholds stored, one per class expected ({num_classes})"
        )
    if thresholds.isnan().any():
        raise InferenceError(f"{path}: the stored thresholds hold NaN; expected a number per class")
    return thresholds


def stored_thresholds_split(state: Mapping[str, Any], path: str | Path) -> str:
    """The split checkpoint ``state``'s thresholds were calibrated on, a key of
    :data:`~mlcls.metrics.thresholds.SPLIT_NAMES`, stored beside them; ``"validation"`` for a checkpoint
    without thresholds (an imported one), where it names nothing."""
    if "thresholds_split" not in state and state.get("thresholds") is None:
        return "validation"
    split = state.get("thresholds_split")
    if not isinstance(split, str) or split not in SPLIT_NAMES:
        raise InferenceError(
            f"{path}: 'thresholds_split' is {shown(split)}; expected one of {', '.join(SPLIT_NAMES)} "
            "(the split the stored thresholds were calibrated on)"
        )
    return split


# What each option of mlcls.models.create_model may be when a checkpoint holds it: (check, expected).
MODEL_FIELDS: dict[str, tuple[Any, str]] = {
    "name": (lambda v: isinstance(v, str) and 0 < len(v) <= 200, "a timm model name"),
    "pretrained": (lambda v: isinstance(v, bool), "true or false"),
    "checkpoint_path": (lambda v: v is None or isinstance(v, str), "a path or null"),
    # the head's options (model.head, configs/model/head/*.yaml), checked beside the model's
    "drop_rate": (lambda v: is_number(v) and 0 <= v < 1, "a probability in [0, 1)"),
    "num_groups": (lambda v: is_integer(v) and v >= 1, "an integer >= 1"),
    "embed_dim": (lambda v: is_integer(v) and v >= 1, "an integer >= 1"),
    "num_heads": (lambda v: is_integer(v) and v >= 1, "an integer >= 1"),
    "lam": (lambda v: is_number(v) and math.isfinite(v), "a finite number"),
    "init_scale": (lambda v: is_number(v) and 0 < v <= 100, "a number in (0, 100]"),
}


def check_model_fields(fields: Mapping[str, Any]) -> None:
    """Raise :class:`InferenceError` naming the first of a checkpoint's model ``fields`` whose value is not of
    its kind (:data:`MODEL_FIELDS`); sizes are checked against the weights by :func:`check_weights_fit`."""
    for key, value in fields.items():
        check, expected = MODEL_FIELDS.get(key, (lambda v: True, ""))
        if not check(value):
            raise InferenceError(f"the checkpoint's model.{key} is {shown(value)}; expected {expected}")
