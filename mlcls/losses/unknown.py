"""Losses for unknown labels: the single-positive baselines of Cole et al. (CVPR 2021) and entropy
maximisation (Zhou et al., ECCV 2022): an unknown label (-1) gets a term of its own, as in their papers.

Label mapping: the authors' code writes observed positives as 1, unobserved labels as 0 and (in partial
labels) observed negatives as -1; mlcls writes 1, -1 and 0. Their 0 is our -1 and their -1 our 0.
Under single-positive labels (no observed negative) every loss here equals the authors' on the mapped
labels; an observed negative (0), which their single-positive losses never see, gets the plain BCE term
``-log(1 - p)`` (in ``an_ls`` its smoothed form).

Reduction (:class:`~mlcls.losses.common.EntrywiseLoss` with ``counts_unknown``): every entry of the
batch counts, known or not. ``"mean"`` (default) is the authors' ``sum / (B * C)``; ``"sum"`` the sum
over the batch; ``"sum_per_sample"`` the sum divided by B. ``p = sigmoid(x)`` throughout, and every
``log p`` is a log-sigmoid: exact where the authors' code adds 1e-5 inside the log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.errors import is_integer
from mlcls.losses.bce import assumed_negative_bce
from mlcls.losses.common import (
    EntrywiseLoss,
    autocast_disabled,
    check_expected_positives,
    check_non_negative,
    expected_positives_penalty,
    prepare,
)
from mlcls.losses.role import (
    MAX_TABLE_ENTRIES,
    check_allocated,
    check_indices,
    check_table_limit,
    table_shape,
)

if TYPE_CHECKING:
    from mlcls.data.datasets.labels import LabelCounts


class UnknownLabelLoss(EntrywiseLoss):
    """Base of the entry-wise losses that give unknown labels (-1) a term: every entry is counted."""

    counts_unknown = True


class EpochDependentLoss(UnknownLabelLoss):
    """Base of the losses whose terms change with the training epoch (``ll``, ``splc``), set by the trainer
    before each epoch's first step; a Python int (a buffer on a GPU would be read back every step), kept in
    ``state_dict()`` as extra state."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the terms of 0-based epoch ``epoch`` from the next call on."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)

    def get_extra_state(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, epoch={self.epoch}"

    def set_extra_state(self, state: dict[str, int]) -> None:
        if not (isinstance(state, dict) and isinstance(state.get("epoch"), int) and state["epoch"] >= 0):
            raise ValueError(
                f"a loss's saved state must be {{'epoch': an integer >= 0}}, got a {type(state).__name__}"
            )
        self.epoch = state["epoch"]


class AssumeNegativeLoss(UnknownLabelLoss):
    """AN, assume negative (Cole et al., eq. 4): BCE with every unknown label taken as a negative::

        l_ic = -log p_ic  if y_ic = 1,   -log(1 - p_ic)  if y_ic in {0, -1}

    Reduction: as the module docstring. Shapes: logits (B, C), targets (B, C) in {1, 0, -1}; scalar.
    """

    name = "an"

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return assumed_negative_bce(logits, targets)


class LabelSmoothedAssumeNegativeLoss(UnknownLabelLoss):
    """AN-LS, assume negative with label smoothing (Cole et al., Sec. 3.2)::

        l_ic = -(1 - e) log p - e log(1 - p)   if y_ic = 1
        l_ic = -(1 - e) log(1 - p) - e log p   if y_ic in {0, -1}

    i.e. BCE against the smoothed targets ``1 - e`` and ``e``, with ``e = ls_coef`` (authors: 0.1).
    Reduction: as the module docstring. Shapes: logits (B, C), targets (B, C) in {1, 0, -1}; scalar.
    """

    name = "an_ls"

    def __init__(self, ls_coef: float = 0.1, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        if not 0 <= ls_coef < 0.5:
            raise ValueError(f"ls_coef must be in [0, 0.5), got {ls_coef}")
        self.ls_coef = float(ls_coef)

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        smoothed = torch.full_like(logits, self.ls_coef).masked_fill_(targets == 1, 1.0 - self.ls_coef)
        return F.binary_cross_entropy_with_logits(logits, smoothed, reduction="none")


class WeakAssumeNegativeLoss(UnknownLabelLoss):
    """WAN, weak assume negative (Cole et al., eq. 5): the assumed negatives weigh ``1 / (C - 1)``::

        l_ic = -log p  if y_ic = 1,   -log(1 - p)  if y_ic = 0,   -log(1 - p) / (C - 1)  if y_ic = -1

    so that, with one positive per image, the C - 1 assumed negatives weigh as much in total as the
    positive. Reduction: as the module docstring. Shapes: logits (B, C) with C >= 2, targets (B, C) in
    {1, 0, -1}; scalar result.
    """

    name = "wan"

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        classes = logits.shape[1]
        if classes < 2:
            raise ValueError(
                f"wan weighs assumed negatives by 1 / (C - 1): it needs C >= 2, got C = {classes}"
            )
        per_entry = assumed_negative_bce(logits, targets)
        return torch.where(targets == -1, per_entry / (classes - 1), per_entry)


class ExpectedPositiveLoss(UnknownLabelLoss):
    """EPR, expected positive regulariser (Cole et al., eq. 6): BCE on the observed labels only, plus the
    squared gap between the batch's mean number of predicted positives and ``k = expected_positives``::

        loss = (1 / (B C)) sum_{(i,c) observed} l_ic + ((1 / B) sum_i sum_c p_ic - k)^2 / C^2

    with ``l_ic = -log p`` on a positive and ``-log(1 - p)`` on an observed negative; an unknown label
    enters only the regulariser. ``k`` has no default (:func:`~mlcls.losses.common.check_expected_positives`).
    Reduction: fixed, as written (the regulariser once per batch).
    """

    name = "epr"

    def __init__(self, expected_positives: float | None = None) -> None:
        super().__init__(reduction="mean")
        self.expected_positives = check_expected_positives("epr", expected_positives)

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        per_entry = assumed_negative_bce(logits, targets)
        return torch.where(targets == -1, 0.0, per_entry)

    def compute(self, logits: Tensor, targets: Tensor) -> Tensor:
        penalty = expected_positives_penalty(torch.sigmoid(logits), self.expected_positives)
        return super().compute(logits, targets) + penalty


class EntropyMaximisationLoss(UnknownLabelLoss):
    """EM, entropy maximisation on unknown labels (Zhou et al., ECCV 2022, eq. 3), with their asymmetric
    pseudo-labelling (APL, Sec. 3.3) as an option::

        l_ic = -log p  if y_ic = 1,   -log(1 - p)  if y_ic = 0,   -alpha H(p)  if y_ic = -1,
        H(p) = -p log p - (1 - p) log(1 - p)
        with apl: l_ic = beta (-s_ic log p - (1 - s_ic) log(1 - p))  if y_ic = -1 and pseudo-labelled

    An unknown label is neither pushed up nor down: its term is lowest at p = 1/2. The loss can be
    negative. ``alpha`` is the authors' per-dataset weight: 0.2 (VOC 2012), 0.1 (MS-COCO, NUS-WIDE),
    0.01 (CUB).

    APL (``apl=True``): after each training epoch e (1-based) with ``warmup_epochs <= e < epochs``, the
    trainer scores the training set and calls :meth:`pseudo_label`. Per class c, among the entries still
    unknown, the ``n_c = int(neg_proportion * U_c / (epochs - warmup_epochs))`` with the lowest predictions
    become pseudo-negatives whose soft target ``s_ic`` is that prediction, fixed from then on (``U_c``: the
    class's unknown labels in the training set); by the last epoch ``neg_proportion`` of them are. The
    authors' values:
    ``beta`` 0.02 (VOC 2012), 0.9 (MS-COCO), 0.2 (NUS-WIDE), 0.4 (CUB); ``warmup_epochs`` 5, 5, 4, 3;
    ``neg_proportion`` 0.9. ``epochs`` is the run's ``trainer.epochs``.

    The pseudo-labels are a per-sample table as those of :mod:`mlcls.losses.role`, ``pseudo_labels``
    (N, C) float32, NaN where there is none (4 bytes per entry; an APL step briefly holds about 20 more).
    docs/losses.md lists what differs from the authors' code. Reduction: as the module docstring.
    """

    name = "em"
    # State tables whose NaN means "no estimate yet" (a resumed table's other entries must be finite).
    unset_as_nan = ("pseudo_labels",)

    def __init__(
        self,
        alpha: float = 0.1,
        reduction: str = "mean",
        apl: bool = False,
        beta: float = 0.2,
        warmup_epochs: int = 5,
        neg_proportion: float = 0.9,
        epochs: int | None = None,
        max_table_entries: int = MAX_TABLE_ENTRIES,
    ) -> None:
        super().__init__(reduction=reduction)
        check_non_negative(alpha=alpha, beta=beta)
        if not 0 < neg_proportion <= 1:
            raise ValueError(f"neg_proportion must be in (0, 1], got {neg_proportion}")
        self.alpha, self.beta, self.neg_proportion = float(alpha), float(beta), float(neg_proportion)
        self.apl, self.max_table_entries = bool(apl), check_table_limit(max_table_entries)
        self.warmup_epochs, self.epochs = warmup_epochs, epochs
        self.needs_sample_index = self.apl
        if self.apl:
            if not is_integer(warmup_epochs) or warmup_epochs < 1:
                raise ValueError(f"warmup_epochs must be an integer >= 1, got {warmup_epochs}")
            if epochs is None:
                raise ValueError("apl needs loss.epochs, the run's trainer.epochs (e.g. loss.epochs=10)")
            if not is_integer(epochs) or epochs <= warmup_epochs:
                raise ValueError(
                    f"apl pseudo-labels after epochs warmup_epochs..epochs-1: epochs must be an integer > "
                    f"warmup_epochs={warmup_epochs}, got {epochs}"
                )
            self.register_buffer("pseudo_labels", torch.zeros(0, 0))
            self.register_buffer("quota", torch.zeros(0, dtype=torch.long), persistent=False)

    def setup(self, counts: LabelCounts | None) -> None:
        """With apl: allocate the pseudo-label table and each class's quota ``n_c``."""
        if not self.apl:
            return
        num_samples, num_classes = table_shape("em with apl=true", counts, self.max_table_entries, 4)
        unknown = num_samples - counts.positives - counts.negatives
        steps = self.epochs - self.warmup_epochs
        self.pseudo_labels = torch.full((num_samples, num_classes), float("nan"))
        self.quota = torch.tensor([int(self.neg_proportion * u / steps) for u in unknown.tolist()])

    def wants_train_predictions(self, epoch: int) -> bool:
        """Whether APL runs after ``epoch`` (1-based) complete epochs."""
        return self.apl and self.warmup_epochs <= epoch < self.epochs

    def entry_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        log_p, log_not_p = F.logsigmoid(logits), F.logsigmoid(-logits)
        negative_entropy = torch.sigmoid(logits) * log_p + torch.sigmoid(-logits) * log_not_p
        known = torch.where(targets == 1, -log_p, -log_not_p)
        return torch.where(targets == -1, self.alpha * negative_entropy, known)

    def forward(self, logits: Tensor, targets: Tensor, indices: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """logits (B, C), targets (B, C) in {1, 0, -1}, with apl indices int (B,) -> scalar."""
        if not self.apl:
            return super().forward(logits, targets)
        with autocast_disabled(logits.device.type):
            logits, targets = prepare(logits, targets)
            indices = check_indices("em with apl=true", indices, logits.shape[0])
            check_allocated(self.pseudo_labels, "em's pseudo-label table")
            soft = self.pseudo_labels[indices.long()].to(logits.dtype)
            pseudo = (targets == -1) & ~soft.isnan()
            soft_bce = F.binary_cross_entropy_with_logits(logits, soft.nan_to_num(0.0), reduction="none")
            return self.reduce(
                torch.where(pseudo, self.beta * soft_bce, self.entry_loss(logits, targets)), targets
            )

    @torch.no_grad()
    def pseudo_label(self, indices: Tensor, probabilities: Tensor, targets: Tensor) -> Tensor:
        """One APL step from the training set's predictions: ``indices`` int (n,), ``probabilities`` (n, C)
        (sigmoid of the logits) and ``targets`` (n, C) of the samples scored, in any order; a sample
        scored twice counts once (its first row in index order). Per class, the quota's lowest
        predictions among the still-unknown entries become pseudo-negatives (ties: the lower sample
        index first). Returns the number of new pseudo-labels (a device tensor)."""
        device = self.pseudo_labels.device
        indices, order = torch.sort(indices.to(device).long(), stable=True)
        first = torch.ones_like(indices, dtype=torch.bool)
        first[1:] = indices[1:] != indices[:-1]
        indices = indices[first]
        probabilities = probabilities.to(device, torch.float32)[order[first]]
        current = self.pseudo_labels[indices]
        candidate = (targets.to(device)[order[first]] == -1) & current.isnan()
        ranking = torch.argsort(torch.where(candidate, probabilities, torch.inf), dim=0, stable=True)
        take = torch.minimum(self.quota, candidate.sum(0))
        rank = torch.arange(len(indices), device=device).unsqueeze(1)
        chosen = torch.zeros_like(candidate).scatter_(0, ranking, rank < take)
        self.pseudo_labels[indices] = torch.where(chosen, probabilities, current)
        return chosen.sum()

    def extra_repr(self) -> str:
        table = f", table={tuple(self.pseudo_labels.shape)}" if self.apl else ""
        return super().extra_repr() + table
