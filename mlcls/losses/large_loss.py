"""Large-loss rejection and correction (Kim et al., CVPR 2022, "Large loss matters in weakly supervised
multi-label classification"): LL-R and LL-Ct."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.losses.unknown import EpochDependentLoss, assumed_negative_bce

LL_MODES = ("r", "ct")


class LargeLossLoss(EpochDependentLoss):
    """Assume negative, except for the unknown labels with the largest losses of the batch (eqs. 3-5)::

        l_ic = -log p                  if y_ic = 1
        l_ic = -log(1 - p)             if y_ic = 0, or y_ic = -1 and (i, c) not among the largest
        l_ic = 0         (mode "r")    if y_ic = -1 and (i, c) among the largest  (LL-R: rejected)
        l_ic = -log p    (mode "ct")   if y_ic = -1 and (i, c) among the largest  (LL-Ct: taken as positive)

    "The largest" are the unknown labels whose assumed-negative loss ``-log(1 - p)`` is at least the
    k-th largest such loss in the batch, ``k = ceil(B C R)``, with the rejection rate
    ``R = min(epoch * delta_rel, 1)`` growing by ``delta_rel`` per (0-based) epoch: the first epoch is
    plain assume-negative. As in the authors' code, k counts all B x C entries of the batch (not only the
    unknown ones) and only unknown labels are ever rejected or corrected; ties at the k-th loss are all
    taken. The choice is made on the detached loss: no gradient flows through it.

    The trainer sets the epoch through :meth:`set_epoch`, before each epoch (a resumed one included); the
    epoch is the module's extra state in ``state_dict()``. ``delta_rel`` is a fraction: the authors'
    command-line 0.2 (percent) is ``delta_rel=0.002``.

    LL-Cp (permanent correction) is not offered: it writes its corrections into the training labels,
    which needs each sample's index in the batch (see docs/losses.md).

    Reduction: ``"mean"`` (default) the sum over all B x C entries divided by B x C, as the authors'
    code (a rejected entry counts with 0); ``"sum"`` the sum; ``"sum_per_sample"`` the sum divided by B.
    Shapes: logits (B, C), targets (B, C) in {1, 0, -1}; scalar result.
    """

    name = "ll"

    def __init__(self, mode: str = "r", delta_rel: float = 0.002, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        if mode not in LL_MODES:
            hint = (
                " (LL-Cp's permanent corrections need each sample's index in the batch, which the "
                "training batches do not carry)"
                if mode == "cp"
                else ""
            )
            raise ValueError(f"mode must be one of {', '.join(map(repr, LL_MODES))}; got {mode!r}{hint}")
        if not 0 <= delta_rel <= 1:
            raise ValueError(f"delta_rel must be in [0, 1], got {delta_rel}")
        self.mode, self.delta_rel = mode, float(delta_rel)

    @property
    def rejection_rate(self) -> float:
        """The fraction R of the batch's entries rejected or corrected in the current epoch."""
        return min(self.epoch * self.delta_rel, 1.0)

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        assumed = assumed_negative_bce(logits, targets)
        # the tolerance keeps k from growing by one where B C R is an integer up to rounding
        k = min(math.ceil(assumed.numel() * self.rejection_rate - 1e-9), assumed.numel())
        if k <= 0:
            return assumed
        unknown = targets == -1
        candidates = torch.where(unknown, assumed.detach(), float("-inf"))
        threshold = candidates.flatten().topk(k).values[-1]
        large = unknown & (candidates >= threshold)
        replacement = torch.zeros_like(assumed) if self.mode == "r" else -F.logsigmoid(logits)
        return torch.where(large, replacement, assumed)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, delta_rel={self.delta_rel}, epoch={self.epoch}, " + super().extra_repr()
