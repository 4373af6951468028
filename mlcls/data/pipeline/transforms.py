"""Image transforms (``dataset.transform``): PIL RGB image -> normalised float32 (3, size, size).

``paper`` (Sec. 4.1 and the authors' code): train RandomResizedCrop(size) -> horizontal flip ->
ColorJitter(0.4, 0.4, 0.4) -> tensor -> PCA lighting noise (AlexNet, std 0.1) -> normalisation;
eval Resize(size / 0.875) -> CenterCrop(size) (224 -> Resize 256 + CenterCrop 224).
``light``: train squash-resize to ``size`` x ``size`` and a horizontal flip (small synthetic images whose
objects a random crop would cut away). ``crop``: train RandomResizedCrop(size) and a horizontal flip, no
colour change (experiment=finetune: a pretrained backbone on a few hundred images).
``strong`` (the ASL / ML-Decoder recipe): train squash-resize -> :class:`CutoutPIL` -> the ``randaugment``
package's RandAugment (1.0.2, ML-Decoder's); the ML-Decoder presets set mean 0 and std 1 (the
released recipe feeds TResNet [0, 1] pixels). ``strong_timm``: ``strong`` with timm's RandAugment
(:data:`TIMM_RANDAUGMENT`), another policy, not the recipe's.
``light``, ``crop``, ``strong`` and ``strong_timm`` evaluate on a squash-resize (:data:`SQUASH_EVAL_KINDS`):
the whole image, none of each side cropped away.

Normalisation: ``(x - mean) / std`` per RGB channel on [0, 1] pixels (:func:`normalisation`). Random draws
come from torch's, Python's and NumPy's generators, all three seeded per sample by ``seeded_call``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import randaugment.randaugment
import torch
from PIL import Image
from timm.data.auto_augment import rand_augment_transform
from torchvision import transforms as T

from mlcls.data.images import MAX_ASPECT_RATIO, check_aspect_ratio
from mlcls.errors import ConfigError, shown

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Principal components of ImageNet RGB pixels (AlexNet's lighting augmentation), on [0, 1] pixels.
IMAGENET_PCA_EIGVAL = torch.tensor([0.2175, 0.0188, 0.0045])
IMAGENET_PCA_EIGVEC = torch.tensor(
    [
        [-0.5675, 0.7192, 0.4009],
        [-0.5808, -0.0045, -0.8140],
        [-0.5836, -0.6948, 0.4203],
    ]
)

TRANSFORM_KINDS = ("paper", "light", "crop", "strong", "strong_timm")
# Transforms whose evaluation is a squash-resize to image_size x image_size, without crop.
SQUASH_EVAL_KINDS = ("light", "crop", "strong", "strong_timm")
# timm's RandAugment config of ``strong_timm``: magnitude 9 (of 10), 2 operations per image, each applied
# with probability 0.5 (timm's default), its magnitude drawn from N(9, 0.5) clipped to [0, 10].
TIMM_RANDAUGMENT = "rand-m9-n2-mstd0.5"
# Side of the ``strong`` recipe's cutout rectangle, as a fraction of the image's side.
CUTOUT_FACTOR = 0.5


class AspectRatioCheck:
    """A transform step that passes a PIL image on unchanged after :func:`check_aspect_ratio`: put before a
    resize that keeps the aspect ratio, it refuses an image before the resize allocates its output."""

    def __call__(self, img: Image.Image) -> Image.Image:
        check_aspect_ratio(*img.size)
        return img

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_aspect_ratio={MAX_ASPECT_RATIO})"


class Lighting:
    """AlexNet PCA lighting noise: adds ``eigvec @ (alpha * eigval)`` to every pixel, alpha ~ N(0, std), of
    a float (3, H, W) image in [0, 1] or a (B, 3, H, W) batch (one alpha per image)."""

    std = 0.1  # the paper's

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        batch_shape = img.shape[:-3]
        alpha = torch.randn(*batch_shape, 3, device=img.device) * self.std
        rgb = (alpha * IMAGENET_PCA_EIGVAL.to(img.device)) @ IMAGENET_PCA_EIGVEC.to(img.device).T
        return img + rgb.to(img.dtype)[..., :, None, None]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(std={self.std})"


class CutoutPIL:
    """Cutout on a PIL image (a new one): one rectangle of a single random colour, as ML-Decoder's and ASL's
    ``CutoutPIL`` paints it. With ``k = int(cutout_factor * W + 0.5)`` it spans columns ``x - k // 2`` to
    ``x + k // 2``, both included (the authors' ``ImageDraw.rectangle``): 225 at 448 px and factor 0.5, one
    at factor 0; rows likewise with the height. The centre ``(x, y)``, then each of R, G, B in 0..255, are
    drawn uniformly from torch's CPU generator; the rectangle is clipped to the image. (The authors take the
    width for the rows: on their square images the two agree.)"""

    def __init__(self, cutout_factor: float = CUTOUT_FACTOR) -> None:
        if not 0.0 <= cutout_factor <= 1.0:
            raise ValueError(f"cutout_factor {cutout_factor}; expected a fraction of the side in [0, 1]")
        self.cutout_factor = cutout_factor

    def __call__(self, img: Image.Image) -> Image.Image:
        width, height = img.size
        half_width = int(self.cutout_factor * width + 0.5) // 2
        half_height = int(self.cutout_factor * height + 0.5) // 2
        x, y = int(torch.randint(width, (1,))), int(torch.randint(height, (1,)))
        colour = tuple(torch.randint(256, (3,)).tolist())
        # PIL's box is half-open: one past the last column and row painted
        left, right = max(0, x - half_width), min(width, x + half_width + 1)
        top, bottom = max(0, y - half_height), min(height, y + half_height + 1)
        out = img.copy()
        out.paste(colour, (left, top, right, bottom))
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cutout_factor={self.cutout_factor})"


class _NumpyWithInt(types.ModuleType):
    """NumPy as the ``randaugment`` package's module sees it: every NumPy attribute, and ``int``, the alias of
    the builtin that NumPy 1.24 removed and the package's ``SubPolicy`` still reads (``astype(np.int)``).
    The builtin is what the alias was, so the package computes what it computed under older NumPy."""

    int = int

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


if not hasattr(np, "int"):  # NumPy >= 1.24
    randaugment.randaugment.np = _NumpyWithInt("numpy")


def normalisation(
    mean: Any = IMAGENET_MEAN, std: Any = IMAGENET_STD, owner: str = "dataset"
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """``(mean, std)`` as tuples of 3 floats (R, G, B), checked: each 3 finite numbers, every std > 0; else
    a one-line :class:`ConfigError` naming ``{owner}.mean`` or ``{owner}.std``. ``None`` (a config written
    before the keys existed) stands for ImageNet's."""
    checked = []
    for key, value, default in (("mean", mean, IMAGENET_MEAN), ("std", std, IMAGENET_STD)):
        value = default if value is None else value
        numbers = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else []
        valid = len(numbers) == 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in numbers
        )
        if not valid or (key == "std" and min(numbers) <= 0):
            expected = "3 numbers > 0 (R, G, B)" if key == "std" else "3 numbers (R, G, B)"
            raise ConfigError(f"{owner}.{key}={shown(value)}; expected {expected}")  # a file's value, cut
        checked.append(tuple(float(v) for v in numbers))
    return checked[0], checked[1]


def eval_resize(size: int) -> int:
    """Shorter-side resize before the center crop: 224 -> 256."""
    return int(round(size / 0.875))


def eval_steps(kind: str, image_size: int) -> list[Callable]:
    """The PIL steps of ``kind``'s evaluation: a squash-resize to ``image_size`` x ``image_size``
    (:data:`SQUASH_EVAL_KINDS`), or the ``paper`` shorter-side resize and centre crop."""
    if kind in SQUASH_EVAL_KINDS:
        return [T.Resize((image_size, image_size))]
    return [AspectRatioCheck(), T.Resize(eval_resize(image_size)), T.CenterCrop(image_size)]


def build_transform(
    kind: str,
    image_size: int,
    train: bool,
    mean: Sequence[float] | None = IMAGENET_MEAN,
    std: Sequence[float] | None = IMAGENET_STD,
) -> Callable:
    """The torchvision transform ``kind`` (one of ``TRANSFORM_KINDS``) for training or evaluation: PIL RGB
    image -> float32 (3, ``image_size``, ``image_size``), normalised with ``mean`` and ``std``."""
    if kind not in TRANSFORM_KINDS:
        raise ValueError(f"unknown transform {kind!r}; expected one of {', '.join(TRANSFORM_KINDS)}")
    normalize = T.Normalize(*normalisation(mean, std))
    if not train:
        steps = eval_steps(kind, image_size)
    elif kind == "paper":
        steps = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ColorJitter(0.4, 0.4, 0.4)]
        return T.Compose([*steps, T.ToTensor(), Lighting(), normalize])
    elif kind == "light":
        steps = [T.Resize((image_size, image_size)), T.RandomHorizontalFlip()]
    elif kind == "crop":
        steps = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    elif kind == "strong":
        # ML-Decoder's train.py: per image 2 of 15 operations, each with probability 0.5 and a magnitude
        # drawn from 1..9 (the package's 18,225 policies); from Python's and NumPy's generators.
        steps = [T.Resize((image_size, image_size)), CutoutPIL(CUTOUT_FACTOR), randaugment.RandAugment()]
    else:  # strong_timm, with timm's settings for its training transforms
        fill = tuple(round(255 * channel) for channel in IMAGENET_MEAN)  # what geometric operations uncover
        bilinear = Image.Resampling.BILINEAR
        hparams = {"translate_const": int(image_size * 0.45), "img_mean": fill, "interpolation": bilinear}
        randaug = rand_augment_transform(TIMM_RANDAUGMENT, hparams)
        steps = [T.Resize((image_size, image_size)), CutoutPIL(CUTOUT_FACTOR), randaug]
    return T.Compose([*steps, T.ToTensor(), normalize])
