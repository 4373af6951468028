"""Softmax cross-entropy with normalised multi-label targets (paper eq. 18) and its spherical-family variants.

All three losses are eq. 18 with a different normalised score ``f_c = g(x_c) / sum_{c'} g(x_{c'})``::

    l(line) = -sum_c y~_c log f_c = log sum_{c known} g(x_c) - (1 / |P|) sum_{p in P} log g(x_p)

with ``y~_c = y_c / |P|`` the label normalised to sum 1 over the line's positives P, and the sum in the
denominator over the line's known entries (positives and negatives; unknown entries are excluded from
both). Each class names its score ``g``: ``exp(x)`` (eq. 18), its second-order Taylor expansion, or
``x^2 + eps``. The log of the denominator is a masked log-sum-exp of ``log g``, stable for all three. As
in the two-way loss, the lines are the rows of a bucket (``ways="sample"``, the usual softmax loss of
Table 7), its columns (``"class"``) or both (Table 3b).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlcls.losses.common import BucketedLoss, check_positive, check_ways, line_weights, masked_logsumexp


class _NormalisedCrossEntropy(BucketedLoss):
    """Eq. 18 with the score ``g`` given by :meth:`log_score`, along the ways of ``ways``.

    Reduction: for each way, mean over the lines (rows or columns of a bucket) holding at least one
    positive, then mean over buckets; ``ways="both"`` sums the two ways. With the default
    ``ways="sample"`` and one bucket: the mean over the samples with at least one positive.
    """

    def __init__(self, ways: str = "sample", bucket_size: int | None = None, gather: bool = False) -> None:
        super().__init__(bucket_size=bucket_size, gather=gather)
        self.line_dims = check_ways(ways)
        self.ways = ways

    def log_score(self, logits: Tensor) -> Tensor:
        """``log g(x)`` elementwise."""
        raise NotImplementedError

    def bucket_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        scores = self.log_score(logits)
        positive = targets == 1
        known = positive | (targets == 0)
        loss = logits.new_zeros(())
        for dims in self.line_dims:
            num_pos = positive.sum(dims, keepdim=True)
            pos_mean = torch.where(positive, scores, 0.0).sum(dims, keepdim=True) / num_pos.clamp(min=1)
            per_line, valid = masked_logsumexp(scores, known, dims) - pos_mean, num_pos > 0
            # a line without a positive is dropped with ``where`` (its value may be -inf or NaN)
            loss = loss + (torch.where(valid, per_line, 0.0) * line_weights(valid, per_line.dtype)).sum()
        return loss


class SoftmaxLoss(_NormalisedCrossEntropy):
    """Softmax cross-entropy with labels normalised to sum 1, eq. 18: ``g(x) = exp(x)``.

    ``l(line) = logsumexp_{known}(x) - mean_{p in P} x_p``. Invariant to a constant logit shift.
    Reduction: as :class:`_NormalisedCrossEntropy`.
    """

    name = "softmax"

    def log_score(self, logits: Tensor) -> Tensor:
        return logits


class TaylorSoftmaxLoss(_NormalisedCrossEntropy):
    """Eq. 18 with the Taylor softmax of de Brebisson & Vincent: ``g(x) = 1 + x + x^2 / 2``.

    ``l(line) = log sum_{known} g(x_c) - mean_{p in P} log g(x_p)``; ``g >= 1/2`` so the log is always
    finite. Not shift-invariant. Reduction: as :class:`_NormalisedCrossEntropy`.
    """

    name = "taylor_softmax"

    def log_score(self, logits: Tensor) -> Tensor:
        return torch.log(1.0 + logits + 0.5 * logits.square())


class SphericalSoftmaxLoss(_NormalisedCrossEntropy):
    """Eq. 18 with the spherical softmax of de Brebisson & Vincent: ``g(x) = x^2 + eps``.

    ``l(line) = log sum_{known} (x_c^2 + eps) - mean_{p in P} log(x_p^2 + eps)``. ``eps`` keeps the log
    finite at x = 0 and bounds the gradient of ``log g`` by ``1 / sqrt(eps)``. Even in x and invariant to
    scaling x when eps = 0; not shift-invariant. Reduction: as :class:`_NormalisedCrossEntropy`.
    """

    name = "spherical_softmax"

    def __init__(
        self, eps: float = 0.01, ways: str = "sample", bucket_size: int | None = None, gather: bool = False
    ) -> None:
        super().__init__(ways=ways, bucket_size=bucket_size, gather=gather)
        check_positive(eps=eps)
        self.eps = float(eps)

    def log_score(self, logits: Tensor) -> Tensor:
        return torch.log(logits.square() + self.eps)
