"""Create a timm model for multi-label classification and split its parameters into head and backbone."""

from __future__ import annotations

from pathlib import Path

import timm
from torch import nn


def create_model(
    name: str,
    num_classes: int,
    pretrained: bool = True,
    checkpoint_path: str | None = None,
    drop_rate: float = 0.0,
) -> nn.Module:
    """Build timm model ``name`` with a freshly initialised ``num_classes``-way classifier.

    With ``pretrained=True`` timm loads the ImageNet weights from its hub; ``checkpoint_path`` loads a local
    weights file instead (for machines without hub access). In both cases the pretrained classifier is
    dropped, since its classes are not ours.
    """
    if not timm.is_model(name):
        raise ValueError(f"unknown timm model {name!r}; see timm.list_models() for valid names")
    kwargs: dict = {"num_classes": num_classes, "drop_rate": drop_rate}
    if checkpoint_path:
        path = Path(checkpoint_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.checkpoint_path {path} does not exist")
        kwargs["pretrained_cfg_overlay"] = {"file": str(path)}
        pretrained = True
    return timm.create_model(name, pretrained=pretrained, **kwargs)


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Return (head, backbone) trainable parameters; the head is timm's ``get_classifier()``."""
    classifier = model.get_classifier()
    head_ids = {id(p) for p in classifier.parameters()}
    head = [p for p in model.parameters() if p.requires_grad and id(p) in head_ids]
    backbone = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
    if not head:
        raise ValueError(f"{type(model).__name__} exposes no classifier parameters through get_classifier()")
    return head, backbone
