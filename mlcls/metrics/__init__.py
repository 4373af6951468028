"""Evaluation metrics: pure functions of score and label tensors.

:func:`compute_metrics` is the single entry point of evaluation: every figure of ``results.json`` from
the gathered logits and labels of the whole evaluation set (see
:func:`mlcls.collectives.gather_rank_parts`), per-class AP included (computed once per evaluation; the
run's plots and report read it), beside which a zero-shot evaluation (:mod:`mlcls.engine.evaluate`) puts
the ZSL / GZSL figures of :func:`mlcls.metrics.zero_shot.zero_shot_metrics`. Definitions, edge cases and
reductions are in :mod:`mlcls.metrics.ap`, :mod:`mlcls.metrics.f1`, :mod:`mlcls.metrics.zero_shot` and
docs/metrics.md; the input checks they share are in :mod:`mlcls.metrics.checks`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mlcls.metrics.ap import (
    ap_of_lists,
    average_precision,
    block_slices,
    map_class,
    map_sample,
    mean_counted,
    per_list_in_blocks,
    voc11_ap_of_lists,
    voc11_average_precision,
)
from mlcls.metrics.checks import check_scores_labels
from mlcls.metrics.f1 import (
    figures_of_counts,
    precision_recall_f1,
    prediction_counts,
    threshold_predictions,
    top_k_predictions,
)
from mlcls.metrics.zero_shot import top_k_f1, zero_shot_metrics

__all__ = [
    "average_precision",
    "compute_metrics",
    "map_class",
    "map_sample",
    "precision_recall_f1",
    "threshold_predictions",
    "top_k_f1",
    "top_k_predictions",
    "voc11_average_precision",
    "zero_shot_metrics",
]


def compute_metrics(
    scores: torch.Tensor,
    labels: torch.Tensor,
    class_names: Sequence[str],
    threshold: float = 0.5,
    top_k: int = 3,
    voc11: bool = False,
) -> dict:
    """Every evaluation figure, in percent, as a JSON-ready dict.

    Args:
        scores: (N, C) logits of the whole evaluation set, each sample once.
        labels: (N, C) with 1 = positive, 0 = negative, -1 = unknown (ignored by every figure).
        class_names: the C class names, in column order, distinct.
        threshold: probability threshold on ``sigmoid(scores)`` for CP ... OF1.
        top_k: number of top-scoring classes predicted per sample for ``CP_top{k}`` ... ``OF1_top{k}``.
        voc11: also report ``mAP_class_voc11``, the VOC2007 11-point interpolated mAP@class.

    Returns:
        ``mAP_class``, ``mAP_sample`` (eqs. 23-24, means over the classes / samples with a positive),
        ``classes_counted``, ``samples_counted`` (ints), ``CP``, ``CR``, ``CF1``, ``OP``, ``OR``, ``OF1``
        at the threshold, the same six with suffix ``_top{k}``, optionally ``mAP_class_voc11``: floats
        (NaN when undefined, e.g. no positive at all). ``per_class_ap`` maps each class name to its AP
        (:func:`average_precision`) in percent, ``None`` for a class without positive: results.json's
        ``per_class_ap``, which the plots and the report read instead of computing it again.
    """
    labels = check_scores_labels(scores, labels)
    if len(class_names) != scores.shape[1]:
        raise ValueError(f"{len(class_names)} class names for {scores.shape[1]} score columns")
    if len(set(class_names)) != len(class_names):
        raise ValueError("class names must be distinct")
    class_ap = per_list_in_blocks(ap_of_lists, scores, labels, dim=0)
    map_class_percent, classes_counted = mean_counted(class_ap)
    map_sample_percent, samples_counted = mean_counted(per_list_in_blocks(ap_of_lists, scores, labels, 1))
    metrics: dict = {
        "mAP_class": map_class_percent,
        "mAP_sample": map_sample_percent,
        "classes_counted": classes_counted,
        "samples_counted": samples_counted,
    }
    # predictions and their counts by blocks of rows: no (N, C) temporary of the whole set
    at_threshold = at_top_k = torch.zeros(3, scores.shape[1], dtype=torch.int64, device=labels.device)
    for rows in block_slices(*scores.shape):
        at_threshold = at_threshold + prediction_counts(
            threshold_predictions(scores[rows], threshold), labels[rows]
        )
        at_top_k = at_top_k + prediction_counts(top_k_predictions(scores[rows], top_k), labels[rows])
    metrics.update(figures_of_counts(at_threshold))
    metrics.update({f"{name}_top{top_k}": value for name, value in figures_of_counts(at_top_k).items()})
    if voc11:
        metrics["mAP_class_voc11"] = mean_counted(per_list_in_blocks(voc11_ap_of_lists, scores, labels, 0))[0]
    metrics["per_class_ap"] = {
        name: None if math.isnan(ap) else 100 * ap
        for name, ap in zip(class_names, class_ap.tolist(), strict=True)
    }
    return metrics
