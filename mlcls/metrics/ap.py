"""Average precision, mAP@class (eq. 23) and mAP@sample (eq. 24).

Non-interpolated AP with tied scores grouped as in ``sklearn.metrics.average_precision_score``;
entries labelled -1 are excluded; a column (row) without positives has AP = NaN and is left out of
the mean, as in the paper.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import average_precision_score


def average_precision(scores: torch.Tensor, labels: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """AP of every column (``dim=0``) or row (``dim=1``); float64 tensor, NaN where there is no positive."""
    s = scores.double().cpu().numpy()
    y = labels.cpu().numpy()
    if dim == 1:
        s, y = s.T, y.T
    out = np.full(s.shape[1], np.nan)
    for j in range(s.shape[1]):
        known = y[:, j] >= 0
        if (y[known, j] == 1).any():
            out[j] = average_precision_score(y[known, j] == 1, s[known, j])
    return torch.from_numpy(out)


def _mean_counted(ap: torch.Tensor) -> tuple[float, int]:
    counted = ~torch.isnan(ap)
    if not counted.any():
        return float("nan"), 0
    return 100.0 * ap[counted].mean().item(), int(counted.sum())


def map_class(scores: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Eq. 23 in percent, and the number of classes counted (those with a positive)."""
    return _mean_counted(average_precision(scores, labels, dim=0))


def map_sample(scores: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Eq. 24 in percent, and the number of samples counted (those with a positive)."""
    return _mean_counted(average_precision(scores, labels, dim=1))
