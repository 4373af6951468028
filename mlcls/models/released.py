"""The backbones of the authors' released multi-label checkpoints, as timm models, and their parameter names.

ML-Decoder and ASL release TResNets whose normalisation layers are InPlace-ABN (``inplace_abn``): a
BatchNorm whose scale is used as ``|weight| + eps`` and whose activation is part of the layer. Their state
dicts name a convolution and its normalisation ``<conv>.0`` and ``<conv>.1`` (``<conv>.0.0`` and
``<conv>.0.1`` where an anti-aliasing blur follows, at stride 2), where timm's TResNet names them
``<conv>.conv`` and ``<conv>.bn``; :func:`tresnet_key` and :func:`tresnet_value` translate one entry.

The variants are told apart by their stem width and block counts (:data:`TRESNETS`). timm has no
``tresnet_v2_xl`` (ML-Decoder's TResNet-XL): it is registered here, without pretrained weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import timm
import torch
from timm.models import build_model_with_cfg, register_model
from timm.models.tresnet import TResNet

# timm name -> (blocks per layer, stem channels, bottleneck blocks in layers 1-2); released by
TRESNETS: dict[str, tuple[tuple[int, int, int, int], int, bool]] = {
    "tresnet_m": ((3, 4, 11, 3), 64, False),  # ML-Decoder, ASL (TResNet-M)
    "tresnet_l": ((4, 5, 18, 3), 76, False),  # ASL (TResNet-L, width 1.2)
    "tresnet_xl": ((4, 5, 24, 3), 83, False),  # ASL (TResNet-XL, width 1.3)
    "tresnet_v2_l": ((3, 4, 23, 3), 64, True),  # ML-Decoder (its TResNet-L)
    "tresnet_v2_xl": ((3, 8, 34, 5), 64, True),  # ML-Decoder (its TResNet-XL)
}
# InPlace-ABN scales by |weight| + eps, with the eps of its normalisation (inplace_abn's default)
INPLACE_ABN_EPS = 1e-5
# <conv>.<i>, <conv>.0.<i> (followed by a blur) and downsample.<j>.<i>: i = 0 the convolution, 1 the norm
_CONV_NORM = re.compile(r"(?P<owner>(?:^|\.)(?:conv\d+|downsample\.\d+))\.(?:0\.)?(?P<index>[01])\.")


def _tresnet_v2_xl(pretrained: bool = False, **kwargs) -> TResNet:
    """ML-Decoder's TResNet-XL: layers [3, 8, 34, 5], bottleneck blocks throughout, width 1.0."""
    kwargs["pretrained_cfg"] = kwargs.get("pretrained_cfg") or {
        "num_classes": 1000,
        "input_size": (3, 640, 640),
        "mean": (0.0, 0.0, 0.0),
        "std": (1.0, 1.0, 1.0),
    }
    return build_model_with_cfg(
        TResNet,
        "tresnet_v2_xl",
        pretrained,
        feature_cfg={"out_indices": (1, 2, 3, 4), "flatten_sequential": True},
        layers=[3, 8, 34, 5],
        v2=True,
        **kwargs,
    )


if not timm.is_model("tresnet_v2_xl"):
    _tresnet_v2_xl.__name__ = "tresnet_v2_xl"
    register_model(_tresnet_v2_xl)


def tresnet_variant(weights: Mapping[str, torch.Tensor], prefix: str = "body.") -> str | None:
    """The :data:`TRESNETS` name whose stem width and block counts ``weights`` (released names, the body's
    keys under ``prefix``) have; None when they are no variant's. A key whose block is not a number of at
    most 6 digits (``layer1.x.conv1``) counts no block: it is left to the caller, which finds no place for
    it."""
    stem = weights.get(f"{prefix}conv1.0.weight")
    if not isinstance(stem, torch.Tensor) or stem.ndim != 4:
        return None
    blocks = []
    for layer in range(1, 5):
        layer_prefix = f"{prefix}layer{layer}."
        indices = [
            key[len(layer_prefix) :].split(".", 1)[0] for key in weights if key.startswith(layer_prefix)
        ]
        found = {int(index) for index in indices if index.isascii() and index.isdigit() and len(index) <= 6}
        blocks.append(max(found) + 1 if found else 0)
    bottleneck = f"{prefix}layer1.0.conv3.0.weight" in weights
    for name, spec in TRESNETS.items():
        if spec == (tuple(blocks), stem.shape[0], bottleneck):
            return name
    return None


def tresnet_key(key: str) -> str:
    """The timm name of a released TResNet state-dict key: ``<conv>.0`` / ``<conv>.0.0`` -> ``<conv>.conv``,
    ``<conv>.1`` / ``<conv>.0.1`` -> ``<conv>.bn`` (and the same for ``downsample.<j>``); others unchanged."""
    return _CONV_NORM.sub(lambda m: f"{m['owner']}.{'conv' if m['index'] == '0' else 'bn'}.", key, count=1)


def tresnet_value(timm_key: str, value: torch.Tensor) -> torch.Tensor:
    """The value of a released entry for timm's BatchNorm at ``timm_key``: an InPlace-ABN scale becomes
    ``|weight| + eps`` (the scale it applies); every other tensor is kept."""
    if timm_key.endswith(".bn.weight"):
        return value.abs() + INPLACE_ABN_EPS
    return value
