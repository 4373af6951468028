"""Thresholded multi-label figures: CP, CR, CF1 (per class) and OP, OR, OF1 (overall), in percent.

A boolean matrix ``predicted`` (N, C) -- from :func:`threshold_predictions` or :func:`top_k_predictions`
-- is scored against ``labels`` (N, C) in {1, 0, -1}. Entries labelled -1 are ignored: they count neither
as predictions nor as ground truth. For class ``c``::

    TP_c = #{i : predicted_ic, y_ic = 1}     NP_c = #{i : predicted_ic, y_ic != -1}     NG_c = #{i : y_ic = 1}

    CP = mean_c TP_c / NP_c      CR = mean_c TP_c / NG_c      CF1 = 2 CP CR / (CP + CR)
    OP = sum_c TP_c / sum_c NP_c      OR = sum_c TP_c / sum_c NG_c      OF1 = 2 OP OR / (OP + OR)

CF1 is the harmonic mean of the averaged CP and CR (the usual definition of multi-label papers), not the
mean of per-class F1 scores. Edge cases, chosen as scikit-learn's ``zero_division=0``:

* a class predicted for no sample (``NP_c = 0``) has precision 0; nothing predicted at all gives OP = 0;
* an F1 whose precision and recall are both 0 is 0;
* CP and CR average over the classes with at least one positive (``NG_c > 0``) -- the classes counted by
  mAP@class -- since recall is undefined for the others; with no positive at all, CP, CR, CF1, OR and
  OF1 are NaN.
"""

from __future__ import annotations

import math

import torch

from mlcls.metrics.checks import check_labels, check_scores, count_true


def threshold_predictions(scores: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """``sigmoid(scores) >= threshold`` (bool (N, C)); ``scores`` are logits, the sigmoid is taken in float64.

    With the default 0.5 a logit of exactly 0 is a positive prediction.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a probability in [0, 1], got {threshold}")
    check_scores(scores)
    return torch.sigmoid(scores.detach().double()) >= threshold


def top_k_predictions(scores: torch.Tensor, k: int = 3) -> torch.Tensor:
    """The ``k`` highest-scoring classes of every sample (bool (N, C)); all classes when ``k >= C``.

    Exactly ``min(k, C)`` predictions per row: among scores tied at the k-th place, the lower class
    indices are taken (as a stable sort would), so the result is deterministic.
    """
    if k < 1:
        raise ValueError(f"top_k must be at least 1, got {k}")
    check_scores(scores)
    scores = scores.detach()
    k = min(k, scores.shape[1])
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    kth = scores.topk(k, dim=1).values[:, -1:]
    above, tied = scores > kth, scores == kth
    room_left = k - count_true(above, 1, keepdim=True)
    return above | (tied & (tied.view(torch.uint8).cumsum(1, dtype=torch.int32) <= room_left))


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` in float64, 0 where the denominator is 0."""
    return torch.where(denominator > 0, numerator.double() / denominator.clamp_min(1).double(), 0.0)


def f1_of(precision: float, recall: float) -> float:
    """``2 P R / (P + R)``; 0 when P = R = 0, NaN when either is NaN."""
    if math.isnan(precision) or math.isnan(recall):
        return float("nan")
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def prediction_counts(predicted: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``TP_c``, ``NP_c`` and ``NG_c`` of every class (int64 (3, C)) of bool predictions (N, C) against
    validated int8 labels (N, C); the counts of row blocks add up to those of the whole set."""
    predicted = predicted.to(labels.device)
    positive = labels == 1
    return torch.stack(
        [
            count_true(predicted & positive, 0),
            count_true(predicted & (labels >= 0), 0),
            count_true(positive, 0),
        ]
    )


def figures_of_counts(counts: torch.Tensor) -> dict[str, float]:
    """CP, CR, CF1, OP, OR, OF1 in percent from the (3, C) counts of :func:`prediction_counts`."""
    true_positives, predicted_known, positives = counts
    counted = positives > 0
    if counted.any():
        class_precision = 100 * _ratio(true_positives, predicted_known)[counted].mean().item()
        class_recall = 100 * _ratio(true_positives, positives)[counted].mean().item()
        overall_recall = 100 * true_positives.sum().item() / positives.sum().item()
    else:
        class_precision = class_recall = overall_recall = float("nan")
    overall_precision = 100 * _ratio(true_positives.sum(), predicted_known.sum()).item()
    return {
        "CP": class_precision,
        "CR": class_recall,
        "CF1": f1_of(class_precision, class_recall),
        "OP": overall_precision,
        "OR": overall_recall,
        "OF1": f1_of(overall_precision, overall_recall),
    }


def precision_recall_f1(predicted: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """CP, CR, CF1, OP, OR, OF1 in percent of the bool predictions (N, C) against labels in {1, 0, -1}, as
    the module docstring defines them (edge cases included)."""
    if predicted.dtype != torch.bool or predicted.dim() != 2:
        raise ValueError(
            f"predicted must be a 2-D bool tensor, got {predicted.dtype} {tuple(predicted.shape)}"
        )
    labels = check_labels(labels, predicted.shape, against="predicted")
    return figures_of_counts(prediction_counts(predicted, labels))
