"""The input checks and the count every metric shares: scores (N, C) and labels (N, C) in {1, 0, -1} are
validated here once, for :mod:`mlcls.metrics.ap`, :mod:`mlcls.metrics.f1` and the threshold calibration."""

from __future__ import annotations

import torch


def check_scores(scores: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``scores`` is a real 2-D tensor (N, C) without NaN."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be a 2-D tensor (N, C), got shape {tuple(scores.shape)}")
    if scores.is_complex() or scores.dtype == torch.bool:
        raise ValueError(f"scores must be real numbers, got dtype {scores.dtype}")
    if scores.is_floating_point() and scores.numel() and torch.aminmax(scores).min.isnan():
        raise ValueError("scores contain NaN")


def check_labels(labels: torch.Tensor, shape: torch.Size, against: str = "scores") -> torch.Tensor:
    """``labels`` as int8 after checking its shape (that of ``against``) and its values (1, 0 or -1);
    ``ValueError`` on a shape mismatch or a label outside {1, 0, -1} (named in the message)."""
    if labels.shape != shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} and {against} {tuple(shape)} must have one shape (N, C)"
        )
    as_int8 = labels.to(torch.int8)
    if labels.numel():
        lowest, highest = torch.aminmax(as_int8)
        # the conversion wraps or truncates anything but an integer of [-128, 127]: compare back
        if lowest < -1 or highest > 1 or (labels.dtype != torch.int8 and (as_int8 != labels).any()):
            invalid = (labels != 1) & (labels != 0) & (labels != -1)
            raise ValueError(f"labels must be 1, 0 or -1; found {labels[invalid][0].item()}")
    return as_int8


def check_scores_labels(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`check_scores` and :func:`check_labels`, the validation of every metric; returns int8 labels."""
    check_scores(scores)
    return check_labels(labels, scores.shape)


def count_true(mask: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Number of True entries of a bool tensor along ``dim`` (int64); summed as uint8 into int32, which
    moves a quarter of the memory of ``mask.sum(dim)``."""
    return mask.view(torch.uint8).sum(dim, keepdim=keepdim, dtype=torch.int32).long()
