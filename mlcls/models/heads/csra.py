"""CSRA, class-specific residual attention (Zhu & Wu, ICCV 2021), with the parameter names of the authors'
released ``MHA`` (``multi_head.{i}.head.weight``, each a 1x1 convolution of shape (C, D, 1, 1)).

For one head with temperature T, class c and the backbone's features x_p at positions p = 1..N (N = H W):

    s_c(p) = w_c . x_p / ||w_c||                       class score map, w_c normalised over the D channels
    base_c = (1 / N) sum_p s_c(p)                      average pooling of the scores
    att_c  = sum_p softmax_p(T s_c(p)) s_c(p)           (T = "max": max_p s_c(p))
    logit_c = base_c + lam att_c

The multi-head version sums the heads' logits, each head with its own weights and temperature:
{1}, {1, max}, {1, 2, 4, max}, {1..5, max}, {1..7, max} for 1, 2, 4, 6, 8 heads, as released.
"""

from __future__ import annotations

import torch
from torch import nn

MAX_POOLING = None  # the temperature that stands for max-pooling ("T = 99" in the released code)
TEMPERATURES: dict[int, tuple[float | None, ...]] = {
    1: (1.0,),
    2: (1.0, MAX_POOLING),
    4: (1.0, 2.0, 4.0, MAX_POOLING),
    6: (1.0, 2.0, 3.0, 4.0, 5.0, MAX_POOLING),
    8: (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, MAX_POOLING),
}


class ResidualAttention(nn.Module):
    """One CSRA head: ``forward(features (B, D, H, W) or tokens (B, N, D)) -> logits (B, C)``."""

    def __init__(self, in_features: int, num_classes: int, temperature: float | None, lam: float) -> None:
        super().__init__()
        self.temperature, self.lam = temperature, lam
        self.head = nn.Conv2d(in_features, num_classes, 1, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight.flatten(1)  # (C, D)
        weight = weight / weight.norm(dim=1, keepdim=True)
        positions = features.flatten(2) if features.ndim == 4 else features.transpose(1, 2)  # (B, D, N)
        scores = torch.einsum("cd,bdn->bcn", weight.to(features.dtype), positions)
        base = scores.mean(dim=2)
        if self.temperature is MAX_POOLING:
            attention = scores.amax(dim=2)
        else:
            attention = (scores * torch.softmax(scores * self.temperature, dim=2)).sum(dim=2)
        return base + self.lam * attention


class CSRA(nn.Module):
    """Multi-head CSRA: the sum of ``num_heads`` :class:`ResidualAttention` heads (:data:`TEMPERATURES`).

    ``forward(features (B, D, H, W) or tokens (B, N, D)) -> logits (B, C)``. On a ViT it takes the patch
    tokens only (``patch_tokens_only``): :class:`~mlcls.models.heads.HeadedModel` drops the class token and
    any other prefix token first, as the authors' ViT-CSRA drops the class token.
    """

    patch_tokens_only = True

    def __init__(self, in_features: int, num_classes: int, num_heads: int = 1, lam: float = 0.1) -> None:
        super().__init__()
        if num_heads not in TEMPERATURES:
            raise ValueError(f"CSRA num_heads={num_heads!r}; expected one of {sorted(TEMPERATURES)}")
        self.multi_head = nn.ModuleList(
            [ResidualAttention(in_features, num_classes, t, lam) for t in TEMPERATURES[num_heads]]
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(features) for head in self.multi_head]).sum(dim=0)
