"""``text=words``: a class name's embedding is the sum of one fixed random vector per word.

Each word (lower-cased) gets a Gaussian vector drawn from a generator seeded by the word itself: the first
8 bytes of SHA-256 of ``"<seed>:<word>"`` (little-endian) seed numpy's PCG64 ``default_rng``, whose
``standard_normal(dim)`` is the vector; a class name's is the sum of its words' (``blue_triangle`` = blue +
triangle). It knows nothing of meaning ("cat" is no nearer "kitten" than "truck"); what it gives is
composition: a class never trained on, made of words seen in training (``red_circle`` after ``red_square``
and ``blue_circle``), is near the classes that share its words. It needs no file and no download, so it
serves the tests and the demo -- not a claim about language.

The names come from someone else (a class list given to ``mlcls-predict``), so the sum never holds a vector
per distinct word: :func:`word_rows` indexes each word by the rows of the names holding it, and each word's
vector, drawn (or read, ``text=vectors``) once, is added to those rows and dropped. Memory is the (C, D)
float64 rows, 8 x D bytes a class, and the index, about 180 bytes a word (270 with ``text=vectors``'s
lookup by bytes), :data:`MAX_WORDS` words in all at most. A class or a word takes 2 bytes of a class list at
least (a character and a separator), so the encoder holds at most 4 x D + 135 times the names' bytes.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import torch

from mlcls.errors import ConfigError, is_integer, shown
from mlcls.text import MAX_DIM

# Where a class name splits into words.
WORD_SEPARATORS = re.compile(r"[_\-\s]+")
# The most words all the class names may hold together: 2 a class at the most classes a list may name (a
# class name is a word or a few). It bounds the index (36 MB; 54 MB for text=vectors) and the time (a vector
# drawn, in 11 to 30 us, or read, a word).
MAX_WORDS = 200_000


def split_words(name: str) -> list[str]:
    """The lower-cased words of class name ``name`` (split on ``_``, ``-`` and white space); a name without
    one (``"_"``) is a one-line :class:`ConfigError`."""
    words = [word for word in WORD_SEPARATORS.split(name.lower()) if word]
    if not words:
        raise ConfigError(f"class name {shown(name)} has no word; expected letters or digits")
    return words


def word_rows(names: list[str]) -> dict[str, list[int]]:
    """Each word of ``names`` (:func:`split_words`), first seen first, with the rows of the names holding it
    (a row once per time it holds it); over :data:`MAX_WORDS` words in all is a one-line
    :class:`ConfigError`, said before any is indexed."""
    total = sum(len(split_words(name)) for name in names)
    if total > MAX_WORDS:
        raise ConfigError(
            f"the {len(names):,} class names hold {total:,} words; expected at most {MAX_WORDS:,} in all "
            "(a few words a class)"
        )
    rows: dict[str, list[int]] = {}
    for row, name in enumerate(names):
        for word in split_words(name):
            rows.setdefault(word, []).append(row)
    return rows


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
        """float64 (C, dim): the sum of each name's word vectors (module docstring), each drawn once."""
        sums = np.zeros((len(names), self.dim))
        for word, rows in word_rows(names).items():
            digest = hashlib.sha256(f"{self.seed}:{word}".encode()).digest()
            rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
            vector = rng.standard_normal(self.dim)
            for row in rows:  # twice to a row listed twice
                sums[row] += vector
        return torch.from_numpy(sums)
