"""Multi-label losses and their registry.

Every loss is an ``nn.Module`` called as ``loss(logits, targets)``: ``logits`` (B, C) of any float dtype,
``targets`` (B, C) with 1 = positive, 0 = negative, -1 = unknown (ignored); it returns a scalar.
A loss that needs statistics of the training labels (e.g. class-frequency weighting) defines
``setup(train_labels)``; the trainer calls it once before training.

``build_loss("twoway", tp=4.0)`` and ``loss=twoway loss.tp=4`` on the command line build the same object.
Adding a loss is one small module that decorates its class with ``@register_loss("name")`` and is imported
at the bottom of this file; shared pieces (input checks, masked log-sum-exp, buckets, DDP gather) are in
:mod:`mlcls.losses.common`.

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
bce                :class:`BCELoss`                           eq. 19
focal              :class:`FocalLoss`                         Table 7
asl                :class:`AsymmetricLoss`                    Table 7
=================  =========================================  ==========================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

LOSSES: dict[str, type[nn.Module]] = {}


def register_loss(*names: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator registering a loss under one or more names."""

    def decorator(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names:
            if name in LOSSES:
                raise ValueError(f"loss name {name!r} registered twice")
            LOSSES[name] = cls
        return cls

    return decorator


def build_loss(name: str, **kwargs: Any) -> nn.Module:
    """Build the registered loss ``name`` with keyword arguments ``kwargs``."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {', '.join(sorted(LOSSES))}")
    return LOSSES[name](**kwargs)


# Register the built-in losses (imported for their side effect on LOSSES) and export their classes.
from mlcls.losses.bce import BCELoss  # noqa: E402
from mlcls.losses.focal import AsymmetricLoss, FocalLoss  # noqa: E402
from mlcls.losses.multisim import MultiSimilarityLoss, ZLPRLoss  # noqa: E402
from mlcls.losses.softmax import SoftmaxLoss, SphericalSoftmaxLoss, TaylorSoftmaxLoss  # noqa: E402
from mlcls.losses.twoway import JointLoss, TwoWayLoss  # noqa: E402

__all__ = [
    "LOSSES",
    "AsymmetricLoss",
    "BCELoss",
    "FocalLoss",
    "JointLoss",
    "MultiSimilarityLoss",
    "SoftmaxLoss",
    "SphericalSoftmaxLoss",
    "TaylorSoftmaxLoss",
    "TwoWayLoss",
    "ZLPRLoss",
    "build_loss",
    "register_loss",
]
