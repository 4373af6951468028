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
    map_class,
    map_sample,
    mean_counted,
    voc11_ap_of_lists,
    voc11_average_precision,
)
from mlcls.metrics.f1 import (
    figures_of_counts,
    precision_recall_f1,
    prediction_counts,
    threshold_predictions,
    top_k_predictions,
)
from mlcls.metrics.store import MemoryStore, OutputStore
from mlcls.metrics.zero_shot import top_k_f1, zero_shot_metrics

__all__ = [
    "average_precision",
    "compute_metrics",
    "map_class",
    "map_sample",
    "precision_recall_f1",
    "RowFigures",
    "store_metrics",
    "threshold_predictions",
    "top_k_f1",
    "top_k_predictions",
    "voc11_average_precision",
    "zero_shot_metrics",
]


class RowFigures:
    """The figures of whole rows, accumulated as an :class:`~mlcls.metrics.store.OutputStore` receives them
    (its ``on_rows``): the AP of each of the ``n_rows`` samples (float64, NaN without a positive) and the
    ``TP``/``NP``/``NG`` counts of the ``top_k`` predictions of each row (:func:`prediction_counts`).

    Both are filled in place: a long evaluation then leaves no small tensor per block between the large
    temporaries, which would keep the allocator from reusing their memory (at 50,000 x 75,000 such
    leftovers held over 2 GB by the end of a pass)."""

    def __init__(self, n_rows: int, top_k: int = 3) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        self.top_k = top_k
        self.sample_ap = torch.full((n_rows,), math.nan, dtype=torch.float64)
        self.top_k_counts: torch.Tensor | None = None
        self.rows_seen = 0

    def __call__(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        rows = slice(self.rows_seen, self.rows_seen + len(scores))
        self.sample_ap[rows] = ap_of_lists(scores, labels, 1).cpu()
        self.rows_seen = rows.stop
        counts = prediction_counts(top_k_predictions(scores, self.top_k), labels)
        if self.top_k_counts is None:
            self.top_k_counts = counts
        else:
            self.top_k_counts += counts


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
    rows = RowFigures(len(scores), top_k)
    return store_metrics(MemoryStore.of(scores, labels, rows), rows, class_names, threshold, voc11)


def store_metrics(
    store: OutputStore,
    rows: RowFigures,
    class_names: Sequence[str],
    threshold: float = 0.5,
    voc11: bool = False,
) -> dict:
    """:func:`compute_metrics` of the outputs in ``store``, whose rows ``rows`` has seen (its ``on_rows``):
    the figures of classes from one pass over its blocks of classes, those of samples from ``rows``."""
    if len(class_names) != store.n_classes:
        raise ValueError(f"{len(class_names)} class names for {store.n_classes} score columns")
    if len(set(class_names)) != len(class_names):
        raise ValueError("class names must be distinct")
    # filled in place, block by block (see RowFigures)
    class_ap = torch.empty(store.n_classes, dtype=torch.float64)
    voc11_ap = torch.empty(store.n_classes if voc11 else 0, dtype=torch.float64)
    at_threshold = torch.empty(3, store.n_classes, dtype=torch.int64)
    for classes, scores, labels in store.column_blocks():
        class_ap[classes] = ap_of_lists(scores, labels, 0).cpu()
        if voc11:
            voc11_ap[classes] = voc11_ap_of_lists(scores, labels, 0).cpu()
        at_threshold[:, classes] = prediction_counts(threshold_predictions(scores, threshold), labels).cpu()
    map_class_percent, classes_counted = mean_counted(class_ap)
    map_sample_percent, samples_counted = mean_counted(rows.sample_ap)
    metrics: dict = {
        "mAP_class": map_class_percent,
        "mAP_sample": map_sample_percent,
        "classes_counted": classes_counted,
        "samples_counted": samples_counted,
    }
    metrics.update(figures_of_counts(at_threshold))
    top_k_counts = rows.top_k_counts
    if top_k_counts is None:  # no row at all
        top_k_counts = torch.zeros(3, store.n_classes, dtype=torch.int64)
    top_k_figures = figures_of_counts(top_k_counts)
    metrics.update({f"{name}_top{rows.top_k}": value for name, value in top_k_figures.items()})
    if voc11:
        metrics["mAP_class_voc11"] = mean_counted(voc11_ap)[0]
    metrics["per_class_ap"] = {
        name: None if math.isnan(ap) else 100 * ap
        for name, ap in zip(class_names, class_ap.tolist(), strict=True)
    }
    return metrics
