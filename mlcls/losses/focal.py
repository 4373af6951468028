"""Focal loss and asymmetric loss (ASL): BCE with per-entry focusing weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.losses import register_loss
from mlcls.losses.common import MultiLabelLoss


def _power(base: Tensor, exponent: float) -> Tensor:
    """``base ** exponent`` for base in [0, 1], exponent >= 0; ``0 ** 0 = 1``, finite gradient at 0."""
    if exponent == 0:
        return torch.ones_like(base)
    return base.clamp_min(torch.finfo(base.dtype).tiny) ** exponent


def _mean_over_known(per_entry: Tensor, targets: Tensor) -> Tensor:
    known = targets >= 0
    return torch.where(known, per_entry, 0.0).sum() / known.sum().clamp(min=1)


def _check_gamma(**gammas: float) -> None:
    for name, value in gammas.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


@register_loss("focal")
class FocalLoss(MultiLabelLoss):
    """Focal loss (Lin et al.) per entry, averaged over the entries with a known label::

        l_ic = -alpha_t (1 - p_t)^gamma log p_t,   p_t = sigmoid(x) if y = 1 else sigmoid(-x),
        alpha_t = alpha if y = 1 else 1 - alpha    (alpha_t = 1 when ``alpha`` is None)

    ``(1 - p_t)`` is computed as ``sigmoid(-x)`` or ``sigmoid(x)`` (no cancellation) and ``log p_t`` as a
    log-sigmoid, so extreme logits give finite values and gradients. ``gamma = 0`` and ``alpha = None``
    give BCE. Equals ``torchvision.ops.sigmoid_focal_loss(..., reduction="mean")`` on fully known labels
    (torchvision's ``alpha=-1`` is our ``None``).

    Reduction: sum over known entries divided by their number. Shapes: logits (B, C), targets (B, C) in
    {1, 0, -1}; scalar result.

    Args:
        gamma: focusing parameter (paper: 2).
        alpha: weight of the positives in [0, 1], or None for no weighting.
    """

    def __init__(self, gamma: float = 2.0, alpha: float | None = None) -> None:
        super().__init__()
        _check_gamma(gamma=gamma)
        if alpha is not None and not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1] or None, got {alpha}")
        self.gamma = float(gamma)
        self.alpha = None if alpha is None else float(alpha)

    def compute(self, logits: Tensor, targets: Tensor) -> Tensor:
        positive = targets == 1
        signed = torch.where(positive, logits, -logits)  # p_t = sigmoid(signed)
        per_entry = -_power(torch.sigmoid(-signed), self.gamma) * F.logsigmoid(signed)
        if self.alpha is not None:
            per_entry = per_entry * torch.where(positive, self.alpha, 1.0 - self.alpha)
        return _mean_over_known(per_entry, targets)

    def extra_repr(self) -> str:
        return f"gamma={self.gamma}, alpha={self.alpha}"


@register_loss("asl")
class AsymmetricLoss(MultiLabelLoss):
    """Asymmetric loss (Ridnik, Ben-Baruch et al.) per entry, averaged over the entries with a known label::

        l_ic = -y (1 - p)^gamma_pos log p - (1 - y) p_m^gamma_neg log(1 - p_m),
        p = sigmoid(x),   p_m = max(p - clip, 0)   (probability shifting of the negatives)

    ``log p`` is a log-sigmoid and ``1 - p_m = sigmoid(-x) + clip`` where ``p > clip`` (1 elsewhere), so the
    values are exact where the public implementations clamp the probability at 1e-8.
    ``detach_weight=True`` treats the focusing weights ``(1 - p)^gamma_pos`` and ``p_m^gamma_neg`` as
    constants in the backward pass, as the authors' ``disable_torch_grad_focal_loss`` does, but by
    detaching them: the loss never changes the global grad mode (so under ``torch.no_grad()`` nothing
    is recorded). Equals ``timm.loss.AsymmetricLossMultiLabel(..., reduction="mean")`` on fully known
    labels and moderate logits.

    Reduction: sum over known entries divided by their number. Shapes: logits (B, C), targets (B, C) in
    {1, 0, -1}; scalar result.

    Args:
        gamma_pos: focusing parameter of the positives (paper: 0).
        gamma_neg: focusing parameter of the negatives (paper: 4).
        clip: probability margin m of the negatives (paper: 0.05); 0 disables the shift.
        detach_weight: no gradient through the focusing weights.
    """

    def __init__(
        self, gamma_pos: float = 0.0, gamma_neg: float = 4.0, clip: float = 0.05, detach_weight: bool = False
    ) -> None:
        super().__init__()
        _check_gamma(gamma_pos=gamma_pos, gamma_neg=gamma_neg)
        if not 0 <= clip < 1:
            raise ValueError(f"clip must be in [0, 1), got {clip}")
        self.gamma_pos, self.gamma_neg, self.clip = float(gamma_pos), float(gamma_neg), float(clip)
        self.detach_weight = detach_weight

    def compute(self, logits: Tensor, targets: Tensor) -> Tensor:
        prob = torch.sigmoid(logits)
        weight_pos = _power(torch.sigmoid(-logits), self.gamma_pos)
        if self.clip > 0:
            shifted = prob > self.clip
            weight_neg = _power((prob - self.clip).clamp_min(0.0), self.gamma_neg)
            log_neg = torch.where(shifted, torch.log(torch.sigmoid(-logits) + self.clip), 0.0)
        else:
            weight_neg = _power(prob, self.gamma_neg)
            log_neg = F.logsigmoid(-logits)
        if self.detach_weight:
            weight_pos, weight_neg = weight_pos.detach(), weight_neg.detach()
        per_entry = torch.where(targets == 1, -weight_pos * F.logsigmoid(logits), -weight_neg * log_neg)
        return _mean_over_known(per_entry, targets)

    def extra_repr(self) -> str:
        return (
            f"gamma_pos={self.gamma_pos}, gamma_neg={self.gamma_neg}, clip={self.clip}, "
            f"detach_weight={self.detach_weight}"
        )
