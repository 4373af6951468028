"""Restoring a training checkpoint (:mod:`mlcls.engine.checkpoint`) on another number of processes."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mlcls.engine.checkpoint import restore
from mlcls.engine.state import TrainState, rng_state


def test_a_resume_on_another_world_size_says_what_happens(caplog) -> None:
    checkpoint = {"optimizer": {}, "epoch": 1, "step": 3, "rng": [rng_state(), rng_state(), rng_state()]}
    state = TrainState()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with caplog.at_level(logging.WARNING, logger="mlcls"):
        restore(checkpoint, Path("last.pt"), {}, scaler, state, "off", rank=0)  # one process here
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "last.pt was written by 3 processes and resumes on 1: rank r continues the random streams of rank "
        "min(r, 2), and the rest of an epoch stopped midway is not what an uninterrupted run would read"
    ]
    assert (state.epoch, state.step) == (1, 3)
    caplog.clear()
    checkpoint["rng"] = checkpoint["rng"][:1]
    with caplog.at_level(logging.WARNING, logger="mlcls"):
        restore(checkpoint, Path("last.pt"), {}, scaler, state, "off", rank=0)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
