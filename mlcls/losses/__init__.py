"""Multi-label losses.

Every loss is called as ``loss(logits, targets)`` -> scalar (conventions: :mod:`mlcls.losses.common`);
one that needs the training labels' statistics defines ``setup(counts)``, called once before training.
Each class's ``name`` names its config ``configs/loss/<name>.yaml``.

docs/losses.md tables every loss with its paper's equation and what it does with an unknown label (-1):
the ten of :mod:`.twoway`, :mod:`.multisim`, :mod:`.softmax`, :mod:`.bce` and :mod:`.focal` exclude it, the
nine for missing and single-positive labels give it a term of their own. ``ll`` and ``splc`` change
with the epoch (``set_epoch``); ``role`` and ``ll`` in mode cp keep a row per training sample and take
the batch's sample indices (:mod:`mlcls.losses.role`).
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
