"""Zero-shot figures (``dataset.unseen_classes``): ZSL, the unseen classes alone, and GZSL, the seen and
unseen classes together, each as the zero-shot multi-label literature's released code scores them (LESA,
Huynh & Elhamifar, CVPR 2020, ``core/utils.py``; BiAM, ``util_nus.py``; ML-Decoder, ``train_zsl_nus.py``):
mAP and the F1 of the top 3 and top 5 predictions of every image. docs/text.md, "Zero-shot figures",
names each convention's source.

For a class set S (the unseen columns for ZSL, every column for GZSL), with ``scores`` and ``labels``
restricted to S's columns and to the images scored:

* images scored -- GZSL: every image of the evaluation set. ZSL (``metrics.zsl_images``,
  :data:`ZSL_IMAGES`): ``all`` every image (LESA's ``evaluate`` / ``evaluate_k`` with their default
  ``exclude=False``), or ``unseen_positive`` the images with at least one positive among the unseen classes
  (ML-Decoder's ``DatasetFromList.get_relevant_samples`` on its test split, whose ``class_ids`` are the
  unseen ones: an image is kept when any of its label indices is one of them);
* ``mAP_class``: the mean over *every* class of S of its AP (:func:`mlcls.metrics.ap.average_precision`),
  a class without a positive among the images scored counting AP = 0, as LESA's ``compute_AP`` (its
  ``ap`` array of zeros, skipped classes left at 0), BiAM's ``compute_AP`` and ML-Decoder's
  ``average_precision`` (0 / (0 + 1e-8)) do before their mean. ``classes_without_positive`` counts them.
  (The evaluation's own ``mAP_class``, the paper's eq. 23, leaves such a class out instead.)
* ``mAP_sample``: :func:`mlcls.metrics.ap.map_sample` (eq. 24, the mean over the images with a positive
  in S); the sources report none.
* ``P_top{k}``, ``R_top{k}``, ``F1_top{k}`` (k = 3, 5): the overall precision and recall of the k
  highest-scoring classes of S per image, as LESA's ``evaluate_k`` and ``compute_F1`` (mode ``overall``)
  compute them::

      TP@k = #{(i, c) : c among image i's top k, y_ic = 1}
      P@k  = TP@k / (k' N)          k' = min(k, |S|): every image predicts k' classes
      R@k  = TP@k / #{(i, c) : y_ic = 1}
      F1@k = 2 P R / (P + R)        (0 when P = R = 0)

  over the N images scored, those without a positive in S included (each of their k' predictions a false
  positive). An unknown label (-1) is no positive: a prediction there counts in the denominator of P, not
  in TP, and not in the positives of R. With no image P is NaN; with no positive R and F1 are NaN.

  Ties at the k-th place go to the *higher* class index: LESA takes the last k of ``np.argsort(scores,
  axis=1)`` (ascending), which with the order of equal scores kept (``kind="stable"``) ends with the
  higher index among them. LESA's own call uses numpy's default sort, which keeps no order of equal
  scores (it depends on numpy's version and the CPU), so its own tied runs are not reproducible; mlcls
  fixes the stable reading. (The evaluation's ``*_top{k}`` figures take the lower index:
  :func:`mlcls.metrics.f1.top_k_predictions`.)

Every figure is in percent. ``classes``, ``images`` and ``samples_counted`` say how many classes S holds,
how many images were scored, and how many of them have a positive in S.
"""

from __future__ import annotations

import torch

from mlcls.errors import ConfigError, shown
from mlcls.metrics.ap import average_precision, block_slices, map_sample
from mlcls.metrics.checks import check_scores_labels
from mlcls.metrics.f1 import f1_of, prediction_counts, top_k_predictions

# The k of the F1@k figures (the field's: LESA, ML-Decoder, BiAM, MKT report F1@3 and F1@5).
ZERO_SHOT_TOP_K = (3, 5)
# metrics.zsl_images: which images the ZSL figures score (module docstring)
ZSL_IMAGES = ("all", "unseen_positive")


def check_zsl_images(value: object) -> str:
    """``value`` when it is one of :data:`ZSL_IMAGES` (``metrics.zsl_images``); a one-line
    :class:`ConfigError` otherwise."""
    if value not in ZSL_IMAGES:
        raise ConfigError(
            f"metrics.zsl_images={shown(value)}; expected one of {', '.join(ZSL_IMAGES)} (the images the "
            "ZSL figures score: every image, or those with a positive among the unseen classes)"
        )
    return str(value)


def top_k_higher_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest-scoring classes of every row (bool (N, C)), ties at the k-th place going to the
    higher class index (LESA's rule, module docstring): :func:`top_k_predictions`, whose ties go to the
    lower index, on the columns in reverse order."""
    return top_k_predictions(scores.flip(1), k).flip(1)


def top_k_f1(scores: torch.Tensor, labels: torch.Tensor, k: int) -> dict[str, float]:
    """``P_top{k}``, ``R_top{k}`` and ``F1_top{k}`` in percent of ``scores`` (N, C) against ``labels``
    (N, C; 1, 0, -1), as the module docstring defines them (the field's overall P and R of the top k
    classes per image, ties to the higher index). Counted by blocks of rows: no (N, C) temporary of the
    whole set."""
    labels = check_scores_labels(scores, labels)
    rows, columns = scores.shape
    blocks = block_slices(rows, columns)
    counts = sum(prediction_counts(top_k_higher_index(scores[block], k), labels[block]) for block in blocks)
    true_positives, positives = int(counts[0].sum()), int(counts[2].sum())
    predictions = min(k, columns) * rows
    precision = 100.0 * true_positives / predictions if predictions else float("nan")
    recall = 100.0 * true_positives / positives if positives else float("nan")
    return {f"P_top{k}": precision, f"R_top{k}": recall, f"F1_top{k}": f1_of(precision, recall)}


def class_set_figures(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float | int]:
    """The figures of the module docstring of one class set (``scores`` and ``labels`` (N, C) of its
    columns and of the images scored): mAP@class with AP 0 for a class without positive, mAP@sample,
    :func:`top_k_f1` for every k of :data:`ZERO_SHOT_TOP_K`, and the class and image counts."""
    class_ap = average_precision(scores, labels, dim=0)  # NaN where a class has no positive
    without = torch.isnan(class_ap)
    map_class_percent = 100.0 * class_ap.masked_fill(without, 0.0).mean().item()
    map_sample_percent, samples_counted = map_sample(scores, labels)
    figures: dict[str, float | int] = {
        "mAP_class": map_class_percent,
        "mAP_sample": map_sample_percent,
        "classes": scores.shape[1],
        "classes_without_positive": int(without.sum()),
        "images": scores.shape[0],
        "samples_counted": samples_counted,
    }
    for k in ZERO_SHOT_TOP_K:
        figures.update(top_k_f1(scores, labels, k))
    return figures


def zero_shot_metrics(
    scores: torch.Tensor, labels: torch.Tensor, unseen: torch.Tensor, zsl_images: str = "all"
) -> dict[str, dict[str, float | int]]:
    """``{"zsl": ..., "gzsl": ...}``: :func:`class_set_figures` of the unseen columns (``unseen``, bool
    (C,)) on the images ``zsl_images`` names (:data:`ZSL_IMAGES`), and of every column on every image,
    from the logits ``scores`` (N, C) and ``labels`` (N, C) of the whole evaluation set (results.json's
    ``metrics.zsl`` and ``metrics.gzsl``)."""
    labels = check_scores_labels(scores, labels)
    unseen = torch.as_tensor(unseen, dtype=torch.bool)
    if unseen.shape != (scores.shape[1],) or not bool(unseen.any()):
        raise ValueError(
            f"unseen must be a bool mask of the {scores.shape[1]} columns with an unseen class, got "
            f"{tuple(unseen.shape)} with {int(unseen.sum())} set"
        )
    check_zsl_images(zsl_images)
    columns = torch.nonzero(unseen).flatten()
    zsl_scores, zsl_labels = scores[:, columns], labels[:, columns.to(labels.device)]
    if zsl_images == "unseen_positive":
        rows = (zsl_labels == 1).any(dim=1)
        zsl_scores, zsl_labels = zsl_scores[rows.to(zsl_scores.device)], zsl_labels[rows]
    return {
        "zsl": class_set_figures(zsl_scores, zsl_labels),
        "gzsl": class_set_figures(scores, labels),
    }
