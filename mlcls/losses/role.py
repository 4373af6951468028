"""ROLE, regularised online label estimation (Cole et al., CVPR 2021, "Multi-label learning from single
positive labels", Sec. 3.3), and what every loss with a row of state per training sample shares: the
sample indices it is called with, the size limit of its table, and its global batch under DDP.

A loss with per-sample state sets ``needs_sample_index`` and is called ``loss(logits, targets, indices)``;
``setup(counts)`` sizes its (N, C) table, refused over ``max_table_entries``; the table is in
``state_dict()``, so a resumed run continues with it exactly. Under DDP it computes on the global batch on
every rank (:func:`gather_batch`): every rank updates the same rows the same way, so the tables stay
identical without other communication.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mlcls.collectives import all_gather_rows, gather_batch
from mlcls.losses.common import (
    MultiLabelLoss,
    autocast_disabled,
    check_expected_positives,
    check_positive,
    expected_positives_penalty,
    prepare,
)

# A table of 10^9 entries holds 4 GB of float32 per process (12 GB with Adam's two moments); Open Images'
# 9 M images x 9,605 classes are 86 times that.
MAX_TABLE_ENTRIES = 1_000_000_000


def _logit(probability: float) -> float:
    return math.log(probability / (1.0 - probability))


# The label estimates' initial values, as the authors' LabelEstimator sets them.
OBSERVED_POSITIVE_LOGIT = _logit(0.995)
OBSERVED_NEGATIVE_LOGIT = _logit(0.005)
UNKNOWN_LOGIT_BOUND = _logit(0.6)  # unknown entries: uniform in [-bound, bound]


def table_shape(loss: str, counts: Any, max_entries: int, bytes_per_entry: int) -> tuple[int, int]:
    """``(N, C)`` of a per-sample table for the training set of label counts ``counts`` (a
    :class:`~mlcls.data.datasets.labels.LabelCounts`); ``ValueError`` (one line) when the dataset gives no
    counts, or when the table is over ``max_entries``, naming its size in GB per process."""
    if counts is None:
        raise ValueError(f"{loss} needs the training set's size; this dataset gives no label counts")
    num_samples, num_classes = int(counts.num_samples), int(counts.num_classes)
    entries = num_samples * num_classes
    if entries > max_entries:
        raise ValueError(
            f"{loss} keeps a table of {num_samples:,} training samples x {num_classes:,} classes = "
            f"{entries:,} entries ({entries * bytes_per_entry / 1e9:,.1f} GB per process), over "
            f"loss.max_table_entries={max_entries:,}; train on fewer samples or classes, or raise the limit "
            "if every process has the memory"
        )
    return num_samples, num_classes


def check_table_limit(max_table_entries: int) -> int:
    """``loss.max_table_entries`` as an int, or ``ValueError`` unless it is >= 1."""
    if not max_table_entries >= 1:
        raise ValueError(f"max_table_entries must be >= 1, got {max_table_entries}")
    return int(max_table_entries)


def check_indices(loss: str, indices: Tensor | None, rows: int) -> Tensor:
    """``indices``, checked: an integer (B,) tensor for a batch of ``rows`` rows, else ``ValueError``."""
    if indices is None:
        raise ValueError(f"{loss} keeps a row per training sample: call it as loss(logits, targets, indices)")
    if indices.ndim != 1 or indices.shape[0] != rows or indices.is_floating_point():
        raise ValueError(
            f"a loss with a row per training sample needs the batch's sample indices, an integer tensor of "
            f"shape ({rows},); got {indices.dtype} {tuple(indices.shape)}"
        )
    return indices


def check_allocated(table: Tensor, what: str) -> None:
    """``ValueError`` unless the per-sample ``table`` (named ``what``) has been sized by ``setup``."""
    if table.shape[0] == 0:
        raise ValueError(f"{what} is not allocated: call setup(label counts) first")


class SampleStateLoss(MultiLabelLoss):
    """Base of the losses with a row of state per training sample (see the module docstring)."""

    needs_sample_index: ClassVar[bool] = True
    table_bytes_per_entry: ClassVar[int] = 4

    def __init__(self, max_table_entries: int = MAX_TABLE_ENTRIES, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # a subclass's other bases (ll: the epoch and the reduction)
        self.max_table_entries = check_table_limit(max_table_entries)
        self.sizes_checked = False

    def setup(self, counts: Any) -> None:
        """Allocate the tables for the training set of label counts ``counts`` (:func:`table_shape`)."""
        shape = table_shape(self.name, counts, self.max_table_entries, self.table_bytes_per_entry)
        self.allocate(*shape, counts)

    def allocate(self, num_samples: int, num_classes: int, counts: Any) -> None:
        raise NotImplementedError

    def forward(self, logits: Tensor, targets: Tensor, indices: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """logits (B, C), targets (B, C) in {1, 0, -1}, indices int (B,) -> scalar."""
        logits, targets = prepare(logits, targets)
        indices = check_indices(self.name, indices, logits.shape[0])
        with autocast_disabled(logits.device.type):
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                # every rank's rows in rank order, gradients flowing back to each rank's logits
                logits, targets = gather_batch(logits, targets, check_sizes=not self.sizes_checked)
                indices = all_gather_rows(indices)
            self.sizes_checked = True
            return self.compute_rows(logits, targets, indices.long())

    def compute_rows(self, logits: Tensor, targets: Tensor, indices: Tensor) -> Tensor:
        """logits, targets (B, C) in the compute dtype, indices int64 (B,) -> scalar."""
        raise NotImplementedError


class RoleLoss(SampleStateLoss):
    """ROLE: the classifier and a table of label estimates trained together (Cole et al., Sec. 3.3)::

        p = sigmoid(x_ic)  the classifier,   q = sigmoid(z_ic)  the estimate of sample i's label c
        l_ic = 1/2 (o(p) + o(q)) + 1/2 (b(p; sg q) + b(q; sg p))
        o(p) = -log p if y_ic = 1,   -log(1 - p) if y_ic = 0,   0 if y_ic = -1
        b(p; t) = -t log p - (1 - t) log(1 - p)            (BCE of p against the soft target t)
        R(p) = (mean_i sum_c p_ic - k)^2 / C^2             (EPR's expected-positives term, k positives)
        loss = sum_ic l_ic / (B C) + 1/2 (R(p) + R(q))

    where ``sg`` stops the gradient. The table ``label_logits`` (N, C) is a parameter trained in an
    optimizer group of its own (``table``) at ``table_lr_scale`` times ``optim.lr_head`` (the authors'
    10x) without weight decay.

    Initial estimates as the authors': observed positives ``logit(0.995)``, observed negatives
    ``logit(0.005)``, unknown labels uniform in ``[-logit(0.6), logit(0.6)]`` (from ``init_seed``). An
    entry's observed value is written when its sample first appears in a batch: its row has had no
    gradient before, so this is the authors' initialisation exactly.

    The authors' code allows no observed negative (single positives only); here ``o`` of an observed
    negative is ``-log(1 - p)`` (resp. ``q``), the mirror of a positive's. Their logs are ``log(p + 1e-5)``;
    these are exact log-sigmoids.

    Memory: the table, a flag per sample and, under Adam, two moments: 12 bytes per entry, 0.96 GB per
    million samples at C = 80 and 115 GB at Open Images' C = 9,605. Reduction: the mean over all B x C
    entries (the authors').
    """

    name = "role"
    table_bytes_per_entry = 12

    def __init__(
        self,
        expected_positives: float | None = None,
        table_lr_scale: float = 10.0,
        init_seed: int = 0,
        max_table_entries: int = MAX_TABLE_ENTRIES,
    ) -> None:
        super().__init__(max_table_entries=max_table_entries)
        self.expected_positives = check_expected_positives("role", expected_positives)
        check_positive(table_lr_scale=table_lr_scale)
        self.table_lr_scale = float(table_lr_scale)
        self.init_seed = int(init_seed)
        self.label_logits = nn.Parameter(torch.zeros(0, 0))
        self.register_buffer("seen", torch.zeros(0, dtype=torch.bool))

    def allocate(self, num_samples: int, num_classes: int, counts: Any) -> None:
        generator = torch.Generator().manual_seed(self.init_seed)
        uniform = torch.rand(num_samples, num_classes, generator=generator)
        self.label_logits = nn.Parameter(uniform.mul_(2.0).sub_(1.0).mul_(UNKNOWN_LOGIT_BOUND))
        self.seen = torch.zeros(num_samples, dtype=torch.bool)

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The optimizer group of the label table (see :func:`mlcls.engine.optim.build_optimizer`)."""
        return [{"params": [self.label_logits], "name": "table", "lr_scale": self.table_lr_scale}]

    @torch.no_grad()
    def observe(self, targets: Tensor, indices: Tensor) -> None:
        """Write the observed labels into the rows of samples seen for the first time (no host read)."""
        rows = self.label_logits[indices]
        observed = torch.full_like(rows, OBSERVED_NEGATIVE_LOGIT).masked_fill_(
            targets == 1, OBSERVED_POSITIVE_LOGIT
        )
        first = (~self.seen[indices]).unsqueeze(1) & (targets >= 0)
        self.label_logits.index_copy_(0, indices, torch.where(first, observed, rows))
        self.seen.index_fill_(0, indices, True)  # not ``seen[indices] = True``: a host-to-device copy on CUDA

    def compute_rows(self, logits: Tensor, targets: Tensor, indices: Tensor) -> Tensor:
        check_allocated(self.label_logits, "role's label table")
        self.observe(targets, indices)
        estimates = self.label_logits[indices].to(logits.dtype)
        p, q = torch.sigmoid(logits), torch.sigmoid(estimates)
        terms = []
        for x, target in ((logits, q.detach()), (estimates, p.detach())):
            log_yes, log_no = F.logsigmoid(x), F.logsigmoid(-x)
            observed = torch.where(targets == 1, -log_yes, torch.where(targets == 0, -log_no, 0.0))
            soft = -(target * log_yes + (1.0 - target) * log_no)
            terms.append(observed + soft)
        regulariser = sum(expected_positives_penalty(share, self.expected_positives) for share in (p, q))
        return 0.5 * (terms[0] + terms[1]).mean() + 0.5 * regulariser

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, table={tuple(self.label_logits.shape)}"
