"""Multi-similarity loss (paper eq. 20) with the positive temperature of Table 4a, and Su's ZLPR loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.losses.common import MultiLabelLoss, check_positive, masked_logsumexp


class MultiSimilarityLoss(MultiLabelLoss):
    """Multi-similarity loss, eq. 20, with temperature ``T_P = tp`` on the positives (Table 4a: 1, 2, 4;
    4 is best)::

        l_i = log(1 + (sum_{p in P_i} exp(-x_ip / T_P))^T_P) + log(1 + sum_{n in N_i} exp(x_in))
            = softplus(T_P logsumexp_{P_i}(-x / T_P)) + softplus(logsumexp_{N_i}(x))

    i.e. BCE on the hard positive ``-T_P logsumexp(-x_p / T_P)`` and the hard negative
    ``logsumexp(x_n)`` (eq. 21). An empty set contributes ``log(1 + 0) = 0``. Logits are compared with the
    fixed zero of the sigmoid, so unlike twoway the loss is not shift-invariant.

    Reduction: mean over samples with at least one known label (a sample without positives still
    pushes its negatives down).
    """

    name = "multisim"

    def __init__(self, tp: float = 4.0) -> None:
        super().__init__()
        check_positive(tp=tp)
        self.tp = float(tp)

    def compute(self, logits: Tensor, targets: Tensor) -> Tensor:
        positive, negative = targets == 1, targets == 0
        hard_pos = self.tp * masked_logsumexp(-logits / self.tp, positive, 1).squeeze(1)
        hard_neg = masked_logsumexp(logits, negative, 1).squeeze(1)
        per_sample = F.softplus(hard_pos) + F.softplus(hard_neg)
        known = (positive | negative).any(1)
        return torch.where(known, per_sample, 0.0).sum() / known.sum().clamp(min=1)


class ZLPRLoss(MultiSimilarityLoss):
    """Su's multi-label softmax cross-entropy (ZLPR), eq. 20 at ``tp = 1``::

        l_i = log(1 + sum_{p in P_i} exp(-x_ip)) + log(1 + sum_{n in N_i} exp(x_in))

    Reduction: mean over samples with at least one known label, as :class:`MultiSimilarityLoss`.
    """

    name = "zlpr"

    def __init__(self, tp: float = 1.0) -> None:
        super().__init__(tp=tp)
