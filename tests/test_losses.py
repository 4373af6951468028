"""Tests of mlcls.losses against independent references.

The references are written straight from the paper's equations with explicit Python loops over rows,
columns and buckets, in float64 (a stable log-sum-exp and softplus where logits reach +-1e4). Focal and
ASL are compared with torchvision and timm. The two-process DDP test is in test_losses_common_ddp.py.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable

import pytest
import timm.loss
import torch
import torch.nn.functional as F
import torchvision.ops
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor

from mlcls import config_dir
from mlcls.bench import loss_bench
from mlcls.cli.bench import main as bench_main
from mlcls.losses import (
    AsymmetricLoss,
    BinaryCrossEntropyLoss,
    FocalLoss,
    JointLoss,
    MultiSimilarityLoss,
    SoftmaxLoss,
    SphericalSoftmaxLoss,
    TaylorSoftmaxLoss,
    TwoWayLoss,
    ZLPRLoss,
)
from mlcls.losses.common import REDUCTIONS
from mlcls.losses.spec import loss_name

# loss=<name> on the command line -> the class its config builds
CLASSES: dict[str, type[torch.nn.Module]] = {
    "twoway": TwoWayLoss,
    "joint": JointLoss,
    "multisim": MultiSimilarityLoss,
    "zlpr": ZLPRLoss,
    "softmax": SoftmaxLoss,
    "bce": BinaryCrossEntropyLoss,
    "focal": FocalLoss,
    "asl": AsymmetricLoss,
    "taylor_softmax": TaylorSoftmaxLoss,
    "spherical_softmax": SphericalSoftmaxLoss,
}
NAMES = tuple(CLASSES)
# the losses that give unknown labels a term of their own: tested in test_losses_unknown.py
UNKNOWN_LABEL_NAMES = ("an", "an_ls", "wan", "epr", "em", "ll", "hill", "splc", "role")
TOL = {"rtol": 1e-10, "atol": 1e-10}
F64 = torch.float64
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------------------
# float64 references, one scalar at a time


def ref_logsumexp(values: list[Tensor]) -> Tensor:
    """log sum_k exp(v_k) over a list of scalars (max-shifted); -inf for an empty list."""
    if not values:
        return torch.tensor(NEG_INF, dtype=F64)
    top = max(float(v.detach()) for v in values)
    total = torch.zeros((), dtype=F64)
    for v in values:
        total = total + torch.exp(v - top)
    return top + torch.log(total)


def ref_softplus(z: Tensor) -> Tensor:
    """log(1 + e^z), written as max(z, 0) + log(1 + e^-|z|) so that z = 1e4 does not overflow."""
    if float(z.detach()) == NEG_INF:
        return torch.zeros((), dtype=F64)
    return torch.clamp(z, min=0) + torch.log1p(torch.exp(-torch.abs(z)))


def ref_eq14(pos: list[Tensor], neg: list[Tensor], tp: float, tn: float, margin: float) -> Tensor:
    """Eq. 14: softplus(T_N log sum_n e^{x_n/T_N} + T_P log sum_p e^{-x_p/T_P} + eps); 0 without negatives."""
    if not neg:
        return torch.zeros((), dtype=F64)
    z = tn * ref_logsumexp([v / tn for v in neg]) + tp * ref_logsumexp([-v / tp for v in pos]) + margin
    return ref_softplus(z)


def ref_mean(values: list[Tensor]) -> Tensor:
    total = torch.zeros((), dtype=F64)
    for v in values:
        total = total + v
    return total / max(len(values), 1)


def ref_lines(
    x: Tensor, y: Tensor, rows: range, way: str
) -> list[tuple[list[Tensor], list[Tensor], list[Tensor]]]:
    """(positive, negative, known) logits of every row (way="sample") or column (way="class") of a bucket."""
    classes = range(x.shape[1])
    if way == "sample":
        index_lines = [[(i, c) for c in classes] for i in rows]
    else:
        index_lines = [[(i, c) for i in rows] for c in classes]
    labels, entries = y.tolist(), [row.unbind() for row in x.unbind()]  # scalars, read once
    lines = []
    for line in index_lines:
        pos = [entries[i][c] for i, c in line if labels[i][c] == 1]
        neg = [entries[i][c] for i, c in line if labels[i][c] == 0]
        known = [entries[i][c] for i, c in line if labels[i][c] != -1]
        lines.append((pos, neg, known))
    return lines


def ref_bucketed(x: Tensor, y: Tensor, bucket_size: int | None, bucket_loss: Callable) -> Tensor:
    """Mean over consecutive buckets of ``bucket_loss(rows)``."""
    size = bucket_size or x.shape[0]
    return ref_mean([bucket_loss(range(k, k + size)) for k in range(0, x.shape[0], size)])


def ref_twoway(x, y, tp=4.0, tn=1.0, ways="both", bucket_size=None, margin=0.0) -> Tensor:
    """Eq. 17 (or 15 / 16 alone): per bucket, mean of eq. 14 over rows / columns holding a positive."""
    ways_used = ("sample", "class") if ways == "both" else (ways,)

    def bucket(rows: range) -> Tensor:
        total = torch.zeros((), dtype=F64)
        for way in ways_used:
            lines = ref_lines(x, y, rows, way)
            total = total + ref_mean([ref_eq14(p, n, tp, tn, margin) for p, n, _ in lines if p])
        return total

    return ref_bucketed(x, y, bucket_size, bucket)


def ref_joint(x, y, tp=4.0, tn=1.0, bucket_size=None, margin=0.0) -> Tensor:
    """Eq. 22: eq. 14 over all (i, c) of a bucket; 0 for a bucket without a positive."""

    def bucket(rows: range) -> Tensor:
        pos = [x[i, c] for i in rows for c in range(x.shape[1]) if y[i, c] == 1]
        neg = [x[i, c] for i in rows for c in range(x.shape[1]) if y[i, c] == 0]
        return ref_eq14(pos, neg, tp, tn, margin) if pos else torch.zeros((), dtype=F64)

    return ref_bucketed(x, y, bucket_size, bucket)


def ref_softmax_family(x, y, name: str, ways="sample", bucket_size=None, eps=0.01) -> Tensor:
    """Eq. 18, -sum_c y~_c log(g(x_c) / sum_{c' known} g(x_c')), y~ = y / |P|, per line holding a positive."""

    def log_normalised(value: Tensor, known: list[Tensor]) -> Tensor:
        if name == "softmax":  # log(e^x / sum e^x'), stable for logits of 1e4
            return value - ref_logsumexp(known)
        g = (lambda v: 1 + v + v**2 / 2) if name == "taylor_softmax" else (lambda v: v**2 + eps)
        denominator = torch.zeros((), dtype=F64)
        for v in known:
            denominator = denominator + g(v)
        return torch.log(g(value) / denominator)

    ways_used = ("sample", "class") if ways == "both" else (ways,)

    def bucket(rows: range) -> Tensor:
        total = torch.zeros((), dtype=F64)
        for way in ways_used:
            losses = []
            for pos, _, known in ref_lines(x, y, rows, way):
                if pos:
                    losses.append(-ref_mean([log_normalised(p, known) for p in pos]))
            total = total + ref_mean(losses)
        return total

    return ref_bucketed(x, y, bucket_size, bucket)


def ref_multisim(x, y, tp=4.0) -> Tensor:
    """Eq. 20 with T_P: log(1 + (sum_p e^{-x_p/T_P})^T_P) + log(1 + sum_n e^{x_n}), mean over known rows."""
    losses = []
    for pos, neg, known in ref_lines(x, y, range(x.shape[0]), "sample"):
        if known:
            losses.append(
                ref_softplus(tp * ref_logsumexp([-v / tp for v in pos])) + ref_softplus(ref_logsumexp(neg))
            )
    return ref_mean(losses)


def ref_zlpr_literal(x, y) -> Tensor:
    """Su's loss exactly as written: log(1 + sum_p e^{-x_p}) + log(1 + sum_n e^{x_n}) (moderate logits)."""
    losses = []
    for pos, neg, known in ref_lines(x, y, range(x.shape[0]), "sample"):
        if known:
            sum_p = sum((torch.exp(-v) for v in pos), torch.zeros((), dtype=F64))
            sum_n = sum((torch.exp(v) for v in neg), torch.zeros((), dtype=F64))
            losses.append(torch.log(1 + sum_p) + torch.log(1 + sum_n))
    return ref_mean(losses)


def ref_reduce(entries: list[list[Tensor | None]], reduction: str = "mean") -> Tensor:
    """Reduce per-entry losses (rows of samples; None = unknown label) as ``reduction`` says."""
    rows = [[v for v in row if v is not None] for row in entries]
    if reduction == "mean":
        return ref_mean([v for row in rows for v in row])
    if reduction == "sum":
        return sum((v for row in rows for v in row), torch.zeros((), dtype=F64))
    assert reduction == "sum_per_sample"
    return ref_mean([sum(row, torch.zeros((), dtype=F64)) for row in rows if row])


def ref_entrywise(
    x: Tensor, y: Tensor, entry: Callable[[Tensor, int, int], Tensor], reduction: str
) -> Tensor:
    """``entry(x_ic, y_ic, c)`` on every known entry, reduced by :func:`ref_reduce`."""
    entries = [
        [entry(x[i, c], int(y[i, c]), c) if y[i, c] != -1 else None for c in range(x.shape[1])]
        for i in range(x.shape[0])
    ]
    return ref_reduce(entries, reduction)


def ref_bce(x, y, weight: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """Eq. 19: -w_c y log(1 / (1 + e^-x)) - (1 - y) log(1 / (1 + e^x)), reduced over the known entries."""

    def entry(v: Tensor, label: int, c: int) -> Tensor:
        w = 1.0 if weight is None else float(weight[c])
        return w * ref_softplus(-v) if label == 1 else ref_softplus(v)  # -log sigmoid(x) = softplus(-x)

    return ref_entrywise(x, y, entry, reduction)


def ref_focal(x, y, gamma: float, alpha: float | None, reduction: str) -> Tensor:
    """-alpha_t (1 - p_t)^gamma log p_t with p_t = sigmoid(x) for a positive, 1 - sigmoid(x) otherwise."""

    def entry(v: Tensor, label: int, c: int) -> Tensor:
        p = 1 / (1 + torch.exp(-v))
        p_t = p if label == 1 else 1 - p
        alpha_t = 1.0 if alpha is None else (alpha if label == 1 else 1 - alpha)
        return -alpha_t * (1 - p_t) ** gamma * torch.log(p_t)

    return ref_entrywise(x, y, entry, reduction)


def ref_asl(x, y, gamma_pos: float, gamma_neg: float, clip: float, detach: bool, reduction: str) -> Tensor:
    """-(1 - p)^g+ log p for a positive, -p_m^g- log(1 - p_m) with p_m = max(p - m, 0) for a negative."""

    def entry(v: Tensor, label: int, c: int) -> Tensor:
        p = 1 / (1 + torch.exp(-v))
        prob = p if label == 1 else torch.clamp(p - clip, min=0)
        weight = (1 - prob) ** gamma_pos if label == 1 else prob**gamma_neg
        weight = weight.detach() if detach else weight
        return -weight * torch.log(prob if label == 1 else 1 - prob)

    return ref_entrywise(x, y, entry, reduction)


# ---------------------------------------------------------------------------------------------------------
# inputs


def random_batch(rows=8, classes=5, seed=0, p_pos=0.3, p_unknown=0.15, scale=3.0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(rows, classes, generator=generator, dtype=F64)
    u = torch.rand(rows, classes, generator=generator, dtype=F64)
    y = torch.where(u < p_pos, 1.0, torch.where(u < p_pos + p_unknown, -1.0, 0.0)).to(F64)
    return x, y


def edge_batches() -> dict[str, tuple[Tensor, Tensor, int | None]]:
    """(logits, targets, bucket_size) of every edge case of the issue."""
    x, y = random_batch(seed=1)
    cases = {}
    y_empty_bucket = y.clone()
    y_empty_bucket[:4][y_empty_bucket[:4] == 1] = 0  # bucket 0 of size 4: no positive at all
    cases["bucket_without_positive"] = (x, y_empty_bucket, 4)
    y_rows = y.clone()
    y_rows[[0, 5]] = 1.0  # all-positive rows
    cases["all_positive_rows"] = (x, y_rows, 4)
    y_cols = y.clone()
    y_cols[:, [1, 3]] = 1.0  # all-positive columns
    cases["all_positive_columns"] = (x, y_cols, None)
    signs = torch.where(torch.rand(8, 5, generator=torch.Generator().manual_seed(2)) < 0.5, -1.0, 1.0)
    cases["extreme_logits"] = (1e4 * signs.to(F64), y, 4)
    cases["mixed_extreme_logits"] = (torch.where(y == 1, -1e4, 1e4) + x, y, None)
    cases["many_unknown"] = (*random_batch(seed=3, p_pos=0.15, p_unknown=0.7), 2)
    cases["all_unknown"] = (x, torch.full_like(y, -1.0), None)
    cases["no_positive"] = (x, torch.where(y == 1, 0.0, y), None)
    cases["all_positive"] = (x, torch.ones_like(y), 4)
    return cases


EDGES = edge_batches()


def value_and_grad(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    leaf = x.detach().clone().requires_grad_(True)
    value = fn(leaf)
    if not value.requires_grad:
        return value.detach(), torch.zeros_like(x)
    (grad,) = torch.autograd.grad(value, leaf, allow_unused=True)
    return value.detach(), torch.zeros_like(x) if grad is None else grad


def assert_matches(loss: Callable, reference: Callable, x: Tensor, y: Tensor) -> None:
    """Value and gradient of ``loss`` equal those of ``reference`` at 1e-10."""
    value, grad = value_and_grad(lambda leaf: loss(leaf, y), x)
    ref_value, ref_grad = value_and_grad(lambda leaf: reference(leaf, y), x)
    torch.testing.assert_close(value, ref_value, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)


def make_loss(name: str, train_labels: Tensor | None = None, **kwargs) -> torch.nn.Module:
    loss = CLASSES[name](**kwargs)
    if hasattr(loss, "setup"):
        loss.setup(train_labels if train_labels is not None else random_batch(rows=40, seed=9)[1])
    return loss


# ---------------------------------------------------------------------------------------------------------
# equations


@pytest.mark.parametrize("ways", ["both", "sample", "class"])
@pytest.mark.parametrize("bucket_size", [None, 4, 2])
@pytest.mark.parametrize(("tp", "tn", "margin"), [(4.0, 1.0, 0.0), (0.5, 2.0, 1.5), (1.0, 1.0, -0.7)])
def test_twoway_equals_eqs_14_to_17(ways, bucket_size, tp, tn, margin):
    loss = TwoWayLoss(tp=tp, tn=tn, ways=ways, bucket_size=bucket_size, margin=margin)
    for seed in range(2):
        x, y = random_batch(seed=seed)
        assert_matches(loss, lambda a, b: ref_twoway(a, b, tp, tn, ways, bucket_size, margin), x, y)


def test_twoway_with_most_columns_empty_in_each_bucket_equals_eq_16():
    """A tagger's bucket: of 2,000 classes 95 % have no positive in a bucket (some hold unknowns), a few
    have one in one bucket only. Eq. 16's class-wise mean runs over the columns holding a positive; the
    empty ones add nothing to the value and get a zero gradient."""
    generator = torch.Generator().manual_seed(7)
    x, y = random_batch(rows=8, classes=2000, seed=7, p_pos=0.3, p_unknown=0.05)
    empty = torch.rand(2000, generator=generator) < 0.95
    y[:, empty] = torch.where(y[:, empty] == 1, 0.0, y[:, empty])  # all-negative (or unknown) columns
    y[:4, ~empty & (torch.arange(2000) % 7 == 0)] = 0.0  # tagged in the second bucket only
    columns_with_positives = [(y[k : k + 4] == 1).any(0).sum().item() for k in (0, 4)]
    assert all(0 < count < 0.06 * 2000 for count in columns_with_positives)
    loss = TwoWayLoss(ways="class", bucket_size=4)
    assert_matches(loss, lambda a, b: ref_twoway(a, b, ways="class", bucket_size=4), x, y)
    _, grad = value_and_grad(lambda leaf: loss(leaf, y), x)
    assert (grad[:, empty] == 0).all() and (grad[:, ~empty] != 0).any()


@pytest.mark.parametrize(("tp", "tn", "bucket_size"), [(4.0, 1.0, None), (1.0, 0.5, 4), (2.0, 1.0, 2)])
def test_joint_equals_eq_22(tp, tn, bucket_size):
    loss = CLASSES["joint"](tp=tp, tn=tn, bucket_size=bucket_size)
    x, y = random_batch(seed=4)
    assert_matches(loss, lambda a, b: ref_joint(a, b, tp, tn, bucket_size), x, y)


@pytest.mark.parametrize("name", ["softmax", "taylor_softmax", "spherical_softmax"])
@pytest.mark.parametrize(("ways", "bucket_size"), [("sample", None), ("class", 4), ("both", 2)])
def test_softmax_family_equals_eq_18(name, ways, bucket_size):
    loss = CLASSES[name](ways=ways, bucket_size=bucket_size)
    x, y = random_batch(seed=5)
    assert_matches(loss, lambda a, b: ref_softmax_family(a, b, name, ways, bucket_size), x, y)


@pytest.mark.parametrize("tp", [1.0, 2.0, 4.0])
def test_multisim_equals_eq_20(tp):
    x, y = random_batch(seed=6)
    assert_matches(CLASSES["multisim"](tp=tp), lambda a, b: ref_multisim(a, b, tp), x, y)


def test_zlpr_is_su_multilabel_softmax_ce():
    x, y = random_batch(seed=7)
    assert_matches(CLASSES["zlpr"](), ref_zlpr_literal, x, y)
    assert CLASSES["multisim"]().tp == 4.0 and CLASSES["zlpr"]().tp == 1.0


def test_bce_equals_eq_19_with_and_without_class_weights():
    x, y = random_batch(seed=8)
    train = torch.tensor([[1, 0, 0, -1, 1], [1, 1, 0, 0, 0], [0, -1, 0, 0, 0], [1, 0, 0, 0, -1]], dtype=F64)
    # w_c = negatives / positives of class c, unknown labels not counted; 1 for classes 2 and 3 (no positive)
    expected_weight = torch.tensor([1 / 3, 2 / 1, 1.0, 1.0, 2 / 1])
    weighted = BinaryCrossEntropyLoss(pos_weight="freq")
    weighted.setup(train)
    torch.testing.assert_close(weighted.class_weight, expected_weight.float())
    assert_matches(BinaryCrossEntropyLoss(), ref_bce, x, y)
    assert_matches(weighted, lambda a, b: ref_bce(a, b, expected_weight.to(F64)), x, y)


def test_bce_freq_needs_setup():
    x, y = random_batch()
    with pytest.raises(RuntimeError, match="setup"):
        BinaryCrossEntropyLoss(pos_weight="freq")(x, y)
    assert not hasattr(CLASSES["twoway"](), "setup")  # the trainer calls setup only where it exists


@pytest.mark.parametrize(("gamma", "alpha"), [(2.0, None), (2.0, 0.25), (0.0, None), (1.5, 0.75)])
def test_focal_equals_torchvision(gamma, alpha):
    x, y = random_batch(seed=10, p_unknown=0.0)
    x[0, :2] = torch.tensor([1e4, -1e4], dtype=F64)  # torchvision is exact there too in float64
    tv_alpha = -1 if alpha is None else alpha
    loss = CLASSES["focal"](gamma=gamma, alpha=alpha)

    def torchvision_mean(a, b):
        return torchvision.ops.sigmoid_focal_loss(a, b, alpha=tv_alpha, gamma=gamma, reduction="mean")

    assert_matches(loss, torchvision_mean, x, y)
    # with unknown labels: torchvision's per-entry loss averaged over the known entries only
    x, y = random_batch(seed=11, p_unknown=0.4)

    def torchvision_known(a, b):
        known = b >= 0
        per_entry = torchvision.ops.sigmoid_focal_loss(a, b.clamp(min=0), alpha=tv_alpha, gamma=gamma)
        return per_entry[known].mean()

    assert_matches(loss, torchvision_known, x, y)


@pytest.mark.parametrize(
    ("gamma_pos", "gamma_neg", "clip"), [(0.0, 4.0, 0.05), (1.0, 4.0, 0.05), (1.0, 2.0, 0.0)]
)
@pytest.mark.parametrize("detach_weight", [False, True])
def test_asl_equals_timm(gamma_pos, gamma_neg, clip, detach_weight):
    x, y = random_batch(seed=12, p_unknown=0.0)
    timm_loss = timm.loss.AsymmetricLossMultiLabel(
        gamma_neg=gamma_neg,
        gamma_pos=gamma_pos,
        clip=clip,
        disable_torch_grad_focal_loss=detach_weight,
        reduction="mean",
    )
    ours = CLASSES["asl"](gamma_pos=gamma_pos, gamma_neg=gamma_neg, clip=clip, detach_weight=detach_weight)
    x32 = x.float()
    value, grad = value_and_grad(lambda a: ours(a, y), x32)
    ref_value, ref_grad = value_and_grad(lambda a: timm_loss(a, y.float()), x32)
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-7)  # timm computes in float32
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)
    # with unknown labels: timm's per-entry loss averaged over the known entries only
    x, y = random_batch(seed=13, p_unknown=0.4)
    timm_loss.reduction = "none"
    known = y >= 0
    torch.testing.assert_close(
        ours(x.float(), y), timm_loss(x.float(), y.clamp(min=0).float())[known].mean(), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_entrywise_reductions_equal_reference_loops(reduction):
    """mean over known entries, sum over known entries, per-sample sums averaged over samples with a label."""
    x, y = random_batch(rows=6, seed=23, p_unknown=0.3)
    y[2] = -1.0  # a sample without any known label: no term in the mean over samples
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.0], dtype=F64)
    bce = BinaryCrossEntropyLoss(pos_weight="freq", reduction=reduction).double()
    bce.class_weight = weight
    assert_matches(bce, lambda a, b: ref_bce(a, b, weight, reduction), x, y)
    assert_matches(
        FocalLoss(gamma=2.0, alpha=0.25, reduction=reduction),
        lambda a, b: ref_focal(a, b, 2.0, 0.25, reduction),
        x,
        y,
    )
    for detach in (False, True):  # the paper preset: detached focusing weights, summed
        assert_matches(
            AsymmetricLoss(
                gamma_pos=1.0, gamma_neg=4.0, clip=0.05, detach_weight=detach, reduction=reduction
            ),
            lambda a, b, d=detach: ref_asl(a, b, 1.0, 4.0, 0.05, d, reduction),
            x,
            y,
        )


def test_entrywise_reductions_relate_by_counts():
    """On fully known labels: sum = B C x mean and sum_per_sample = C x mean."""
    x, y = random_batch(rows=6, classes=5, seed=24, p_unknown=0.0)
    for cls in (BinaryCrossEntropyLoss, FocalLoss, AsymmetricLoss):
        mean = cls(reduction="mean")(x, y)
        torch.testing.assert_close(cls(reduction="sum")(x, y), 30 * mean, **TOL)
        torch.testing.assert_close(cls(reduction="sum_per_sample")(x, y), 5 * mean, **TOL)
    with pytest.raises(
        ValueError, match="reduction must be one of 'mean', 'sum', 'sum_per_sample'; got 'avg'"
    ):
        FocalLoss(reduction="avg")


@pytest.mark.parametrize("name", NAMES)
def test_no_grad_leaves_grad_mode_off(name):
    """A loss called under torch.no_grad() must not switch gradients on (the public ASL copies do)."""
    x, y = random_batch()
    x.requires_grad_(True)
    loss = make_loss(name)
    with torch.no_grad():
        value = loss(x, y)
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    assert not value.requires_grad


# ---------------------------------------------------------------------------------------------------------
# edge cases


@pytest.mark.parametrize("case", sorted(EDGES))
def test_edge_cases_match_references(case):
    x, y, bucket_size = EDGES[case]
    for ways in ("both", "sample", "class"):
        loss = TwoWayLoss(ways=ways, bucket_size=bucket_size, margin=0.5)
        assert_matches(loss, lambda a, b, w=ways: ref_twoway(a, b, 4.0, 1.0, w, bucket_size, 0.5), x, y)
    assert_matches(
        CLASSES["joint"](bucket_size=bucket_size),
        lambda a, b: ref_joint(a, b, bucket_size=bucket_size),
        x,
        y,
    )
    assert_matches(
        CLASSES["softmax"](ways="both", bucket_size=bucket_size),
        lambda a, b: ref_softmax_family(a, b, "softmax", "both", bucket_size),
        x,
        y,
    )
    assert_matches(CLASSES["multisim"](), ref_multisim, x, y)
    assert_matches(CLASSES["bce"](), ref_bce, x, y)
    for name in ("taylor_softmax", "spherical_softmax"):
        assert_matches(
            CLASSES[name](ways="both", bucket_size=bucket_size),
            lambda a, b, n=name: ref_softmax_family(a, b, n, "both", bucket_size),
            x,
            y,
        )


def test_edge_case_values():
    """The conventions of the issue, in numbers: empty sets give exactly 0 and still count in the means."""
    x, y, _ = EDGES["all_positive"]
    assert TwoWayLoss(bucket_size=4)(x, y).item() == 0.0  # positives, no negatives: softplus(-inf) = 0
    assert CLASSES["joint"]()(x, y).item() == 0.0
    x, y, _ = EDGES["no_positive"]
    assert TwoWayLoss()(x, y).item() == 0.0  # no line has a positive
    assert CLASSES["softmax"]()(x, y).item() == 0.0
    assert CLASSES["bce"]()(*EDGES["all_unknown"][:2]).item() == 0.0
    # a bucket without positives counts among the buckets: half of the loss of the other bucket
    x, y, _ = EDGES["bucket_without_positive"]
    torch.testing.assert_close(TwoWayLoss(bucket_size=4)(x, y), TwoWayLoss()(x[4:], y[4:]) / 2, **TOL)
    # a row with positives and no negative counts in the sample-wise mean with a 0
    x, y = random_batch(rows=3, seed=14, p_unknown=0.0)
    y[0] = 1.0
    y[1:, 0] = 1.0
    sample = TwoWayLoss(ways="sample")
    torch.testing.assert_close(sample(x, y), sample(x[1:], y[1:]) * 2 / 3, **TOL)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", sorted(EDGES))
def test_finite_value_and_gradient(name, case):
    x, y, bucket_size = EDGES[case]
    kwargs = (
        {"bucket_size": bucket_size} if "bucket_size" in inspect.signature(CLASSES[name]).parameters else {}
    )
    for dtype in (F64, torch.float32):
        value, grad = value_and_grad(lambda a: make_loss(name, **kwargs)(a, y), x.to(dtype))
        assert torch.isfinite(value) and torch.isfinite(grad).all(), (name, case, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_under_autocast(name):
    x, y = random_batch(rows=8, classes=6, seed=15)
    x[0, 0], x[1, 1] = 1e4, -1e4
    loss = make_loss(name)
    leaf = x.to(torch.bfloat16).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = loss(leaf, y)
    value.backward()
    assert value.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    assert torch.isfinite(value) and torch.isfinite(leaf.grad).all()
    # computed in float32: the same number as on the float32 copy of the bf16 logits outside autocast
    torch.testing.assert_close(value, loss(leaf.detach().float(), y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_entries_are_excluded(name):
    """Logits at unknown labels change nothing and get a zero gradient, however large (a -100 mask leaks)."""
    x, y = random_batch(seed=16, p_unknown=0.3)
    unknown = y == -1
    loss = make_loss(name)
    value, grad = value_and_grad(lambda a: loss(a, y), x)
    for fill in (1e4, -1e4, 150.0):
        moved = torch.where(unknown, fill, x)
        moved_value, moved_grad = value_and_grad(lambda a: loss(a, y), moved)
        torch.testing.assert_close(moved_value, value, **TOL)
        assert (moved_grad[unknown] == 0).all()
        torch.testing.assert_close(moved_grad, grad, **TOL)


def test_twoway_sets_far_apart_in_float32():
    """Each entry's exponential is shifted by its own set's line maximum, in one pass for both sets: rows
    1e4 apart (so columns mix logits 2e4 apart) and, within a line, negatives' maxima far below or above
    the positives' (x / T_N against -x / T_P). float32 matches the float64 reference on the same (rounded)
    logits to the precision of float32 arithmetic on logits of 1e4; float64 matches at 1e-10."""
    x, y = random_batch(rows=8, classes=6, seed=31, p_pos=0.35, p_unknown=0.15)
    x = (x + torch.tensor([0.0, 1e4, -1e4, 5e3, 0.0, -1e4, 1e4, 3e3], dtype=F64)[:, None]).float().to(F64)
    for ways in ("both", "sample", "class"):
        for tp, tn, bucket_size, margin in ((4.0, 1.0, 4, 0.5), (0.5, 2.0, None, 0.0)):
            loss = TwoWayLoss(tp=tp, tn=tn, ways=ways, bucket_size=bucket_size, margin=margin)

            def reference(a, b, tp=tp, tn=tn, ways=ways, bucket_size=bucket_size, margin=margin):
                return ref_twoway(a, b, tp, tn, ways, bucket_size, margin)

            assert_matches(loss, reference, x, y)
            value, grad = value_and_grad(lambda a, f=loss: f(a, y.float()), x.float())
            ref_value, ref_grad = value_and_grad(lambda a, r=reference: r(a, y), x)
            torch.testing.assert_close(value, ref_value.float(), rtol=1e-3, atol=1e-6)
            torch.testing.assert_close(grad, ref_grad.float(), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("name", ["twoway", "joint"])
def test_unknown_entries_holding_inf_or_nan_change_nothing(name):
    """An unknown entry enters no sum whatever its logit, even +-inf or NaN: value and gradient are
    bit-identical to those with a finite logit there, and its gradient is 0."""
    x, y = random_batch(seed=32, p_unknown=0.3)
    unknown = y == -1
    loss = CLASSES[name](bucket_size=4)
    for dtype in (F64, torch.float32):
        value, grad = value_and_grad(lambda a: loss(a, y), x.to(dtype))
        for fill in (float("inf"), float("-inf"), float("nan")):
            moved_value, moved_grad = value_and_grad(
                lambda a: loss(a, y), torch.where(unknown, fill, x).to(dtype)
            )
            assert torch.equal(moved_value, value) and torch.equal(moved_grad, grad), (fill, dtype)
            assert (moved_grad[unknown] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# invariances and special cases from the paper


@pytest.mark.parametrize(
    "loss",
    [
        TwoWayLoss(ways="both"),
        TwoWayLoss(ways="sample", tp=2.0, tn=0.5),
        TwoWayLoss(ways="class", bucket_size=4),
    ]
    + [CLASSES["joint"](bucket_size=2), CLASSES["softmax"](ways="both")],
    ids=["twoway", "twoway-sample", "twoway-class", "joint", "softmax"],
)
def test_shift_invariance(loss):
    """Sec. 3.1: loss(X + eps) = loss(X) for relative-comparison losses."""
    x, y = random_batch(seed=17)
    for shift in (1000.0, -37.5):
        torch.testing.assert_close(loss(x + shift, y), loss(x, y), **TOL)
    assert not torch.isclose(CLASSES["bce"]()(x + 1.0, y), CLASSES["bce"]()(x, y))  # BCE is not


@pytest.mark.parametrize("tp", [1.0, 4.0])
def test_one_hot_sample_wise_twoway_is_softmax_cross_entropy(tp):
    x, _ = random_batch(seed=18)
    target = torch.arange(8) % 5
    y = F.one_hot(target, 5).to(F64)
    expected = F.cross_entropy(x, target)
    torch.testing.assert_close(TwoWayLoss(tp=tp, ways="sample")(x, y), expected, **TOL)
    torch.testing.assert_close(CLASSES["softmax"]()(x, y), expected, **TOL)


@pytest.mark.parametrize("name", ["twoway", "joint", "softmax", "taylor_softmax", "spherical_softmax"])
def test_bucket_size_is_mean_over_chunks(name):
    x, y = random_batch(rows=12, seed=19)
    kwargs = {"ways": "both"} if name != "joint" else {}
    chunked = CLASSES[name](bucket_size=4, **kwargs)
    whole = CLASSES[name](**kwargs)
    expected_value, expected_grad = value_and_grad(
        lambda a: sum(whole(a[k : k + 4], y[k : k + 4]) for k in range(0, 12, 4)) / 3, x
    )
    value, grad = value_and_grad(lambda a: chunked(a, y), x)
    torch.testing.assert_close(value, expected_value, **TOL)
    torch.testing.assert_close(grad, expected_grad, **TOL)
    with pytest.raises(ValueError, match="bucket_size=5 must divide the batch size 12"):
        CLASSES[name](bucket_size=5)(x, y)


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck(name):
    x, y = random_batch(rows=4, classes=4, seed=20, p_pos=0.4, p_unknown=0.2)
    loss = make_loss(name)
    assert torch.autograd.gradcheck(lambda a: loss(a, y), (x.clone().requires_grad_(True),))


def test_gradcheck_buckets_and_margin():
    x, y = random_batch(rows=6, classes=4, seed=21)
    for loss in (TwoWayLoss(bucket_size=3, margin=1.0, tp=2.0, tn=0.5), CLASSES["joint"](bucket_size=2)):
        assert torch.autograd.gradcheck(lambda a, f=loss: f(a, y), (x.clone().requires_grad_(True),))


# ---------------------------------------------------------------------------------------------------------
# a training step on a device

# The settings of each loss the step test uses: buckets, class weights, every reduction of the paper presets.
STEP_SETTINGS = {
    "twoway": {"bucket_size": 4},
    "joint": {"bucket_size": 4},
    "softmax": {"ways": "both", "bucket_size": 4},
    "taylor_softmax": {"ways": "both", "bucket_size": 4},
    "spherical_softmax": {"ways": "both", "bucket_size": 4},
    "bce": {"pos_weight": "freq", "reduction": "sum_per_sample"},
    "focal": {"alpha": 0.25, "reduction": "mean"},
    "asl": {"detach_weight": True, "reduction": "sum"},
}


@pytest.mark.parametrize("name", NAMES)
def test_training_step_reads_nothing_back_from_the_device(name, host_reads):
    """Forward + backward of every loss, built and moved as the trainer does (``.to(device)``, then
    ``setup``), on the meta device: a stand-in for a GPU that holds no data, so that neither the loss nor
    its backward may call ``.item()``, ``bool()``, ``int()``, ``.tolist()`` or ``nonzero`` on a tensor, nor
    copy a value from the host (``torch.tensor``, ``new_tensor``: a synchronising copy on a GPU)."""
    train_labels = random_batch(rows=40, seed=9)[1]
    x, y = random_batch(seed=25)
    loss = CLASSES[name](**STEP_SETTINGS.get(name, {})).to("meta")
    if hasattr(loss, "setup"):
        loss.setup(train_labels)
    logits = x.float().to("meta").requires_grad_(True)
    loss(logits, y.float().to("meta")).backward()
    assert host_reads == []
    assert logits.grad is not None and logits.grad.shape == x.shape


def test_bce_class_weight_is_a_buffer_that_moves_with_the_module(monkeypatch):
    """``criterion.to(device)`` before ``setup`` places the weights there; a step then converts nothing."""
    train = torch.tensor([[1, 0, 0, -1, 1], [1, 1, 0, 0, 0], [0, -1, 0, 0, 0], [1, 0, 0, 0, -1]], dtype=F64)
    expected_weight = torch.tensor([1 / 3, 2 / 1, 1.0, 1.0, 2 / 1], dtype=F64)
    loss = BinaryCrossEntropyLoss(pos_weight="freq").to(F64)
    loss.setup(train)
    assert dict(loss.named_buffers())["class_weight"] is loss.class_weight
    torch.testing.assert_close(loss.class_weight, expected_weight, rtol=0, atol=0)  # float64, not float32
    on_meta = BinaryCrossEntropyLoss(pos_weight="freq").to("meta")
    on_meta.setup(train)
    assert on_meta.class_weight.device.type == "meta"
    converted = []
    original_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        result = original_to(self, *args, **kwargs)
        if self is loss.class_weight and result is not self:
            converted.append(result)
        return result

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    x, y = random_batch(seed=26)
    assert_matches(loss, lambda a, b: ref_bce(a, b, expected_weight), x, y)
    assert converted == []
    assert "class_weight" not in loss.state_dict()  # recomputed by setup, not restored from checkpoints


# ---------------------------------------------------------------------------------------------------------
# errors, registry, configs


def test_clear_errors():
    x, y = random_batch()
    with pytest.raises(ValueError, match="ways must be one of"):
        TwoWayLoss(ways="row")
    with pytest.raises(ValueError, match="tp must be > 0"):
        TwoWayLoss(tp=0.0)
    with pytest.raises(ValueError, match="tn must be > 0"):
        CLASSES["joint"](tn=-1.0)
    with pytest.raises(ValueError, match="tp must be > 0"):
        CLASSES["multisim"](tp=0)
    with pytest.raises(ValueError, match="bucket_size must be a positive integer"):
        TwoWayLoss(bucket_size=0)
    with pytest.raises(ValueError, match="pos_weight must be one of"):
        CLASSES["bce"](pos_weight="balanced")
    for name in NAMES:
        loss = make_loss(name)
        with pytest.raises(ValueError, match="must both be \\(B, C\\)"):
            loss(x, y[:, :3])
        with pytest.raises(ValueError, match="targets must hold only 1"):
            loss(x, y * 0.5)
    with pytest.raises(ValueError, match="gather=True needs torch.distributed initialised"):
        TwoWayLoss(gather=True)(x, y)


def test_a_loss_repr_names_every_constructor_argument():
    """Old: role hid init_seed and max_table_entries, ll its max_table_entries, em without APL its beta,
    warmup_epochs, neg_proportion and epochs."""
    import mlcls.losses

    for name in mlcls.losses.__all__:
        cls = getattr(mlcls.losses, name)
        arguments = inspect.signature(cls).parameters
        text = repr(cls(expected_positives=2.0) if "expected_positives" in arguments else cls())
        assert all(f"{argument}=" in text for argument in arguments), (name, text)
    role = mlcls.losses.RoleLoss(expected_positives=2.0, init_seed=3, max_table_entries=7)
    assert "init_seed=3, max_table_entries=7" in repr(role)


def test_every_loss_is_exported_with_its_name_and_config():
    import mlcls.losses

    exported = {getattr(mlcls.losses, name) for name in mlcls.losses.__all__}
    assert {cls for cls in exported if cls.name not in UNKNOWN_LABEL_NAMES} == set(CLASSES.values())
    assert {cls.name for cls in exported} == set(NAMES) | set(UNKNOWN_LABEL_NAMES)
    assert {path.stem for path in (config_dir() / "loss").glob("*.yaml")} == set(NAMES) | set(
        UNKNOWN_LABEL_NAMES
    )
    for name, cls in CLASSES.items():
        assert cls.name == name
        assert "Reduction:" in cls.__doc__ and "=" in cls.__doc__, (
            f"{cls.__name__}: state equation and reduction"
        )


@pytest.mark.parametrize("name", NAMES)
def test_config_lists_every_argument_with_its_default(name):
    cfg = OmegaConf.load(config_dir() / "loss" / f"{name}.yaml")
    assert cfg._target_ == f"mlcls.losses.{CLASSES[name].__name__}" and "name" not in cfg
    assert loss_name(cfg) == name
    params = inspect.signature(CLASSES[name]).parameters
    arguments = {key: value for key, value in cfg.items() if key != "_target_"}
    assert arguments == {key: p.default for key, p in params.items()}
    assert type(instantiate(cfg)) is CLASSES[name]


def test_loss_name_of_old_and_broken_configs():
    assert loss_name({"_target_": "mlcls.losses.factory", "name": "bce"}) == "bce"  # an older version
    assert loss_name({"_target_": "mlcls.losses.TwoWayLos"}) == "TwoWayLos"  # misspelt class
    assert loss_name({"_target_": "no_such_package.MyLoss"}) == "MyLoss"
    assert loss_name({"_target_": "torch.nn.BCEWithLogitsLoss"}) == "BCEWithLogitsLoss"  # no name attribute
    with pytest.raises(ValueError, match="a loss config needs _target_"):
        loss_name({"tp": 4.0})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss=twoway", "loss.tp=0"], "loss=twoway: tp must be > 0, got 0"),
        (["loss=asl", "loss.reduction=avg"], "loss=asl: reduction must be one of"),
        (
            ["loss=bce", "loss._target_=mlcls.losses.BCELoss"],
            "loss=BCELoss: Error loading 'mlcls.losses.BCELoss'",
        ),
    ],
)
def test_config_validation_names_the_loss(overrides, message):
    from conftest import compose_config

    from mlcls.engine.config_checks import check_config
    from mlcls.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as error:
        check_config(compose_config(["trainer.device=cpu", "trainer.amp=none", *overrides]), world_size=1)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_benchmark_baseline_is_eq_17_and_prints_one_json_line(capsys, monkeypatch):
    x, y = random_batch(rows=8, seed=22, p_unknown=0.0)
    expected = TwoWayLoss(bucket_size=4)(x, y)
    torch.testing.assert_close(loss_bench.masked_logsumexp_twoway(x, y, bucket_size=4), expected.float())
    monkeypatch.setattr(loss_bench, "SIZES", (("256x80", 80, 2.9),))
    monkeypatch.setattr(loss_bench, "BATCH_SIZE", 256)
    bench_main(["loss", "--repeats", "1"])
    line = capsys.readouterr().out.strip()
    result = json.loads(line)
    timings = {"twoway_256x80_ms", "masked_lse_256x80_ms"}
    rates = {"twoway_256x80_per_s", "masked_lse_256x80_per_s"}
    assert "\n" not in line and set(result) == {*timings, *rates, "ratio"}
    assert all(math.isfinite(v) and v > 0 for v in result.values())


def test_loss_name_imports_only_mlcls_losses(tmp_path, monkeypatch):
    """A run directory from someone else names its loss's ``_target_``: a module beside it is never
    imported (old: ``importlib.import_module`` of any target ran the planted module)."""
    marker = tmp_path / "ran"
    (tmp_path / "planted_loss.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nclass L:\n    name = 'x'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert loss_name({"_target_": "planted_loss.L"}) == "L"
    assert loss_name({"_target_": "os.system"}) == "system"
    assert not marker.exists()
    assert loss_name({"_target_": "mlcls.losses.TwoWayLoss"}) == "twoway"
