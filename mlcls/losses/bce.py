"""Binary cross-entropy (paper eq. 19), optionally weighted by class frequency."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.losses import register_loss
from mlcls.losses.common import MultiLabelLoss

POS_WEIGHTS = ("none", "freq")


@register_loss("bce")
class BCELoss(MultiLabelLoss):
    """Eq. 19 per entry, averaged over the entries with a known label::

        l_ic = -w_c y_ic log sigmoid(x_ic) - (1 - y_ic) log sigmoid(-x_ic)

    ``pos_weight="none"``: ``w_c = 1``. ``pos_weight="freq"``: class-frequency weighting computed once
    from the training labels by :meth:`setup`, ``w_c = n_c^- / n_c^+`` with ``n_c^+`` and ``n_c^-`` the
    numbers of positive and negative training labels of class c (unknown labels not counted), so that
    the positives of a class weigh as much in total as its negatives; ``w_c = 1`` for a class without
    any training positive. The paper's BCE baseline of Table 7 is weighted by class frequencies.

    Reduction: sum over known entries (label 1 or 0) divided by their number (0 when none is known).
    Shapes: logits (B, C), targets (B, C) in {1, 0, -1}; scalar result.
    """

    class_weight: Tensor | None

    def __init__(self, pos_weight: str = "none") -> None:
        super().__init__()
        if pos_weight not in POS_WEIGHTS:
            raise ValueError(
                f"pos_weight must be one of {', '.join(map(repr, POS_WEIGHTS))}; got {pos_weight!r}"
            )
        self.pos_weight = pos_weight
        self.register_buffer("class_weight", None, persistent=False)

    def setup(self, train_labels: Tensor) -> None:
        """Compute the class weights ``w_c`` (C,) from the training labels (N, C) in {1, 0, -1}."""
        if self.pos_weight == "freq":
            positives = (train_labels == 1).sum(0).double()
            negatives = (train_labels == 0).sum(0).double()
            self.class_weight = torch.where(positives > 0, negatives / positives.clamp(min=1), 1.0).float()

    def compute(self, logits: Tensor, targets: Tensor) -> Tensor:
        weight = None
        if self.pos_weight == "freq":
            if self.class_weight is None:
                raise RuntimeError("bce with pos_weight='freq' needs setup(train_labels) before forward")
            if self.class_weight.shape[0] != logits.shape[1]:
                raise ValueError(
                    f"bce was set up for {len(self.class_weight)} classes, got {logits.shape[1]}"
                )
            weight = self.class_weight.to(logits)
        known = targets >= 0
        per_entry = F.binary_cross_entropy_with_logits(
            logits, (targets == 1).to(logits.dtype), pos_weight=weight, reduction="none"
        )
        return torch.where(known, per_entry, 0.0).sum() / known.sum().clamp(min=1)

    def extra_repr(self) -> str:
        return f"pos_weight={self.pos_weight!r}"
