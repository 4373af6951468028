"""The non-finite guard: a step's gradient norm, the step skipped and counted on the device if not finite."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.utils import get_total_norm


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def gradient_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients together (0 without any), as ``clip_grad_norm_`` reports it, in one
    multi-tensor pass and without reading it back."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return get_total_norm(grads, foreach=True) if grads else torch.zeros(())


def step_if_finite(optimizer: torch.optim.Optimizer, applied: torch.Tensor) -> None:
    """``optimizer.step()`` where ``applied`` (a 0-d bool device tensor) is True; else the parameters and the
    optimizer state stay as they were.

    A fused optimizer skips in its kernel (GradScaler's ``found_inf`` flag). Any other gets back a copy
    taken before the step: one copy in device memory, no read. A state made by this step (a parameter's
    first) has nothing to go back to: only that step reads ``applied``, and drops it when skipped. A state
    on another device (a non-capturable Adam's CPU step) is not put back: it counts a skipped step too.
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    stateless = [p for p in params if not optimizer.state.get(p)]
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale, optimizer.found_inf = None, (~applied).float()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    else:
        kept = [
            tensor
            for p in params
            for tensor in (p, *optimizer.state.get(p, {}).values())
            if isinstance(tensor, torch.Tensor) and tensor.device == applied.device
        ]
        before = [tensor.detach().clone() for tensor in kept]
        optimizer.step()
        with torch.no_grad():
            for tensor, saved in zip(kept, before, strict=True):
                torch.where(applied, tensor, saved, out=tensor)
    made = [p for p in stateless if optimizer.state.get(p)]  # none for a stateless optimizer (plain SGD)
    if made and not applied.item():
        for p in made:
            del optimizer.state[p]


class NonFiniteCounter:
    """Skipped steps counted on the device (recording reads nothing back): the current run of consecutive
    skips, the longest since :meth:`check`, the total since :meth:`take_skipped`."""

    def __init__(self, device: torch.device, max_run: int) -> None:
        self.max_run = max_run
        self.run = torch.zeros((), dtype=torch.long, device=device)
        self.longest = torch.zeros_like(self.run)
        self.skipped = torch.zeros_like(self.run)

    def record(self, applied: torch.Tensor) -> None:
        """Count one step; ``applied`` is a 0-d bool tensor, False for a skipped step."""
        skipped = (~applied).long()
        self.run.add_(skipped).mul_(skipped)
        torch.maximum(self.longest, self.run, out=self.longest)
        self.skipped.add_(skipped)

    def check(self, epoch: int) -> None:
        """Raise :class:`NonFiniteError` if ``max_run`` consecutive steps were skipped since the last check
        (a read from the device: :meth:`take_longest` and :meth:`raise_if` read it later)."""
        self.raise_if(int(self.take_longest().item()), epoch)

    def take_longest(self) -> torch.Tensor:
        """The longest run of skipped steps since the last call (a device tensor; nothing is read)."""
        longest = self.longest.clone()
        self.longest.copy_(self.run)
        return longest

    def raise_if(self, longest: int, epoch: int) -> None:
        """Raise :class:`NonFiniteError` if ``longest`` (of :meth:`take_longest`) reached ``max_run``."""
        if longest >= self.max_run:
            raise NonFiniteError(
                f"{longest} consecutive steps with a non-finite loss or gradient at epoch {epoch + 1}: lower "
                "the learning rate (optim.lr_head/lr_backbone), try trainer.amp=bf16 or none instead of "
                "fp16, set trainer.grad_clip, and check the labels (values 1/0/-1)"
            )

    def take_skipped(self) -> int:
        """Skipped steps since the last call."""
        skipped = int(self.skipped.item())
        self.skipped.zero_()
        return skipped
