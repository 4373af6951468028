"""Focal loss and asymmetric loss (ASL): BCE with per-entry focusing weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.losses.common import EntrywiseLoss, check_non_negative


def _power(base: Tensor, exponent: float) -> Tensor:
    """``base ** exponent`` for base in [0, 1], exponent >= 0; ``0 ** 0 = 1``, finite gradient at 0."""
    if exponent == 0:
        return torch.ones_like(base)
    return base.clamp_min(torch.finfo(base.dtype).tiny) ** exponent


def focal_term(logits: Tensor, gamma: float, margin: float = 0.0) -> Tensor:
    """``-(1 - sigmoid(x - m))^gamma log sigmoid(x - m)`` elementwise, stable for any finite logit: the
    focal loss of a positive (of a negative at ``-x``), with the margin m of Hill and SPLC."""
    shifted = logits - margin if margin else logits
    return -_power(torch.sigmoid(-shifted), gamma) * F.logsigmoid(shifted)


class FocalLoss(EntrywiseLoss):
    """Focal loss (Lin et al.; the paper's Table 7) per entry, reduced over the entries with a known label::

        l_ic = -alpha_t (1 - p_t)^gamma log p_t,   p_t = sigmoid(x) if y = 1 else sigmoid(-x),
        alpha_t = alpha if y = 1 else 1 - alpha    (alpha_t = 1 when ``alpha`` is None)

    ``(1 - p_t)`` is computed as ``sigmoid(-x)`` or ``sigmoid(x)`` (no cancellation) and ``log p_t`` as a
    log-sigmoid, so extreme logits give finite values and gradients. ``gamma = 0`` and ``alpha = None``
    give BCE. Equals ``torchvision.ops.sigmoid_focal_loss(..., reduction="mean")`` on fully known labels
    (torchvision's ``alpha=-1`` is our ``None``).

    ``gamma`` is the focusing parameter (paper: 2), ``alpha`` in [0, 1] or None (no weighting).
    Reduction: ``reduction`` over the known entries (:class:`~mlcls.losses.common.EntrywiseLoss`).
    """

    name = "focal"

    def __init__(self, gamma: float = 2.0, alpha: float | None = None, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        check_non_negative(gamma=gamma)
        if alpha is not None and not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1] or None, got {alpha}")
        self.gamma = float(gamma)
        self.alpha = None if alpha is None else float(alpha)

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        positive = targets == 1
        signed = torch.where(positive, logits, -logits)  # p_t = sigmoid(signed)
        per_entry = focal_term(signed, self.gamma)
        if self.alpha is not None:
            per_entry = per_entry * torch.where(positive, self.alpha, 1.0 - self.alpha)
        return per_entry


class AsymmetricLoss(EntrywiseLoss):
    """Asymmetric loss (Ridnik, Ben-Baruch et al.; Table 7) per entry, reduced over the known entries::

        l_ic = -y (1 - p)^gamma_pos log p - (1 - y) p_m^gamma_neg log(1 - p_m),
        p = sigmoid(x),   p_m = max(p - clip, 0)   (probability shifting of the negatives)

    ``log p`` is a log-sigmoid and ``1 - p_m = sigmoid(-x) + clip`` where ``p > clip`` (1 elsewhere), so the
    values are exact where the public implementations clamp the probability at 1e-8.
    ``detach_weight=True`` treats the focusing weights ``(1 - p)^gamma_pos`` and ``p_m^gamma_neg`` as
    constants in the backward pass, as the authors' ``disable_torch_grad_focal_loss`` does, but by
    detaching them: the loss never changes the global grad mode (so under ``torch.no_grad()`` nothing
    is recorded). Equals ``timm.loss.AsymmetricLossMultiLabel(..., reduction="mean")`` on fully known
    labels and moderate logits.

    Reduction: ``reduction`` over the known entries (:class:`~mlcls.losses.common.EntrywiseLoss`);
    ``"sum"`` is ASL's reference reduction. Paper values: ``gamma_pos`` 0, ``gamma_neg`` 4, ``clip`` (the
    margin m; 0 disables the shift) 0.05; ASL's reference has ``detach_weight`` true.
    """

    name = "asl"

    def __init__(
        self,
        gamma_pos: float = 0.0,
        gamma_neg: float = 4.0,
        clip: float = 0.05,
        detach_weight: bool = False,
        reduction: str = "mean",
    ) -> None:
        super().__init__(reduction=reduction)
        check_non_negative(gamma_pos=gamma_pos, gamma_neg=gamma_neg)
        if not 0 <= clip < 1:
            raise ValueError(f"clip must be in [0, 1), got {clip}")
        self.gamma_pos, self.gamma_neg, self.clip = float(gamma_pos), float(gamma_neg), float(clip)
        self.detach_weight = detach_weight

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
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
        return torch.where(targets == 1, -weight_pos * F.logsigmoid(logits), -weight_neg * log_neg)
