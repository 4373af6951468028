"""Parity of the losses for unknown labels with their authors' released code.

Each reference below computes a loss the way the authors' released code does (read at the commit its
docstring names, and written here afresh in float64 on that code's own label convention); each test
compares mlcls's loss with it on random logits whose labels hold positives, observed negatives and
unknown labels, and on single-positive labels (one positive per row, the rest unknown).

Label conventions. The single-positive code of Cole et al., Zhou et al. and Kim et al. writes
1 = observed positive, 0 = unobserved, -1 = observed negative (:func:`to_spml`); Zhang et al.'s code writes
1 = positive and 0 = anything else (:func:`to_positive_only`). Cole et al.'s and Zhou et al.'s
single-positive losses assert that no observed negative is present: for one, the references take the
term of the same repository's partial-label loss ``loss_iu``, ``-log(1 - p)`` (``an_ls``: the negative
term of ``loss_bce_ls``). Zhang et al.'s code cannot tell an observed negative from a missing label, so
SPLC would correct both; mlcls corrects only unknown labels (an observed negative is not missing), and the
reference takes the uncorrected term for an observed negative.

Clamps. Cole et al.'s and Zhou et al.'s code takes ``-log(q + 1e-5)`` of a probability q where mlcls
takes an exact log-sigmoid. Their references take ``eps`` as an argument. With ``eps = 0`` they must
equal mlcls to float64 precision, value and gradient: this checks the label mapping, the weights, the
regulariser and the reduction. With the released ``eps = 1e-5`` the difference is measured on logits in
(-5, 5) and checked against two analytic bounds (:func:`clamp_terms`). A term ``w (-log(q + eps))``
differs from ``w (-log q)`` by ``-w log(1 + eps / q)``, whose first-order part is ``eps`` times the term's
derivative in eps at 0 and whose remainder is at most ``|w| (eps / q)^2 / 2`` (as
``u - u^2 / 2 <= log(1 + u) <= u``). Summed over the entries: the difference is at most
``bound = eps * sum_ic |d loss / d eps_ic|`` (all terms of one entry move the same way), and it equals
``eps * sum_ic d loss / d eps_ic`` up to ``eps / (2 q_min) * bound``, with q_min the smallest probability
the logits give. Kim et al.'s and Zhang et al.'s code works on logits without a clamp: those losses are
compared to float64 precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mlcls.losses import (
    AssumeNegativeLoss,
    EntropyMaximisationLoss,
    ExpectedPositiveLoss,
    HillLoss,
    LabelSmoothedAssumeNegativeLoss,
    LargeLossLoss,
    SPLCLoss,
    WeakAssumeNegativeLoss,
)

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
RELEASED_EPS = 1e-5  # LOG_EPSILON of Cole et al.'s and Zhou et al.'s losses.py
REGIMES = ("partial", "single_positive")
SEEDS = range(5)

Reference = Callable[[Tensor, Tensor, Tensor], Tensor]


def random_batch(regime: str, seed: int, rows: int = 16, classes: int = 20) -> tuple[Tensor, Tensor]:
    """float64 logits uniform in (-5, 5) and mlcls labels (1 / 0 / -1).

    ``"partial"``: about 25 % positives, 20 % observed negatives, 55 % unknown, all three present;
    ``"single_positive"``: one positive per row, every other label unknown.
    """
    generator = torch.Generator().manual_seed(seed)
    logits = 10.0 * torch.rand(rows, classes, generator=generator, dtype=F64) - 5.0
    if regime == "partial":
        draw = torch.rand(rows, classes, generator=generator, dtype=F64)
        targets = torch.where(draw < 0.25, 1.0, torch.where(draw < 0.45, 0.0, -1.0)).to(F64)
        assert (targets == 1).any() and (targets == 0).any() and (targets == -1).any()
    else:
        positive = torch.randint(classes, (rows,), generator=generator)
        targets = torch.full((rows, classes), -1.0, dtype=F64)
        targets[torch.arange(rows), positive] = 1.0
    return logits, targets


def to_spml(targets: Tensor) -> Tensor:
    """mlcls labels -> the single-positive code's: 1 observed positive, 0 unobserved, -1 observed negative."""
    return torch.where(targets == 1, 1.0, torch.where(targets == 0, -1.0, 0.0)).to(targets.dtype)


def to_positive_only(targets: Tensor) -> Tensor:
    """mlcls labels -> Zhang et al.'s: 1 positive, 0 anything else."""
    return (targets == 1).to(targets.dtype)


def neg_log(q: Tensor, eps: Tensor) -> Tensor:
    """The released code's clamped ``-log(q + eps)`` of a probability q."""
    return -torch.log(q + eps)


def value_and_grad(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    leaf = x.detach().clone().requires_grad_(True)
    value = fn(leaf)
    (grad,) = torch.autograd.grad(value, leaf)
    return value.detach(), grad


def assert_parity(loss: Callable, reference: Callable, logits: Tensor, targets: Tensor) -> Tensor:
    """``loss(logits, targets)`` equals ``reference(logits, targets)`` to float64 precision, value and
    gradient in the logits; returns the reference's value."""
    value, grad = value_and_grad(lambda x: loss(x, targets), logits)
    ref_value, ref_grad = value_and_grad(lambda x: reference(x, targets), logits)
    torch.testing.assert_close(value, ref_value, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    return ref_value


# ---------------------------------------------------------------------------------------------------------
# Cole et al. (CVPR 2021) and Zhou et al. (ECCV 2022): probabilities, -log(q + eps), sum / (B C)


def spml_reference(
    positive: Callable[[Tensor, Tensor], Tensor],
    unobserved: Callable[[Tensor, Tensor, int], Tensor],
    negative: Callable[[Tensor, Tensor], Tensor],
    regulariser: Callable[[Tensor], Tensor] | None = None,
) -> Reference:
    """A loss of the single-positive code: per-entry terms on ``p = sigmoid(x)`` by the entry's label (1,
    0 = unobserved, -1 = observed negative), summed and divided by B C (``compute_batch_loss``), plus a
    regulariser added once. Takes mlcls labels and maps them with :func:`to_spml`."""

    def reference(logits: Tensor, targets: Tensor, eps: Tensor) -> Tensor:
        labels = to_spml(targets)
        p = torch.sigmoid(logits)
        rows, classes = p.shape
        matrix = torch.where(
            labels == 1,
            positive(p, eps),
            torch.where(labels == 0, unobserved(p, eps, classes), negative(p, eps)),
        )
        loss = (matrix / (rows * classes)).sum()
        return loss if regulariser is None else loss + regulariser(p)

    return reference


def bce_positive(p: Tensor, eps: Tensor) -> Tensor:
    return neg_log(p, eps)


def bce_negative(p: Tensor, eps: Tensor) -> Tensor:
    """``loss_iu``'s term for an observed negative (and ``loss_an``'s for an unobserved label)."""
    return neg_log(1.0 - p, eps)


def smoothed(eps_ls: float, toward_positive: bool) -> Callable[[Tensor, Tensor], Tensor]:
    """``loss_an_ls`` / ``loss_bce_ls``: ``(1 - e) neg_log(own side) + e neg_log(other side)``."""

    def term(p: Tensor, eps: Tensor) -> Tensor:
        own, other = (p, 1.0 - p) if toward_positive else (1.0 - p, p)
        return (1.0 - eps_ls) * neg_log(own, eps) + eps_ls * neg_log(other, eps)

    return term


def cole_an() -> Reference:
    """Cole et al., elijahcole/single-positive-multi-label, losses.py ``loss_an`` (observed negatives:
    ``loss_iu``), ``compute_batch_loss``, commit 0ea84b0587ef802edec04b02926e12bd9461ccfd."""
    return spml_reference(bce_positive, lambda p, eps, _: bce_negative(p, eps), bce_negative)


def cole_an_ls(ls_coef: float) -> Reference:
    """Cole et al., losses.py ``loss_an_ls`` (observed negatives: ``loss_bce_ls``'s negative term),
    commit 0ea84b0587ef802edec04b02926e12bd9461ccfd."""
    negative = smoothed(ls_coef, toward_positive=False)
    return spml_reference(
        smoothed(ls_coef, toward_positive=True), lambda p, eps, _: negative(p, eps), negative
    )


def cole_wan() -> Reference:
    """Cole et al., losses.py ``loss_wan`` (observed negatives: ``loss_iu``, weight 1),
    commit 0ea84b0587ef802edec04b02926e12bd9461ccfd."""
    return spml_reference(
        bce_positive, lambda p, eps, classes: bce_negative(p, eps) / float(classes - 1), bce_negative
    )


def cole_epr(k: float) -> Reference:
    """Cole et al., losses.py ``loss_epr`` with ``expected_positive_regularizer(norm='2') / C^2``
    (observed negatives: ``loss_iu``), commit 0ea84b0587ef802edec04b02926e12bd9461ccfd."""

    def regulariser(p: Tensor) -> Tensor:
        return (p.sum(1).mean(0) - k) ** 2 / (p.shape[1] ** 2)

    return spml_reference(bce_positive, lambda p, eps, _: torch.zeros_like(p), bce_negative, regulariser)


def zhou_em(alpha: float) -> Reference:
    """Zhou et al., Correr-Zhou/SPML-AckTheUnknown, losses.py ``loss_EM``, ``compute_batch_loss``
    (observed negatives: Cole et al.'s ``loss_iu``), commit c09c11499349ba81ca7194478189910915d01844."""

    def unobserved(p: Tensor, eps: Tensor, _: int) -> Tensor:
        return -alpha * (p * neg_log(p, eps) + (1.0 - p) * neg_log(1.0 - p, eps))

    return spml_reference(bce_positive, unobserved, bce_negative)


SPML_CASES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], Reference]]] = {
    "an": (AssumeNegativeLoss, cole_an),
    "an_ls": (lambda: LabelSmoothedAssumeNegativeLoss(ls_coef=0.1), lambda: cole_an_ls(0.1)),
    "wan": (WeakAssumeNegativeLoss, cole_wan),
    "epr_coco": (lambda: ExpectedPositiveLoss(expected_positives=2.9), lambda: cole_epr(2.9)),
    "epr_cub": (lambda: ExpectedPositiveLoss(expected_positives=31.4), lambda: cole_epr(31.4)),
    "em_voc": (lambda: EntropyMaximisationLoss(alpha=0.2), lambda: zhou_em(0.2)),
    "em_coco": (lambda: EntropyMaximisationLoss(alpha=0.1), lambda: zhou_em(0.1)),
}


def clamp_terms(reference: Reference, logits: Tensor, targets: Tensor, eps: float) -> tuple[float, float]:
    """``(eps * sum_ic d reference / d eps_ic, eps * sum_ic |d reference / d eps_ic|)`` at ``eps = 0``: the
    first-order effect of the released clamp ``-log(q + eps)`` on the loss, and the most it can move the
    loss from the exact ``-log q`` (see the module docstring). Autograd on a per-entry ``eps``."""
    per_entry = torch.zeros_like(logits, requires_grad=True)
    (grad,) = torch.autograd.grad(reference(logits, targets, per_entry), per_entry)
    return eps * grad.sum().item(), eps * grad.abs().sum().item()


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("name", sorted(SPML_CASES))
def test_single_positive_losses_equal_the_released_code_without_its_clamp(name, regime):
    """Cole et al.'s an, an_ls, wan, epr and Zhou et al.'s em, their clamp set to 0: equal to float64
    precision, value and gradient (see each reference's docstring for repository, function, commit)."""
    make_loss, make_reference = SPML_CASES[name]
    loss, reference = make_loss(), make_reference()
    no_clamp = torch.zeros((), dtype=F64)
    for seed in SEEDS:
        assert_parity(loss, partial(reference, eps=no_clamp), *random_batch(regime, seed))


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("name", sorted(SPML_CASES))
def test_single_positive_losses_stay_within_the_released_clamp_bound(name, regime):
    """With the released ``-log(q + 1e-5)``, mlcls's exact log-sigmoid differs from the released code by
    no more than the clamp's analytic bound, on logits in (-5, 5), and by its first-order effect up to
    the second-order remainder: the released code is mlcls's function plus exactly its clamp."""
    make_loss, make_reference = SPML_CASES[name]
    loss, reference = make_loss(), make_reference()
    released = torch.tensor(RELEASED_EPS, dtype=F64)
    for seed in SEEDS:
        logits, targets = random_batch(regime, seed)
        difference = (reference(logits, targets, released) - loss(logits, targets)).item()
        first_order, bound = clamp_terms(reference, logits, targets, RELEASED_EPS)
        q_min = torch.sigmoid(-logits.abs().max()).item()
        assert abs(difference) <= bound, (seed, difference, bound)
        assert abs(difference - first_order) <= RELEASED_EPS / (2 * q_min) * bound, (seed, difference)


# ---------------------------------------------------------------------------------------------------------
# Kim et al. (CVPR 2022): logits, BCE with logits, the batch's largest unobserved losses


def kim_k(rows: int, classes: int, delta_rel: float, epoch: int) -> int:
    """The released code's k in 1-based epoch ``epoch``: ``llr_rel`` starts at 1 and loses ``delta_rel``
    after each epoch (train.py ``run_train``); ``k = ceil(B C (1 - llr_rel))`` (losses.py)."""
    llr_rel = 1.0
    for _ in range(epoch - 1):
        llr_rel -= delta_rel
    return math.ceil(rows * classes * (1 - llr_rel))


def exact_k(rows: int, classes: int, delta_rel: float, epoch: int) -> int:
    """k in exact decimal arithmetic: ``ceil(B C (epoch - 1) delta_rel)``, 1-based epoch."""
    return math.ceil(rows * classes * (epoch - 1) * Fraction(str(delta_rel)))


def kim_ll(logits: Tensor, targets: Tensor, mode: str, k: int) -> Tensor:
    """Kim et al., snucml/LargeLossMatters, losses.py ``compute_batch_loss`` and ``loss_an`` (LL-R:
    ``llr_rel_mod = 0``, LL-Ct: ``llr_rel_mod = 1``, ``perm_mod = 0``), commit
    ac475fec0ba2dcc8b7a691873b18cb57f11f7052, with k given (:func:`kim_k`).

    On the released labels (1 / 0 unobserved / -1): the BCE-with-logits matrix against ``label.clip(0)``
    and against its logical not; the unobserved entries' losses (observed entries 0); the k-th largest of
    all B C of them is the threshold; an entry not below it is rejected (0) or takes the flipped BCE.
    """
    labels = to_spml(targets)
    rows, classes = logits.shape
    clipped = labels.clip(0)
    loss = F.binary_cross_entropy_with_logits(logits, clipped, reduction="none")
    flipped = F.binary_cross_entropy_with_logits(logits, torch.logical_not(clipped).to(F64), reduction="none")
    if k == 0:
        final = loss
    else:
        unobserved_loss = (labels == 0) * loss
        threshold = torch.topk(unobserved_loss.flatten(), k).values[-1]
        kept = unobserved_loss < threshold
        final = torch.where(kept, loss, flipped if mode == "ct" else torch.zeros_like(loss))
    return (final / (rows * classes)).sum()


# (delta_rel as a fraction, 1-based epoch): k from 0 up to 39 % of the 320 entries
LL_SCHEDULES = [(0.002, 1), (0.002, 2), (0.002, 6), (0.01, 3), (0.03, 4), (0.1, 2), (0.13, 4)]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("mode", ["r", "ct"])
@pytest.mark.parametrize(("delta_rel", "epoch"), LL_SCHEDULES)
def test_ll_equals_the_released_code(mode, delta_rel, epoch, regime):
    """LL-R and LL-Ct against Kim et al.'s ``compute_batch_loss`` (see :func:`kim_ll`): float64
    precision, value and gradient. mlcls's 0-based epoch is the released 1-based epoch minus 1."""
    loss = LargeLossLoss(mode=mode, delta_rel=delta_rel)
    loss.set_epoch(epoch - 1)
    for seed in SEEDS:
        logits, targets = random_batch(regime, seed)
        rows, classes = logits.shape
        k = kim_k(rows, classes, delta_rel, epoch)
        # the schedules are chosen where the released float k is the exact one, and k stays below the
        # number of unknown labels (above it the released code would also touch observed labels)
        assert k == exact_k(rows, classes, delta_rel, epoch) <= int((targets == -1).sum())
        assert_parity(loss, partial(kim_ll, mode=mode, k=k), logits, targets)


def test_ll_takes_the_exact_k_where_the_released_float_schedule_rounds_up():
    """Where B C R is an integer, the released schedule's repeated float subtraction can give k one too
    many (1 - 0.95 = 0.05000000000000004: 320 entries at 5 % give k = 17, not 16). mlcls takes the exact
    k, by design; with that k the released computation is matched."""
    logits, targets = random_batch("partial", seed=0)
    rows, classes = logits.shape
    assert (kim_k(rows, classes, 0.05, 2), exact_k(rows, classes, 0.05, 2)) == (17, 16)
    loss = LargeLossLoss(mode="r", delta_rel=0.05)
    loss.set_epoch(1)
    torch.testing.assert_close(loss(logits, targets), kim_ll(logits, targets, "r", 16), **TOL)
    assert not torch.isclose(loss(logits, targets), kim_ll(logits, targets, "r", 17), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Zhang et al. (2021): Hill and SPLC, logits, sum reduction


def zhang_hill(logits: Tensor, targets: Tensor, lamb: float, margin: float, gamma: float) -> Tensor:
    """Zhang et al., xinyu1205/robust-loss-mlml, src/loss_functions/losses.py ``Hill.forward``
    (reduction 'sum'), commit e8d4effec5f3a81cc330158fa421daee8b32b066, on labels 1 / 0.

    ``-(t log sigmoid(x - m) - (1 - t)(lamb - p) p^2)`` times the weight ``((1 - p_m) t + (1 - t))^gamma``.
    """
    t = to_positive_only(targets)
    p_margin, p = torch.sigmoid(logits - margin), torch.sigmoid(logits)
    weight = ((1.0 - p_margin) * t + (1.0 - t)) ** gamma
    positive_part = t * torch.log(p_margin)
    negative_part = (1.0 - t) * -(lamb - p) * p**2
    return (-(positive_part + negative_part) * weight).sum()


def zhang_splc_matrix(
    logits: Tensor, targets: Tensor, epoch: int, tau: float, change_epoch: int, margin: float, gamma: float
) -> Tensor:
    """Zhang et al., src/loss_functions/losses.py ``SPLC.forward`` before its reduction, commit
    e8d4effec5f3a81cc330158fa421daee8b32b066, on labels 1 / 0: the margin moves the positive logits; from
    ``change_epoch`` on, a label-0 entry whose (unmoved) sigmoid exceeds tau becomes 1; focal BCE with
    the weight ``((1 - p) t + p (1 - t))^gamma`` on the moved logits."""
    t = to_positive_only(targets)
    x = torch.where(t == 1, logits - margin, logits)
    if epoch >= change_epoch:
        t = torch.where(torch.sigmoid(x) > tau, torch.ones_like(t), t)
    p = torch.sigmoid(x)
    weight = ((1.0 - p) * t + p * (1.0 - t)) ** gamma
    return -(t * F.logsigmoid(x) + (1.0 - t) * F.logsigmoid(-x)) * weight


def zhang_splc_mlcls_labels(
    logits: Tensor, targets: Tensor, epoch: int, tau: float, change_epoch: int
) -> Tensor:
    """:func:`zhang_splc_matrix` summed (reduction 'sum'), margin 1 and gamma 2, with an observed negative
    (mlcls 0) given its uncorrected term: the released labels cannot mark it, and it is not missing."""
    released = zhang_splc_matrix(logits, targets, epoch, tau, change_epoch, 1.0, 2.0)
    uncorrected = zhang_splc_matrix(logits, targets, -1, tau, change_epoch, 1.0, 2.0)
    return torch.where(targets == 0, uncorrected, released).sum()


HILL_SETTINGS = [(1.5, 1.0, 2.0), (1.5, 0.5, 2.0), (2.0, 1.0, 1.0)]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize(("lamb", "margin", "gamma"), HILL_SETTINGS)
def test_hill_equals_the_released_code(lamb, margin, gamma, regime):
    """Hill against Zhang et al.'s ``Hill.forward`` (see :func:`zhang_hill`): float64 precision, value
    and gradient; mlcls's ``sum`` is the released reduction, its ``mean`` that sum over B C."""
    summed = HillLoss(lamb=lamb, margin=margin, gamma=gamma, reduction="sum")
    mean = HillLoss(lamb=lamb, margin=margin, gamma=gamma)
    for seed in SEEDS:
        logits, targets = random_batch(regime, seed)
        reference = partial(zhang_hill, lamb=lamb, margin=margin, gamma=gamma)
        ref_value = assert_parity(summed, reference, logits, targets)
        torch.testing.assert_close(mean(logits, targets), ref_value / logits.numel(), **TOL)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("epoch", [0, 1, 3])
@pytest.mark.parametrize(("tau", "change_epoch"), [(0.6, 1), (0.5, 0), (0.8, 2)])
def test_splc_equals_the_released_code(tau, change_epoch, epoch, regime):
    """SPLC against Zhang et al.'s ``SPLC.forward`` (see :func:`zhang_splc_matrix`), 0-based epochs as
    theirs, margin 1 and gamma 2: float64 precision, value and gradient. The released code corrects every
    label-0 entry; mlcls corrects unknown labels only, so the reference takes an observed negative's
    uncorrected term (under single-positive labels there is none, and the two are the same function)."""
    summed = SPLCLoss(tau=tau, change_epoch=change_epoch, reduction="sum")
    summed.set_epoch(epoch)
    corrected_somewhere = False
    for seed in SEEDS:
        logits, targets = random_batch(regime, seed)
        reference = partial(zhang_splc_mlcls_labels, epoch=epoch, tau=tau, change_epoch=change_epoch)
        assert_parity(summed, reference, logits, targets)
        corrected_somewhere |= bool(((targets == -1) & (torch.sigmoid(logits) > tau)).any())
    assert corrected_somewhere  # the batches do exercise the correction
