"""Multi-label losses.

Every loss is an ``nn.Module`` called as ``loss(logits, targets)``: ``logits`` (B, C) of any float dtype,
``targets`` (B, C) with 1 = positive, 0 = negative, -1 = unknown (ignored); it returns a scalar.
A loss that needs statistics of the training labels (e.g. class-frequency weighting) defines
``setup(train_labels)``; the trainer calls it once before training.

Each class carries its short name as the class attribute ``name`` (``TwoWayLoss.name == "twoway"``), which
is also the name of its config ``configs/loss/<name>.yaml``. That config points ``_target_`` at the class
and lists every constructor argument, so ``loss=twoway loss.tp=4`` on the command line and
``TwoWayLoss(tp=4.0)`` in Python build the same object. Adding a loss is one small module with the class,
exported here, and its config; shared pieces (input checks, reductions, masked log-sum-exp, buckets, DDP
gather) are in :mod:`mlcls.losses.common`.

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
=================  =========================================  ==========================
"""

from __future__ import annotations

from mlcls.losses.bce import BinaryCrossEntropyLoss
from mlcls.losses.focal import AsymmetricLoss, FocalLoss
from mlcls.losses.multisim import MultiSimilarityLoss, ZLPRLoss
from mlcls.losses.softmax import SoftmaxLoss, SphericalSoftmaxLoss, TaylorSoftmaxLoss
from mlcls.losses.twoway import JointLoss, TwoWayLoss

__all__ = [
    "AsymmetricLoss",
    "BinaryCrossEntropyLoss",
    "FocalLoss",
    "JointLoss",
    "MultiSimilarityLoss",
    "SoftmaxLoss",
    "SphericalSoftmaxLoss",
    "TaylorSoftmaxLoss",
    "TwoWayLoss",
    "ZLPRLoss",
]
