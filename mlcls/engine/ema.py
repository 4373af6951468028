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

    TensorFlow's ``ExponentialMovingAverage(num_updates=t)`` warm-up. Without it the initial copy keeps a
    weight ``decay**n`` after n updates (15 % for 0.9997 after 6,400); with it the first K updates keep
    about ``(K/n)**9``, and d_t reaches ``decay`` after ``(10 decay - 1) / (1 - decay)`` updates.

    Floating buffers (BatchNorm's statistics) are averaged like the parameters; counters are copied.
    Nothing is read from the device: ``t`` is a device tensor, and the weight ``1 - d_t = max(1 - decay,
    9 / (10 + t))`` (the complement directly: accurate in float32) times the step's ``applied`` flag leaves
    the average and the count as they were after a skipped step.
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
        """Move the average towards ``model`` (unwrapped from DDP/compile), unless ``applied`` (a 0-d bool
        device tensor; None: True) says the optimizer skipped the step."""
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
        """Restore :meth:`state_dict`'s output (checked by :func:`mlcls.engine.state.check_part`)."""
        self.module.load_state_dict(state["module"])
        self._updates.fill_(int(state["updates"]))
