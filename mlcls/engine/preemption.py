"""Stop requests from signals, agreed on by every rank without waiting for the GPU.

SIGTERM and SIGUSR1 (what SLURM sends before a time limit or preemption) and a first SIGINT (Ctrl-C) ask
the run to stop after the current step, checkpointed; a second SIGINT ends the process at once. Under DDP
all ranks must stop after the same step. The flags are exchanged on the CPU (gloo) every
:data:`POLL_EVERY` steps, asynchronously: the exchange started at one poll is read at the next, which every
rank reaches after the same step, so the decision is identical everywhere and no step waits for it.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from mlcls.distributed import all_reduce_max

log = logging.getLogger("mlcls")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Steps between two exchanges of the stop flags under DDP: a signal takes effect within 2 x POLL_EVERY steps.
POLL_EVERY = 10


class StopSignals:
    """Installs the stop handlers for the duration of a ``with`` block. ``received`` is the first signal
    this process got (or None); :meth:`poll` is the decision all ranks share. The handlers installed before
    (submitit's, on SLURM) are kept in ``previous``, to be handed the signal once the checkpoint is written.
    """

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        self._flag = torch.zeros(1)
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def __enter__(self) -> StopSignals:
        self.previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pending is not None:  # a started exchange must complete before the group is reused
            self._pending[0].wait()
            self._pending = None
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
        if self.received is None:
            self.received = signum
            hint = " (Ctrl-C again to quit at once)" if signum == signal.SIGINT else ""
            log.warning("received %s: stopping after this step%s", signal.Signals(signum).name, hint)

    def poll(self, step: int) -> bool:
        """True on every rank when the run must stop after step ``step`` (counted from 1): at once in a
        single process, under DDP at multiples of :data:`POLL_EVERY` from the previous multiple's exchange."""
        if not self.distributed:
            return self.received is not None
        if step % POLL_EVERY:
            return False
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()  # started POLL_EVERY steps ago: long done
            stop = bool(flag.item())  # a CPU tensor: no device synchronisation
        flag = torch.tensor([float(self.received is not None)])
        self._pending = (all_reduce_max(flag, async_op=True), flag)
        return stop

    def agree_now(self) -> bool:
        """The decision of all ranks at once (a blocking exchange), for the end of an epoch."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        if not self.distributed:
            return self.received is not None
        flag = torch.tensor([float(self.received is not None)])
        all_reduce_max(flag)
        return bool(flag.item())

    def hand_over(self) -> None:
        """Give the received signal to the handler installed before ours (submitit requeues the job)."""
        handler: Callable[..., Any] | Any = self.previous.get(self.received) if self.received else None
        if callable(handler) and handler is not signal.default_int_handler:
            handler(self.received, None)
