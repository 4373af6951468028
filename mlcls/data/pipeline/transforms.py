"""Image transforms: the paper's training augmentation and the usual evaluation resize/crop.

``paper`` (Sec. 4.1 and the authors' code): train RandomResizedCrop(size) -> horizontal flip ->
ColorJitter(0.4, 0.4, 0.4) -> tensor -> PCA lighting noise (AlexNet, std 0.1) -> ImageNet normalisation;
eval Resize(size / 0.875) -> CenterCrop(size) -> tensor -> normalisation (224 -> Resize 256 + CenterCrop 224).

``light``: resize to ``size`` x ``size`` and a horizontal flip for training; for small synthetic images
whose objects a random crop would cut away.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision import transforms as T

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

TRANSFORM_KINDS = ("paper", "light")


class Lighting:
    """AlexNet PCA lighting noise: adds ``eigvec @ (alpha * eigval)`` to every pixel, alpha ~ N(0, std).

    Works on a (3, H, W) float tensor in [0, 1] or on a batch (B, 3, H, W) (one alpha per image).
    """

    def __init__(self, std: float = 0.1) -> None:
        self.std = std

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if self.std == 0:
            return img
        batch_shape = img.shape[:-3]
        alpha = torch.randn(*batch_shape, 3, device=img.device) * self.std
        rgb = (alpha * IMAGENET_PCA_EIGVAL.to(img.device)) @ IMAGENET_PCA_EIGVEC.to(img.device).T
        return img + rgb.to(img.dtype)[..., :, None, None]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(std={self.std})"


def eval_resize(size: int) -> int:
    """Shorter-side resize before the center crop: 224 -> 256."""
    return int(round(size / 0.875))


def build_transform(kind: str, image_size: int, train: bool) -> Callable:
    """Return the torchvision transform ``kind`` (one of ``TRANSFORM_KINDS``) for training or evaluation."""
    if kind not in TRANSFORM_KINDS:
        raise ValueError(f"unknown transform {kind!r}; expected one of {', '.join(TRANSFORM_KINDS)}")
    normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if kind == "light":
        steps: list[Callable] = [T.Resize((image_size, image_size))]
        if train:
            steps.append(T.RandomHorizontalFlip())
        return T.Compose([*steps, T.ToTensor(), normalize])
    if train:
        return T.Compose(
            [
                T.RandomResizedCrop(image_size),
                T.RandomHorizontalFlip(),
                T.ColorJitter(0.4, 0.4, 0.4),
                T.ToTensor(),
                Lighting(0.1),
                normalize,
            ]
        )
    return T.Compose([T.Resize(eval_resize(image_size)), T.CenterCrop(image_size), T.ToTensor(), normalize])
