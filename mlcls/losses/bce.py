"""Binary cross-entropy (paper eq. 19), optionally weighted by class frequency."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.losses.common import EntrywiseLoss, check_choice

if TYPE_CHECKING:
    from mlcls.data.datasets.labels import LabelCounts

POS_WEIGHTS = ("none", "freq")


def assumed_negative_bce(logits: Tensor, targets: Tensor, pos_weight: Tensor | None = None) -> Tensor:
    """BCE per entry with every label but a positive taken as a negative: ``-w_c log p`` where the label
    is 1, ``-log(1 - p)`` where it is 0 or -1 (log-sigmoids: finite for any finite logit)."""
    return F.binary_cross_entropy_with_logits(
        logits, (targets == 1).to(logits.dtype), pos_weight=pos_weight, reduction="none"
    )


class BinaryCrossEntropyLoss(EntrywiseLoss):
    """Eq. 19 per entry, reduced over the entries with a known label::

        l_ic = -w_c y_ic log sigmoid(x_ic) - (1 - y_ic) log sigmoid(-x_ic)

    ``pos_weight="none"``: ``w_c = 1``. ``pos_weight="freq"``: class-frequency weighting computed once
    from the training labels by :meth:`setup`, ``w_c = n_c^- / n_c^+`` with ``n_c^+`` and ``n_c^-`` the
    numbers of positive and negative training labels of class c (unknown labels not counted), so that
    the positives of a class weigh as much in total as its negatives; ``w_c = 1`` for a class without
    any training positive. The paper's BCE baseline of Table 7 is weighted by class frequencies.

    Reduction: ``reduction`` over the known entries (:class:`~mlcls.losses.common.EntrywiseLoss`);
    ``"sum_per_sample"`` is eq. 19 as written. Shapes: logits (B, C), targets (B, C) in {1, 0, -1}; scalar.
    """

    name = "bce"
    class_weight: Tensor

    def __init__(self, pos_weight: str = "none", reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        self.pos_weight = check_choice("pos_weight", pos_weight, POS_WEIGHTS)
        # Empty until setup(); a buffer from the start so that .to(device) before setup() places it too.
        self.register_buffer("class_weight", torch.empty(0), persistent=False)

    def setup(self, train_labels: Tensor | LabelCounts) -> None:
        """Compute ``w_c`` (C,) from the training labels: (N, C) in {1, 0, -1}, or their ``LabelCounts``."""
        if self.pos_weight == "freq":
            if isinstance(train_labels, Tensor):
                positives, negatives = (train_labels == 1).sum(0), (train_labels == 0).sum(0)
            else:
                positives, negatives = train_labels.positives, train_labels.negatives
            positives, negatives = positives.double(), negatives.double()
            weight = torch.where(positives > 0, negatives / positives.clamp(min=1), 1.0)
            self.class_weight = weight.to(self.class_weight)

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        weight = None
        if self.pos_weight == "freq":
            if self.class_weight.numel() == 0:
                raise RuntimeError("bce with pos_weight='freq' needs setup(train_labels) before forward")
            if self.class_weight.shape[0] != logits.shape[1]:
                raise ValueError(
                    f"bce was set up for {self.class_weight.shape[0]} classes, got {logits.shape[1]}"
                )
            weight = self.class_weight.to(logits)  # the buffer itself when device and dtype match
        return assumed_negative_bce(logits, targets, pos_weight=weight)
