"""Training randomness: a function of ``(seed, epoch, sample index)`` only.

The training sampler (:class:`mlcls.data.loader.ResumableSampler`) draws the epoch's permutation from
``seed + epoch`` (``DistributedSampler``'s rule, also for a single process) and hands each index to the
dataset together with :func:`sample_seed`, under which the sample's augmentation runs (:func:`seeded_call`).
Hence the augmented batch at iteration *i* does not depend on the number of DataLoader workers, and a run
resumed in the middle of an epoch sees exactly the batches it would have seen. The shard datasets and their
read order (:mod:`mlcls.data.shards`) draw from the same two functions; this module imports nothing of mlcls.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for the augmentation of sample ``index`` in ``epoch``."""
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % (2**63 - 1)


def seeded_call(seed: int, function: Callable[..., T], *args: Any, torch_only: bool = False) -> T:
    """``function(*args)`` with torch/numpy/random seeded by ``seed``; the caller's random state is restored
    afterwards. How every training sample's augmentation runs (map-style and shard datasets).

    Only the CPU generator is seeded (the augmentation draws nothing on a device): ``torch.manual_seed``
    would also queue the seeding of every device generator, capturing a stack trace for each (~1 ms per
    sample, a quarter of the fast pipeline's time per image), and leave them changed.

    ``torch_only``: ``function`` draws from torch's CPU generator alone (the fast pipeline's CPU stage,
    ``FastTrainTransform.torch_random_only``), so Python's and NumPy's generators are left alone: neither
    seeded nor saved and restored (~0.1 ms a sample: NumPy copies its state out and in word by word).
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        if torch_only:
            return function(*args)
        py_state, np_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            return function(*args)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
