"""Large-loss rejection and correction (Kim et al., CVPR 2022, "Large loss matters in weakly supervised
multi-label classification"): LL-R, LL-Ct and LL-Cp."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.losses.bce import assumed_negative_bce
from mlcls.losses.common import MultiLabelLoss, check_choice
from mlcls.losses.role import MAX_TABLE_ENTRIES, SampleStateLoss, check_allocated
from mlcls.losses.unknown import EpochDependentLoss

LL_MODES = ("r", "ct", "cp")


class LargeLossLoss(SampleStateLoss, EpochDependentLoss):
    """Assume negative, except for the unknown labels with the largest losses of the batch (eqs. 3-5)::

        l_ic = -log p                  if y_ic = 1
        l_ic = -log(1 - p)             if y_ic = 0, or y_ic = -1 and (i, c) not among the largest
        l_ic = 0         (mode "r")    if y_ic = -1 and (i, c) among the largest  (LL-R: rejected)
        l_ic = -log p    (modes "ct", "cp")   if y_ic = -1 and (i, c) among the largest  (corrected)

    "The largest" are the unknown labels whose assumed-negative loss ``-log(1 - p)`` is at least the
    k-th largest such loss in the batch, ``k = ceil(B C R)``. For LL-R and LL-Ct the rate
    ``R = min(epoch * delta_rel, 1)`` grows by ``delta_rel`` per (0-based) epoch: the first epoch is
    plain assume-negative. As in the authors' code, k counts all B x C entries of the batch (not only the
    unknown ones) and only unknown labels are ever rejected or corrected; ties at the k-th loss are all
    taken. The choice is made on the detached loss: no gradient flows through it.

    LL-Cp (``mode="cp"``, permanent correction): from the second epoch on, a constant ``R = delta_rel``
    (the authors' ``k = ceil(B C delta_rel)``). The unknown labels whose loss is strictly above the k-th
    largest are then written into a per-sample table of corrections, ``corrected`` (N, C) bool, and from
    the next call on the loss takes them as positives (``y_ic := 1``, no longer candidates), as the
    authors' ``train.py`` writes 1 into its training labels. The k-th entry itself is corrected for the
    step only (unless others tie with it). In mode cp the loss is a per-sample-state loss of
    :mod:`mlcls.losses.role` (1 byte per entry, 80 MB per million samples at C = 80). k is the exact
    ``ceil`` of the decimal product (the released float product may round one above an integer);
    docs/losses.md lists the other differences from the released code.

    ``delta_rel`` is a fraction: the authors' command-line 0.2 (percent) is ``delta_rel=0.002``.

    Reduction: as :mod:`mlcls.losses.unknown`'s losses, over all B x C entries (a rejected one counts 0).
    """

    name = "ll"
    table_bytes_per_entry = 1

    def __init__(
        self,
        mode: str = "r",
        delta_rel: float = 0.002,
        reduction: str = "mean",
        max_table_entries: int = MAX_TABLE_ENTRIES,
    ) -> None:
        super().__init__(max_table_entries=max_table_entries, reduction=reduction)
        check_choice("mode", mode, LL_MODES)
        if not 0 <= delta_rel <= 1:
            raise ValueError(f"delta_rel must be in [0, 1], got {delta_rel}")
        self.mode, self.delta_rel = mode, float(delta_rel)
        if mode == "cp":  # LL-R and LL-Ct keep no table (and their state_dict stays the epoch alone)
            self.register_buffer("corrected", torch.zeros(0, 0, dtype=torch.bool))

    @property
    def needs_sample_index(self) -> bool:  # type: ignore[override]
        """Whether the training batches must carry the sample indices: in mode cp only."""
        return self.mode == "cp"

    @property
    def sums_over_batch(self) -> bool:  # type: ignore[override]
        """A sum over the (local) batch: ``"sum"`` in modes r and ct; mode cp takes the global batch."""
        return self.reduction == "sum" and self.mode != "cp"

    @property
    def rejection_rate(self) -> float:
        """The fraction R of the batch's entries rejected or corrected in the current epoch."""
        rate = min(self.epoch * self.delta_rel, 1.0)
        return min(rate, self.delta_rel) if self.mode == "cp" else rate

    def setup(self, counts: Any) -> None:
        """Mode cp: allocate the table of corrections (:meth:`SampleStateLoss.setup`); else nothing."""
        if self.mode == "cp":
            super().setup(counts)

    def allocate(self, num_samples: int, num_classes: int, counts: Any) -> None:
        self.corrected = torch.zeros(num_samples, num_classes, dtype=torch.bool)

    def forward(self, logits: Tensor, targets: Tensor, indices: Tensor | None = None) -> Tensor:
        """logits (B, C), targets (B, C) in {1, 0, -1}, indices int (B,) in mode cp -> scalar."""
        if self.mode == "cp":
            return super().forward(logits, targets, indices)
        return MultiLabelLoss.forward(self, logits, targets)

    def select(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
        """The entry terms ``l_ic`` (B, C), and the unknown labels strictly above the k-th largest loss
        (B, C) bool, or None where k = 0 (nothing rejected or corrected)."""
        assumed = assumed_negative_bce(logits, targets)
        # the tolerance keeps k from growing by one where B C R is an integer up to rounding
        k = min(math.ceil(assumed.numel() * self.rejection_rate - 1e-9), assumed.numel())
        if k <= 0:
            return assumed, None
        unknown = targets == -1
        candidates = torch.where(unknown, assumed.detach(), float("-inf"))
        threshold = candidates.flatten().topk(k).values[-1]
        large = unknown & (candidates >= threshold)
        replacement = torch.zeros_like(assumed) if self.mode == "r" else -F.logsigmoid(logits)
        return torch.where(large, replacement, assumed), unknown & (candidates > threshold)

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.select(logits, targets)[0]

    def compute_rows(self, logits: Tensor, targets: Tensor, indices: Tensor) -> Tensor:
        """Mode cp: the loss on the targets with the table's corrections, then the new ones recorded."""
        check_allocated(self.corrected, "ll's table of corrections")
        targets = torch.where(self.corrected[indices] & (targets == -1), 1.0, targets)
        per_entry, above = self.select(logits, targets)
        if above is not None:
            # accumulate: a sample twice in the batch (DDP's padding) keeps the corrections of both rows
            self.corrected.index_put_((indices,), above, accumulate=True)
        return self.reduce(per_entry, targets)

    def extra_repr(self) -> str:
        table = f", table={tuple(self.corrected.shape)}" if self.mode == "cp" else ""
        return super().extra_repr() + table
