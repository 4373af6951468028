"""Exponential moving average (EMA) of a model's weights, with the decay warmed up over the first updates."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class ModelEma:
    """An averaged copy of ``model``, updated after each applied optimizer step.

    At the update that follows ``t`` earlier updates (t = 0, 1, ...), every parameter and floating buffer
    ``e`` of :attr:`module` moves towards the model's ``x``::

        e <- d_t e + (1 - d_t) x,    d_t = min(decay, (1 + t) / (10 + t))   (with warm-up; else d_t = decay)

    the warm-up of TensorFlow's ``ExponentialMovingAverage(num_updates=t)``. Without it the copy taken at
    construction keeps a weight ``decay**n`` after n updates: 15 % for decay 0.9997 after 6,400 updates
    (40 epochs of COCO at batch 512). With it d_0 = 0.1, and while d_t < decay the first K updates
    together keep the weight ``(K+1)...(K+9) / ((n+1)...(n+9))``, about ``(K/n)**9``, after n updates
    (the first half of 6,400: 0.2 %). d_t reaches ``decay`` after ``(10 decay - 1) / (1 - decay)`` updates
    (30,000 for 0.9997); until then the average spans about the last ``t / 9`` updates.

    Floating buffers (BatchNorm's running statistics) are averaged like the parameters, so the averaged
    network normalises with statistics that follow its own weights; counters (``num_batches_tracked``)
    are copied exactly.

    The update never reads the device from the host: the update count ``t`` is a device tensor, and the
    weight ``1 - d_t = max(1 - decay, 9 / (10 + t))`` (the complement directly: accurate in float32, where
    subtracting ``d_t`` from 1 would lose digits) is computed there and multiplied by the step's
    ``applied`` flag, so a step the optimizer skipped leaves the average and the count as they were.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay!r}; expected a number in (0, 1)")
        self.decay, self.warmup = decay, warmup
        self.module = copy.deepcopy(model).requires_grad_(False)
        device = next(self.module.parameters()).device
        self._updates = torch.zeros((), dtype=torch.int64, device=device)  # applied updates so far

    @property
    def updates(self) -> int:
        """Number of applied updates (reads the device)."""
        return int(self._updates)

    @torch.no_grad()
    def update(self, model: nn.Module, applied: torch.Tensor | None = None) -> None:
        """Move the average towards ``model`` (the same architecture, unwrapped from DDP/compile).

        ``applied``: 0-d bool tensor on the device, false when the optimizer skipped the step (non-finite
        gradients); the update then changes nothing. None: the step was applied.
        """
        applied = (
            torch.ones((), dtype=torch.bool, device=self._updates.device) if applied is None else applied
        )
        weight = 1.0 - self.decay
        if self.warmup:
            weight = torch.clamp(9.0 / (10.0 + self._updates.float()), min=weight)
        weight = weight * applied
        averaged, current, counters, counts = [], [], [], []
        pairs = zip(
            [*self.module.parameters(), *self.module.buffers()],
            [*model.parameters(), *model.buffers()],
            strict=True,
        )
        for ema_tensor, model_tensor in pairs:
            if ema_tensor.is_floating_point():
                averaged.append(ema_tensor)
                current.append(model_tensor.detach())
            else:
                counters.append(ema_tensor)
                counts.append(model_tensor)
        # one 0-d weight per tensor, in its dtype and on its device: lerp reads it on the device
        weights = {(t.device, t.dtype): weight.to(t.device, t.dtype) for t in averaged}
        torch._foreach_lerp_(averaged, current, [weights[t.device, t.dtype] for t in averaged])
        for counter, count in zip(counters, counts, strict=True):
            counter.copy_(torch.where(applied, count, counter))
        self._updates += applied

    def state_dict(self) -> dict[str, Any]:
        """``{"module": the averaged weights, "updates": number of applied updates}`` (reads the device)."""
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        if "module" not in state or "updates" not in state:
            raise ValueError(
                f"not an EMA state (keys {', '.join(sorted(state)[:4])}, ...); expected module and updates"
            )
        self.module.load_state_dict(state["module"])
        self._updates.fill_(int(state["updates"]))
