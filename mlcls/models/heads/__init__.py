"""Classifier heads on a timm backbone's features: ``linear`` (timm's global pooling + fc, the paper's),
``mldecoder`` (:mod:`.mldecoder`) and ``csra`` (:mod:`.csra`); the text-query heads ``mldecoder_zsl`` and
``cosine`` (:mod:`.text_query`), whose classes are the rows of their class embeddings (swapped there for
a zero-shot evaluation's).

The non-linear heads take the backbone's unpooled output, a (B, D, H, W) map or (B, N, D) tokens, in a
:class:`HeadedModel` whose ``get_classifier()`` is the head (the optimizer's ``head`` parameter group); a
head whose ``patch_tokens_only`` is true (CSRA, as its released ViT model) gets a ViT's patch tokens only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mlcls.models.heads.csra import CSRA
from mlcls.models.heads.mldecoder import MLDecoder
from mlcls.models.heads.text_query import CosineHead, MLDecoderZSL

# The heads with weights of their own for each class, and those whose classes are text (built from class
# embeddings, any class list at prediction time).
HEADS = ("linear", "mldecoder", "csra")
TEXT_HEADS = ("mldecoder_zsl", "cosine")


# Each head's module but linear's, built by mlcls.models.factory.create_model from (in_features,
# num_classes, **options), or (in_features, class_embeddings, **options) for a text-query head.
HEAD_MODULES: dict[str, type[nn.Module]] = {
    "mldecoder": MLDecoder,
    "csra": CSRA,
    "mldecoder_zsl": MLDecoderZSL,
    "cosine": CosineHead,
}


def class_rows(classifier: nn.Module) -> list[str] | None:
    """The entries of ``classifier.state_dict()`` that hold one row per class along their first axis (what
    ``model.init_from`` matches by class name), the rest of the head shared by all classes; None for a head
    it does not know. A linear layer's weight and bias; CSRA's 1x1 convolutions; ML-Decoder's queries, group
    maps and biases (one row per class only with one query per class, ``num_groups`` >= C); a text-query
    head's class embeddings."""
    if isinstance(classifier, nn.Linear):
        return [name for name, _ in classifier.named_parameters()]
    if isinstance(classifier, CSRA):
        return [f"multi_head.{i}.head.weight" for i in range(len(classifier.multi_head))]
    if isinstance(classifier, MLDecoder):
        return ["decoder.query_embed.weight", "decoder.duplicate_pooling", "decoder.duplicate_pooling_bias"]
    if isinstance(classifier, (MLDecoderZSL, CosineHead)):
        return ["class_embeddings"]
    return None


class HeadedModel(nn.Module):
    """A timm backbone without classifier and a head: ``forward(images (B, 3, H, W)) -> logits (B, C)``."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        # timm models such as Swin give channels-last maps (B, H, W, D); the heads take (B, D, H, W)
        self.channels_last_features = getattr(backbone, "output_fmt", "NCHW") == "NHWC"
        # tokens (B, N, D) that precede a ViT's patch tokens, dropped before a patch_tokens_only head
        patch_tokens_only = getattr(head, "patch_tokens_only", False)
        self.num_prefix_tokens = int(getattr(backbone, "num_prefix_tokens", 0)) if patch_tokens_only else 0

    @property
    def pretrained_cfg(self) -> dict[str, Any]:
        """The backbone's timm ``pretrained_cfg`` (input size, mean, std)."""
        return self.backbone.pretrained_cfg

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """The backbone's unpooled features, (B, D, H', W') or tokens (B, N, D)."""
        features = self.backbone.forward_features(images)
        if self.channels_last_features and features.ndim == 4:
            features = features.permute(0, 3, 1, 2)
        return features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.forward_features(images)
        if self.num_prefix_tokens and features.ndim == 3:
            features = features[:, self.num_prefix_tokens :]
        return self.head(features)

    def get_classifier(self) -> nn.Module:
        """The head module, whose ``state_dict()`` has the released module's keys."""
        return self.head
