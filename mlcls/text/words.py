"""``text=words``: a class name's embedding is the sum of one fixed random vector per word.

Each word (lower-cased) gets a Gaussian vector drawn from a generator seeded by the word itself: the first
8 bytes of SHA-256 of ``"<seed>:<word>"`` (little-endian) seed numpy's PCG64 ``default_rng``, whose
``standard_normal(dim)`` is the vector; a class name's is the sum of its words' (``blue_triangle`` = blue +
triangle). It knows nothing of meaning ("cat" is no nearer "kitten" than "truck"); what it gives is
composition: a class never trained on, made of words seen in training (``red_circle`` after ``red_square``
and ``blue_circle``), is near the classes that share its words. It needs no file and no download, so it
serves the tests and the demo -- not a claim about language.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import numpy as np
import torch

from mlcls.errors import ConfigError, is_integer, shown
from mlcls.text import MAX_DIM

# Where a class name splits into words.
WORD_SEPARATORS = re.compile(r"[_\-\s]+")


def split_words(name: str) -> list[str]:
    """The lower-cased words of class name ``name`` (split on ``_``, ``-`` and white space); a name without
    one (``"_"``) is a one-line :class:`ConfigError`."""
    words = [word for word in WORD_SEPARATORS.split(name.lower()) if word]
    if not words:
        raise ConfigError(f"class name {shown(name)} has no word; expected letters or digits")
    return words


def sum_of_words(names: list[str], vectors: Mapping[str, np.ndarray]) -> torch.Tensor:
    """float64 (C, D): row ``c`` the sum of ``vectors[word]`` over the words of ``names[c]``."""
    return torch.from_numpy(np.stack([sum(vectors[word] for word in split_words(name)) for name in names]))


class WordsEncoder:
    """Sum of per-word seeded Gaussian vectors, ``dim`` wide; ``seed`` picks another set of vectors."""

    def __init__(self, dim: int = 300, seed: int = 0) -> None:
        if not is_integer(dim) or not 1 <= dim <= MAX_DIM:
            raise ConfigError(f"text.dim={dim!r}; expected an integer from 1 to {MAX_DIM}")
        if not is_integer(seed):
            raise ConfigError(f"text.seed={seed!r}; expected an integer")
        self.dim, self.seed = dim, seed
        self.source = f"words(dim={dim}, seed={seed})"

    def encode(self, names: list[str]) -> torch.Tensor:
        """float64 (C, dim): :func:`sum_of_words` of each word's vector (module docstring), drawn once per
        call."""
        vectors = {}
        for word in {word for name in names for word in split_words(name)}:
            digest = hashlib.sha256(f"{self.seed}:{word}".encode()).digest()
            rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
            vectors[word] = rng.standard_normal(self.dim)
        return sum_of_words(names, vectors)
