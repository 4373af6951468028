"""Hill and SPLC (Zhang et al., 2021, "Simple and robust loss design for multi-label learning with missing
labels"): a positive term with a focal margin, and a negative term robust to the positives hidden among
the negatives.

The paper's labels are 1 (observed positive) and 0 (unobserved: negative or missing). In mlcls both
an observed negative (0) and an unknown label (-1) get the paper's negative term; SPLC's correction of
missing labels applies to unknown labels only, since an observed negative is not missing. Under
single-positive or positive-only labels this is the paper's loss on the mapped labels. The positive
term of both is ``-(1 - p_m)^gamma log p_m`` with ``p_m = sigmoid(x - m)``, a margin m on the logit.

Reduction: as :mod:`mlcls.losses.unknown`'s losses, over every entry of the batch, known or not;
``"sum"`` is the authors' code's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlcls.losses.common import check_non_negative
from mlcls.losses.focal import focal_term
from mlcls.losses.unknown import EpochDependentLoss, UnknownLabelLoss


class HillLoss(UnknownLabelLoss):
    """Hill loss (Zhang et al., eq. 9): the focal-margin positive term and a Hill-shaped negative term::

        l_ic = -(1 - p_m)^gamma log p_m   if y_ic = 1
        l_ic = (lamb - p) p^2             if y_ic in {0, -1},   p = sigmoid(x)

    The negative term rises like p^2 near 0 and flattens towards p = 2 lamb / 3, so a confident
    prediction on a missing positive is pushed down far less than by BCE. Paper defaults: lamb 1.5,
    margin 1, gamma 2.

    Reduction: as the module docstring. Shapes: logits (B, C), targets (B, C) in {1, 0, -1}; scalar.
    """

    name = "hill"

    def __init__(
        self, lamb: float = 1.5, margin: float = 1.0, gamma: float = 2.0, reduction: str = "mean"
    ) -> None:
        super().__init__(reduction=reduction)
        check_non_negative(gamma=gamma)
        self.lamb, self.margin, self.gamma = float(lamb), float(margin), float(gamma)

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        prob = torch.sigmoid(logits)
        negative = (self.lamb - prob) * prob.square()
        return torch.where(targets == 1, focal_term(logits, self.gamma, self.margin), negative)


class SPLCLoss(EpochDependentLoss):
    """SPLC, self-paced loss correction (Zhang et al., eq. 7) with the focal-margin loss::

        l_ic = -(1 - p_m)^gamma log p_m                       if y_ic = 1
        l_ic = -(1 - p)^gamma log p     (corrected positive)  if y_ic = -1, p > tau, epoch >= change_epoch
        l_ic = -p^gamma log(1 - p)      (focal negative)      otherwise (y_ic = 0, or -1 not corrected)

    with ``p = sigmoid(x)``: from epoch ``change_epoch`` (0-based, set by the trainer through
    :meth:`set_epoch`) an unknown label predicted above ``tau`` is taken as a positive (without the
    margin, as the authors' code). The correction is a hard choice: no gradient flows through it.
    Paper defaults: tau 0.6, change_epoch 1 (from the second epoch), margin 1, gamma 2.

    Reduction: as the module docstring. Shapes: logits (B, C), targets (B, C) in {1, 0, -1}; scalar.
    """

    name = "splc"

    def __init__(
        self,
        tau: float = 0.6,
        change_epoch: int = 1,
        margin: float = 1.0,
        gamma: float = 2.0,
        reduction: str = "mean",
    ) -> None:
        super().__init__(reduction=reduction)
        check_non_negative(gamma=gamma)
        if not 0 < tau < 1:
            raise ValueError(f"tau must be in (0, 1), got {tau}")
        if change_epoch < 0:
            raise ValueError(f"change_epoch must be >= 0, got {change_epoch}")
        self.tau, self.change_epoch = float(tau), int(change_epoch)
        self.margin, self.gamma = float(margin), float(gamma)

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        on = self.epoch >= self.change_epoch  # a Python bool: the trainer's epoch, not a tensor
        corrected = (targets == -1) & (torch.sigmoid(logits) > self.tau) & on
        unlabelled = torch.where(corrected, focal_term(logits, self.gamma), focal_term(-logits, self.gamma))
        return torch.where(targets == 1, focal_term(logits, self.gamma, self.margin), unlabelled)
