"""The two-way multi-label loss (paper eqs. 14-17) and its joint-way variant (eq. 22).

Both apply the multi-label loss function of eq. 14 to lines of a bucket's logit matrix X (M, C):

    l(line) = softplus( T_N log sum_{n in N} exp(x_n / T_N) + T_P log sum_{p in P} exp(-x_p / T_P) + eps )

where P and N are the line's positive and negative entries (unknown entries are in neither) and eps is
the logit bias of Table 2 (``margin``). The lines are the rows (sample-wise, eq. 15), the columns
(class-wise, eq. 16) or the whole matrix (joint, eq. 22).

Empty sets: a line without a positive is left out of the mean; a line with positives but no negatives
has ``sum_{n in N} = 0``, so ``l = softplus(-inf) = 0``: it counts in the mean with exactly 0. A bucket
without any positive contributes 0 and still counts among the buckets (:func:`line_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from mlcls.losses.common import (
    BucketedLoss,
    LineDims,
    check_positive,
    check_ways,
    line_max,
    line_weights,
    log_total,
)


class _SoftplusLogSumExp(torch.autograd.Function):
    """Sum over ``line_dims`` of the mean of eq. 14 over valid lines and buckets, gradient in the same pass.

    The gradient of eq. 14 has a closed form: with ``z`` the softplus argument,
    ``dl/dx_n = sigmoid(z) * softmax_{N}(x / T_N)_n`` and ``dl/dx_p = -sigmoid(z) * softmax_{P}(-x / T_P)_p``.
    The forward pass already holds both softmaxes, so it assembles the input gradient there and the
    backward pass is one multiplication (autograd through ``torch.logsumexp`` would recompute every
    exponential). First-order only (``once_differentiable``).

    P and N are disjoint, so one exponential per direction serves both sets, every entry shifted by its
    own set's line maximum (no line underflows whatever the other set's range). The full-size passes are
    arithmetic on float masks, several times faster on the CPU than ``torch.where`` on bool masks; a mask
    only multiplies finite values, so ``v * 1 + w * 0`` selects ``v`` exactly.
    An unknown entry, in neither mask, gets an exponent clamped to [lowest finite, 0] whatever its logit
    (even inf or NaN), and then weighs 0 in every sum and gradient.

    Memory: at most five (K, M, C) buffers per call (the two masks, ``scaled``, ``masked`` and the first
    direction's negatives' exponentials, which become the input gradient), each reused in place once its
    content is no longer read; ``forward`` names the buffer's new role at every reuse.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: Tensor,
        targets: Tensor,
        line_dims: tuple[LineDims, ...],
        tp: float,
        tn: float,
        margin: float,
        with_grad: bool,
    ) -> Tensor:
        positive = targets.clamp_min(0.0)  # 1 on P, 0 elsewhere
        negative = targets.abs().neg_().add_(1.0)  # 1 on N, 0 elsewhere
        temperature = (1.0 - positive).mul_(tn).add_(positive, alpha=-tp)  # T_N, and -T_P on P
        # reuse: ``temperature``'s buffer becomes ``scaled``, x / T_N, and -x / T_P on P
        scaled = torch.div(logits, temperature, out=temperature)
        # the line maxima of each set: a -inf fill, which ignores whatever lies outside the set
        masked = torch.where(negative.bool(), scaled, float("-inf"))
        shifts_n = [line_max(masked, dims) for dims in line_dims]
        # reuse: ``masked`` now holds ``scaled`` on P, -inf elsewhere
        masked.copy_(scaled).masked_fill_(~positive.bool(), float("-inf"))  # no host-to-device copy
        shifts_p = [line_max(masked, dims) for dims in line_dims]
        tiny = torch.finfo(logits.dtype).tiny
        loss = logits.new_zeros(())
        grad = None
        for index, (dims, shift_n, shift_p) in enumerate(zip(line_dims, shifts_n, shifts_p, strict=True)):
            # reuse: ``masked``'s buffer becomes this direction's shifted exponent, then its exponentials
            exp = torch.addcmul(scaled, negative, shift_n, value=-1.0, out=masked)
            exp.addcmul_(positive, shift_p, value=-1.0).clamp_max_(0.0).nan_to_num_(nan=0.0).exp_()
            # reuse: the last direction no longer needs ``scaled``: its buffer takes the negatives'
            # exponentials (a fresh buffer in the earlier directions)
            exp_n = torch.mul(exp, negative, out=scaled if index == len(line_dims) - 1 else None)
            exp_p = exp.mul_(positive)  # reuse: ``exp``'s buffer becomes the positives' exponentials
            total_n = exp_n.sum(dims, keepdim=True)
            total_p = exp_p.sum(dims, keepdim=True)  # >= 1 on a line with a positive, 0 on one without
            z = tn * log_total(total_n, shift_n) + tp * log_total(total_p, shift_p) + margin
            weight = line_weights(total_p > 0, logits.dtype)
            loss += (F.softplus(z) * weight).sum()
            if with_grad:
                dz = torch.sigmoid(z) * weight  # 0 on invalid lines and on lines without negatives
                coef_n, coef_p = dz / total_n.clamp_min(tiny), -dz / total_p.clamp_min(tiny)
                if grad is None:
                    # reuse: the first direction's ``exp_n`` buffer becomes the input gradient
                    grad = exp_n.mul_(coef_n).addcmul_(exp_p, coef_p)
                else:
                    grad.addcmul_(exp_n, coef_n).addcmul_(exp_p, coef_p)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return (grad_output * grad, None, None, None, None, None, None)


class SoftplusLogSumExpLoss(BucketedLoss):
    """Base of twoway and joint: eq. 14, the softplus of tempered log-sum-exps over a line's negatives and
    positives, averaged over the lines along each direction of ``line_dims`` and summed over the directions,
    per bucket (:class:`_SoftplusLogSumExp` computes it with its gradient)."""

    line_dims: tuple[LineDims, ...]

    def __init__(
        self,
        tp: float = 4.0,
        tn: float = 1.0,
        bucket_size: int | None = None,
        margin: float = 0.0,
        gather: bool = False,
    ) -> None:
        super().__init__(bucket_size=bucket_size, gather=gather)
        check_positive(tp=tp, tn=tn)
        self.tp, self.tn, self.margin = float(tp), float(tn), float(margin)

    def bucket_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        with_grad = torch.is_grad_enabled() and logits.requires_grad
        return _SoftplusLogSumExp.apply(
            logits, targets, self.line_dims, self.tp, self.tn, self.margin, with_grad
        )


class TwoWayLoss(SoftplusLogSumExpLoss):
    """Two-way multi-label loss, eq. 17: sample-wise eq. 15 plus class-wise eq. 16, per bucket.

    For a bucket X (M, C) with labels Y::

        loss = mean_{i : P_i not empty} l(row i) + mean_{c : P^c not empty} l(column c)

    with ``l`` the eq. 14 function of the module docstring (``T_P = tp``, paper 4; ``T_N = tn``, paper 1;
    eps = ``margin``, Table 2). Reduction: an empty mean is 0; then the mean over the K = B / M buckets.
    ``ways="sample"`` keeps the first term (eq. 15), ``"class"`` the second (eq. 16), ``"both"`` their
    sum (eq. 17). Invariant to adding a constant to every logit (Sec. 3.1); for one-hot rows the
    sample-wise term is the softmax cross-entropy (eq. 1).

    Buckets (:class:`~mlcls.losses.common.BucketedLoss`): the paper's M = 128 is the per-GPU batch of
    4 GPUs x 128, i.e. ``bucket_size=None`` under DDP, or one process with batch 512 and
    ``bucket_size=128``; ``gather=True`` gives Table 5's M = 512 on 4 GPUs.
    """

    name = "twoway"

    def __init__(
        self,
        tp: float = 4.0,
        tn: float = 1.0,
        ways: str = "both",
        bucket_size: int | None = None,
        margin: float = 0.0,
        gather: bool = False,
    ) -> None:
        super().__init__(tp=tp, tn=tn, margin=margin, bucket_size=bucket_size, gather=gather)
        self.line_dims = check_ways(ways)
        self.ways = ways


class JointLoss(SoftplusLogSumExpLoss):
    """Joint-way loss, eq. 22: eq. 14 over all entries of a bucket at once.

    For a bucket X (M, C)::

        loss = softplus( T_N log sum_{(i,n): y_in = 0} exp(x_in / T_N)
                         + T_P log sum_{(j,p): y_jp = 1} exp(-x_jp / T_P) + eps )

    Reduction: mean over buckets of the bucket's single value, which is 0 for a bucket without a
    positive or without a negative. Arguments as in :class:`TwoWayLoss` (without ``ways``). Invariant
    to a constant logit shift.
    """

    name = "joint"
    line_dims = ((1, 2),)
