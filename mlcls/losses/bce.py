"""Binary cross-entropy, paper eq. 19."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlcls.losses import register_loss


@register_loss("bce")
class BCELoss(nn.Module):
    """Eq. 19: ``-y log sigmoid(x) - (1 - y) log sigmoid(-x)``, averaged over entries with a known label.

    Shapes: logits (B, C), targets (B, C) in {1, 0, -1}; entries labelled -1 are excluded from both the
    sum and the count. Returns a scalar (0 when no entry is known).
    """

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        known = targets >= 0
        per_entry = F.binary_cross_entropy_with_logits(logits, targets.clamp(min=0).float(), reduction="none")
        return torch.where(known, per_entry, 0.0).sum() / known.sum().clamp(min=1)
