"""Zero-shot figures (``dataset.unseen_classes``): ZSL, the unseen classes alone, and GZSL, the seen and
unseen classes together, each as the zero-shot multi-label literature reports them (LESA, Huynh &
Elhamifar, CVPR 2020; ML-Decoder's NUS-WIDE zero-shot table): mAP and the F1 of the top 3 and top 5
predictions of every image.

For a class set S (the unseen columns for ZSL, every column for GZSL), with ``scores`` and ``labels``
restricted to S's columns:

* ``mAP_class``, ``mAP_sample``: :func:`mlcls.metrics.ap.map_class` / :func:`map_sample` (paper eqs.
  23-24, the means over the classes / images with a positive in S);
* ``P_top{k}``, ``R_top{k}``, ``F1_top{k}`` (k = 3, 5): the overall precision and recall of the k
  highest-scoring classes of S per image (ties at the k-th place: the lower class index,
  :func:`mlcls.metrics.f1.top_k_predictions`), as LESA's released ``compute_F1`` (mode ``overall``)
  computes them::

      TP@k = #{(i, c) : c among image i's top k, y_ic = 1}
      P@k  = TP@k / (k' N)          k' = min(k, |S|): every image predicts k' classes
      R@k  = TP@k / #{(i, c) : y_ic = 1}
      F1@k = 2 P R / (P + R)        (0 when P = R = 0)

  over all N evaluated images, those without a positive in S included (each of their k' predictions a
  false positive), as that code does. An unknown label (-1) is no positive: a prediction there counts in
  the denominator of P, not in TP, and not in the positives of R. With no image P is NaN; with no
  positive R and F1 are NaN.

Every figure is in percent. ``classes`` and ``samples_counted`` say how many classes S holds and how many
images have a positive in S.
"""

from __future__ import annotations

import torch

from mlcls.metrics.ap import block_slices, map_class, map_sample
from mlcls.metrics.checks import check_scores_labels
from mlcls.metrics.f1 import f1_of, prediction_counts, top_k_predictions

# The k of the F1@k figures (the field's: LESA, ML-Decoder, BiAM, MKT report F1@3 and F1@5).
ZERO_SHOT_TOP_K = (3, 5)


def top_k_f1(scores: torch.Tensor, labels: torch.Tensor, k: int) -> dict[str, float]:
    """``P_top{k}``, ``R_top{k}`` and ``F1_top{k}`` in percent of ``scores`` (N, C) against ``labels``
    (N, C; 1, 0, -1), as the module docstring defines them (the field's overall P and R of the top k
    classes per image). Counted by blocks of rows: no (N, C) temporary of the whole set."""
    labels = check_scores_labels(scores, labels)
    rows, columns = scores.shape
    blocks = block_slices(rows, columns)
    counts = sum(prediction_counts(top_k_predictions(scores[block], k), labels[block]) for block in blocks)
    true_positives, positives = int(counts[0].sum()), int(counts[2].sum())
    predictions = min(k, columns) * rows
    precision = 100.0 * true_positives / predictions if predictions else float("nan")
    recall = 100.0 * true_positives / positives if positives else float("nan")
    return {f"P_top{k}": precision, f"R_top{k}": recall, f"F1_top{k}": f1_of(precision, recall)}


def class_set_figures(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float | int]:
    """mAP@class, mAP@sample and :func:`top_k_f1` for every k of :data:`ZERO_SHOT_TOP_K` of one class set
    (``scores`` and ``labels`` (N, C) of its columns), and its class and counted-image numbers."""
    map_class_percent, _ = map_class(scores, labels)
    map_sample_percent, samples_counted = map_sample(scores, labels)
    figures: dict[str, float | int] = {
        "mAP_class": map_class_percent,
        "mAP_sample": map_sample_percent,
        "classes": scores.shape[1],
        "samples_counted": samples_counted,
    }
    for k in ZERO_SHOT_TOP_K:
        figures.update(top_k_f1(scores, labels, k))
    return figures


def zero_shot_metrics(
    scores: torch.Tensor, labels: torch.Tensor, unseen: torch.Tensor
) -> dict[str, dict[str, float | int]]:
    """``{"zsl": ..., "gzsl": ...}``: :func:`class_set_figures` of the unseen columns (``unseen``, bool
    (C,)) alone and of every column, from the logits ``scores`` (N, C) and ``labels`` (N, C) of the whole
    evaluation set (results.json's ``metrics.zsl`` and ``metrics.gzsl``)."""
    labels = check_scores_labels(scores, labels)
    unseen = torch.as_tensor(unseen, dtype=torch.bool)
    if unseen.shape != (scores.shape[1],) or not bool(unseen.any()):
        raise ValueError(
            f"unseen must be a bool mask of the {scores.shape[1]} columns with an unseen class, got "
            f"{tuple(unseen.shape)} with {int(unseen.sum())} set"
        )
    columns = torch.nonzero(unseen).flatten()
    return {
        "zsl": class_set_figures(scores[:, columns], labels[:, columns.to(labels.device)]),
        "gzsl": class_set_figures(scores, labels),
    }
