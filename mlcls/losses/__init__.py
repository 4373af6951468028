"""Multi-label losses.

Every loss is an ``nn.Module`` called as ``loss(logits, targets)``: ``logits`` (B, C) of any float dtype,
``targets`` (B, C) with 1 = positive, 0 = negative, -1 = unknown; it returns a scalar. A loss that needs
the training labels' statistics defines ``setup(counts)``, called once before training. Each class's
``name`` names its config ``configs/loss/<name>.yaml`` (``_target_`` the class, every constructor argument).

=================  =========================================  ==========================
name               class                                      paper
=================  =========================================  ==========================
twoway             :class:`TwoWayLoss`                        eqs. 14-17
joint              :class:`JointLoss`                         eq. 22
multisim           :class:`MultiSimilarityLoss`               eq. 20 (+ T_P, Table 4a)
zlpr               :class:`ZLPRLoss`                          eq. 20 at T_P = 1
softmax            :class:`SoftmaxLoss`                       eq. 18
taylor_softmax     :class:`TaylorSoftmaxLoss`                 eq. 18 form
spherical_softmax  :class:`SphericalSoftmaxLoss`              eq. 18 form
bce                :class:`BinaryCrossEntropyLoss`            eq. 19
focal              :class:`FocalLoss`                         Table 7
asl                :class:`AsymmetricLoss`                    Table 7
an                 :class:`AssumeNegativeLoss`                Cole et al. 2021, eq. 4
an_ls              :class:`LabelSmoothedAssumeNegativeLoss`   Cole et al. 2021, Sec. 3.2
wan                :class:`WeakAssumeNegativeLoss`            Cole et al. 2021, eq. 5
epr                :class:`ExpectedPositiveLoss`              Cole et al. 2021, eq. 6
em                 :class:`EntropyMaximisationLoss`           Zhou et al. 2022, eq. 3
ll                 :class:`LargeLossLoss`                     Kim et al. 2022, eqs. 3-5
hill               :class:`HillLoss`                          Zhang et al. 2021, eq. 9
splc               :class:`SPLCLoss`                          Zhang et al. 2021, eq. 7
role               :class:`RoleLoss`                          Cole et al. 2021, Sec. 3.3
=================  =========================================  ==========================

The first ten exclude unknown labels; the last nine, losses for missing and single-positive labels,
give them a term of their own (docs/losses.md lists what each loss does with -1). ``ll`` and ``splc``
change with the epoch (``set_epoch``); ``role`` and ``ll`` in mode cp keep a row per training sample and
take the batch's sample indices (:mod:`mlcls.losses.role`).
"""

from __future__ import annotations

from mlcls.losses.bce import BinaryCrossEntropyLoss
from mlcls.losses.focal import AsymmetricLoss, FocalLoss
from mlcls.losses.large_loss import LargeLossLoss
from mlcls.losses.multisim import MultiSimilarityLoss, ZLPRLoss
from mlcls.losses.robust import HillLoss, SPLCLoss
from mlcls.losses.role import RoleLoss
from mlcls.losses.softmax import SoftmaxLoss, SphericalSoftmaxLoss, TaylorSoftmaxLoss
from mlcls.losses.twoway import JointLoss, TwoWayLoss
from mlcls.losses.unknown import (
    AssumeNegativeLoss,
    EntropyMaximisationLoss,
    ExpectedPositiveLoss,
    LabelSmoothedAssumeNegativeLoss,
    WeakAssumeNegativeLoss,
)

__all__ = [
    "AssumeNegativeLoss",
    "AsymmetricLoss",
    "BinaryCrossEntropyLoss",
    "EntropyMaximisationLoss",
    "ExpectedPositiveLoss",
    "FocalLoss",
    "HillLoss",
    "JointLoss",
    "LabelSmoothedAssumeNegativeLoss",
    "LargeLossLoss",
    "MultiSimilarityLoss",
    "RoleLoss",
    "SPLCLoss",
    "SoftmaxLoss",
    "SphericalSoftmaxLoss",
    "TaylorSoftmaxLoss",
    "TwoWayLoss",
    "WeakAssumeNegativeLoss",
    "ZLPRLoss",
]
