"""Average precision, mAP@class (paper eq. 23) and mAP@sample (eq. 24), vectorised in torch.

Every function takes ``scores`` (N, C) -- logits or probabilities, any real dtype, CPU or CUDA; AP only
depends on the order of the scores -- and ``labels`` (N, C) with 1 = positive, 0 = negative,
-1 = unknown. A *ranked list* is one column (``dim=0``: the N samples of a class) or one row (``dim=1``:
the C classes of a sample).

Definition (non-interpolated AP, as ``sklearn.metrics.average_precision_score``)::

    AP = sum_g (R_g - R_{g-1}) * P_g = (1 / |pos|) * sum_{i in pos} TP(s_i) / K(s_i)

where ``g`` runs over the groups of equal scores in decreasing order, ``P_g`` and ``R_g`` are the
precision and recall once groups 1..g are retrieved, ``TP(s)`` is the number of positives and ``K(s)``
the number of known items (label 0 or 1) scoring ``>= s``. Edge cases:

* ties -- a group of tied scores is one threshold: its items are retrieved together and each of its
  positives gets the precision at the end of the group (scikit-learn's grouping: exactly equal values,
  no tolerance). The result does not depend on the order of tied items.
* -1 labels -- excluded from the ranked list: neither retrieved positives nor negatives.
* no positive -- AP is NaN and the list is left out of the mean (scikit-learn would return 0 with a
  warning); :func:`map_class` / :func:`map_sample` report how many lists were counted.

Scores are only compared, so they keep their own precision (float16/bfloat16 upcast exactly to float32,
integers to float64); counts are exact integers, precisions and their mean float64. Labels stay int8 and
the lists are ranked in blocks (:func:`block_slices`): Open Images' 1.6 GB of scores with no whole copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from mlcls.metrics.checks import check_scores_labels, count_true

# Scores processed at once by the metrics and the threshold calibration: a block's temporaries (about 25
# bytes per score: transposed, masked and sorted copies) take about 100 MB.
BLOCK_ELEMENTS = 1 << 22


def block_slices(n_lines: int, line_length: int) -> Iterator[slice]:
    """Consecutive slices covering ``range(n_lines)``, each holding about :data:`BLOCK_ELEMENTS` entries
    (at least one line) of lines ``line_length`` long; one slice when ``n_lines`` is 0."""
    per_block = max(1, BLOCK_ELEMENTS // max(1, line_length))
    for start in range(0, max(n_lines, 1), per_block):
        yield slice(start, min(start + per_block, n_lines))


def per_list_in_blocks(
    function: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    scores: torch.Tensor,
    labels: torch.Tensor,
    dim: int,
) -> torch.Tensor:
    """``function(scores, labels, dim)`` -- one value per ranked list -- computed on blocks of lists
    (:func:`block_slices`) and concatenated: the columns (``dim=0``) or rows (``dim=1``) of a block are
    ranked together, so a block's temporaries, not the whole set's, are in memory at once."""
    if dim not in (0, 1, -1, -2):
        raise ValueError(f"dim must be 0 (per column) or 1 (per row), got {dim}")
    dim = dim % 2
    across = 1 - dim  # the lists are indexed along this dimension
    blocks = block_slices(scores.shape[across], scores.shape[dim])
    if across == 1:
        parts = [function(scores[:, block], labels[:, block], dim) for block in blocks]
    else:
        parts = [function(scores[block], labels[block], dim) for block in blocks]
    return torch.cat(parts)


def _sort_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row sorted ascending (values only); on CPU by NumPy, whose SIMD value sort is several times
    faster than torch's CPU sort, which always computes indices as well. The values are identical."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.sort(values.numpy(), axis=1))
    return torch.sort(values, dim=1).values


def _count_below(
    sorted_rows: torch.Tensor,
    queries: torch.Tensor,
    row_of: torch.Tensor,
    rank: torch.Tensor,
    per_row: torch.Tensor,
) -> torch.Tensor:
    """For each query, the number of entries of its row ``row_of`` of ``sorted_rows`` strictly below it.

    ``rank`` is each query's index within its row, ``per_row`` the queries of each row. ``torch.searchsorted``
    needs as many queries for every row, so each row's queries are cut into blocks, each searched in a copy
    of its row: the block size balances copying long rows against padding rows with few queries.
    """
    if len(queries) == 0:
        return torch.zeros_like(row_of)
    n_rows, length = sorted_rows.shape
    block = max(1, min(int(per_row.max()), int(math.sqrt(length * len(queries) / n_rows))))
    n_blocks = (-(-per_row // block)).clamp_min(1)
    # flat position of each query in the (blocks, block) layout
    position = ((n_blocks.cumsum(0) - n_blocks)[row_of] + rank // block) * block + rank % block
    padded = queries.new_full((int(n_blocks.sum()), block), torch.inf)
    padded.view(-1)[position] = queries
    if len(padded) == n_rows:
        boundaries = sorted_rows
    else:  # indexing, not repeat_interleave(dim=0): its index_select is ~25x slower with 2 CPU threads
        boundaries = sorted_rows[
            torch.repeat_interleave(torch.arange(n_rows, device=row_of.device), n_blocks)
        ]
    return torch.searchsorted(boundaries, padded).view(-1)[position]


class RankedPositives(NamedTuple):
    """The positives of R ranked lists of length L (``dim=0``: the columns, ``dim=1``: the rows), M in all,
    grouped by list in increasing score order, with the counts at the end of each one's tie group."""

    list_of: torch.Tensor  # (M,) int64: the list of each positive
    score: torch.Tensor  # (M,): its score (float32, or float64 for float64 and integer scores)
    tp: torch.Tensor  # (M,) int64: positives of its list scoring >= its score
    known_ge: torch.Tensor  # (M,) int64: known items (label 0 or 1) of its list scoring >= its score
    n_positive: torch.Tensor  # (R,) int64: positives of every list
    known_sorted: torch.Tensor  # (R, L): every list's scores ascending, unknown items first as -inf


def ranked_positives(scores: torch.Tensor, labels: torch.Tensor, dim: int) -> RankedPositives:
    """``TP`` and ``K`` (see the module docstring) at every positive of every ranked list of ``scores``
    (N, C) with validated int8 ``labels`` (N, C); ``dim`` is 0 or 1. Memory: a few copies of the input."""
    scores = scores.detach()
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()  # exact; NumPy has no bfloat16
    elif not scores.is_floating_point():
        scores = scores.double()
    labels = labels.to(scores.device)
    if dim == 0:
        scores, labels = scores.T, labels.T
    scores, labels = scores.contiguous(), labels.contiguous()
    n_lists, length = scores.shape
    positive = labels == 1
    n_positive = count_true(positive, 1)
    n_unknown = torch.zeros_like(n_positive)
    if labels.numel() and labels.min() < 0:
        # unknown items sort first as -inf; they are taken out again for a positive scoring -inf
        known = labels >= 0
        n_unknown = length - count_true(known, 1)
        known_sorted = _sort_rows(torch.where(known, scores, -torch.inf))
    else:
        known_sorted = _sort_rows(scores)
    positive_sorted = _sort_rows(torch.where(positive, scores, torch.inf))  # row r: its positives first
    list_of = torch.repeat_interleave(torch.arange(n_lists, device=scores.device), n_positive)
    first_of_list = (n_positive.cumsum(0) - n_positive)[list_of]
    index = torch.arange(len(list_of), device=scores.device)
    rank = index - first_of_list
    score = positive_sorted.view(-1)[list_of * length + rank]

    # positives scoring >= a positive: all from the first of its ties on
    starts_ties = rank == 0
    starts_ties[1:] |= score[1:] != score[:-1]
    first_tie = torch.where(starts_ties, index, 0).cummax(0).values
    tp = n_positive[list_of] - (first_tie - first_of_list)
    known_ge = length - _count_below(known_sorted, score, list_of, rank, n_positive)
    known_ge -= torch.where(score == -torch.inf, n_unknown[list_of], 0)
    return RankedPositives(list_of, score, tp, known_ge, n_positive, known_sorted)


def average_precision(scores: torch.Tensor, labels: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Non-interpolated AP (module docstring) of every column (``dim=0``: C values, each class over the
    samples) or row (``dim=1``: N values), as float64 fractions in [0, 1] on ``scores.device``, NaN where
    the list has no positive."""
    return per_list_in_blocks(ap_of_lists, scores, check_scores_labels(scores, labels), dim)


def ap_of_lists(scores: torch.Tensor, labels: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`average_precision` of validated int8 ``labels``, for :func:`per_list_in_blocks`."""
    list_of, _, tp, known_ge, n_positive, _ = ranked_positives(scores, labels, dim)
    total = torch.zeros(len(n_positive), dtype=torch.float64, device=tp.device)
    total.index_add_(0, list_of, tp.double() / known_ge.double())
    return total / n_positive  # 0 / 0 = NaN without positive


def voc11_average_precision(scores: torch.Tensor, labels: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """VOC2007-style 11-point interpolated AP of every column (``dim=0``) or row (``dim=1``).

    ``AP_11 = (1/11) * sum_{t in {0, 0.1, ..., 1}} max{P_g : R_g >= t}`` (0 when no point reaches ``t``),
    for comparison with older papers; it is not the paper's metric. The points ``(R_g, P_g)`` are those of
    :func:`average_precision` (tie groups, -1 labels excluded -- -1 plays the role of VOC's "difficult"),
    so unlike the VOC devkit the result does not depend on the order of tied scores. ``R_g >= t`` is
    tested exactly as ``10 * TP >= k * |pos|`` for ``t = k / 10``, avoiding the float rounding of
    ``0.1 * k``. NaN where the list has no positive. Returns float64 fractions.
    """
    return per_list_in_blocks(voc11_ap_of_lists, scores, check_scores_labels(scores, labels), dim)


def voc11_ap_of_lists(scores: torch.Tensor, labels: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`voc11_average_precision` of validated int8 ``labels``, for :func:`per_list_in_blocks`."""
    list_of, _, tp, known_ge, n_positive, _ = ranked_positives(scores, labels, dim)
    levels = torch.arange(11, device=tp.device)
    # the curve's best points are at positives; level k is reached where 10 * TP >= k * |pos|
    reaches = 10 * tp[:, None] >= levels * n_positive[list_of, None]
    precision = torch.where(reaches, (tp.double() / known_ge.double())[:, None], 0.0)
    best = torch.zeros(len(n_positive) * 11, dtype=torch.float64, device=tp.device)
    best.scatter_reduce_(0, (11 * list_of[:, None] + levels).reshape(-1), precision.reshape(-1), "amax")
    return torch.where(n_positive > 0, best.view(-1, 11).mean(1), torch.nan)


def mean_counted(ap: torch.Tensor) -> tuple[float, int]:
    """Mean in percent of the non-NaN entries of ``ap`` and their number; ``(nan, 0)`` when all are NaN."""
    counted = ~torch.isnan(ap)
    count = int(counted.sum())
    if count == 0:
        return float("nan"), 0
    return 100.0 * ap[counted].mean().item(), count


def map_class(scores: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """mAP@class (eq. 23) in percent, the mean AP of the classes with a positive, and their number; with
    every class counted and no -1 label, ``100 * average_precision_score(average="macro")``."""
    return mean_counted(average_precision(scores, labels, dim=0))


def map_sample(scores: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """mAP@sample (eq. 24) in percent, the mean AP of the samples with a positive, and their number;
    without -1 labels, ``100 * average_precision_score(average="samples")`` over the rows with a positive."""
    return mean_counted(average_precision(scores, labels, dim=1))
