"""``text=vectors``: class embeddings from a local word-vector file in the GloVe or fastText text format.

The format: one word a line followed by its vector, fields separated by single spaces (fastText's ``.vec``
ends each line with a space and starts with a header line ``<count> <dim>``; GloVe's ``.txt`` does neither).
A class name's vector is the sum of its words' (``traffic_light`` = traffic + light): once normalised, the
same vector as the mean that ML-Decoder's and LESA's zero-shot queries use. The file is someone else's
data (a regular file of at most ``CAPS["word vectors"]``), streamed one line at a time:

* a word's vector is added to the rows of the names holding it (:func:`~mlcls.text.words.word_rows`) as it
  is read, then dropped: memory is bounded by the class list (the (C, D) float64 sums and the words'
  index, :mod:`mlcls.text.words`), never by the file; the reading stops once every word has been found;
* a line is read :data:`MAX_LINE_BYTES` at most: a longer one is refused without being read whole;
* every line read has the same number of values (the header's ``dim``, or the first line's), each a finite
  number; a value of a kept word that is not is refused, naming the line;
* a word of the file never reaches a terminal unescaped: errors quote it with ``repr``; every fault is one
  line (missing words: the first :data:`MAX_NAMED_MISSING`, then how many more).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np
import torch

from mlcls.errors import ConfigError, listed, plural, printable, shown
from mlcls.io import CAPS, MiB, open_regular
from mlcls.text import MAX_DIM
from mlcls.text.words import word_rows

# The longest line read: a 300-d GloVe or fastText line is about 3 KB, a 4096-d one at full float precision
# about 60 KB; a longer line is not a word vector, and reading it whole could take all memory.
MAX_LINE_BYTES = MiB
# The missing words a one-line error names before it counts the rest.
MAX_NAMED_MISSING = 20


class WordVectorsEncoder:
    """The sum of a class name's word vectors, read from the word-vector file ``path`` (GloVe or fastText
    text format). The file is read in :meth:`encode`, not when the encoder is built."""

    def __init__(self, path: str | os.PathLike) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ConfigError(f"text.path={path!r}; expected the path of a GloVe or fastText vector file")
        self.path = Path(path)
        self.source = f"vectors({os.path.abspath(self.path)})"

    def encode(self, names: list[str]) -> torch.Tensor:
        """float64 (C, D): the sum of each name's word vectors read from the file; words the file lacks are
        a one-line :class:`ConfigError`."""
        sums, missing = sum_word_vectors(self.path, word_rows(names), len(names))
        if missing:
            raise ConfigError(
                f"word-vector file {printable(str(self.path))} has no vector for "
                f"{plural(len(missing), 'word')} of the class names: {listed(missing, MAX_NAMED_MISSING)}; "
                "expected every word (lower-cased) in the file"
            )
        return torch.from_numpy(sums)


def sum_word_vectors(
    path: str | os.PathLike, rows: dict[str, list[int]], count: int
) -> tuple[np.ndarray, list[str]]:
    """float64 (``count``, D): row ``r`` the sum of the vectors in the word-vector file ``path`` of the words
    whose ``rows`` list ``r`` (the first line of a word listed twice), read and checked as the module says;
    and the words the file lacks, in ``rows``' order."""
    shown_path = printable(str(path))
    wanted = {word.encode("utf-8"): word for word in rows}  # the words not yet found
    sums = np.zeros((count, 0))
    try:
        file = open_regular(path, "rb", max_bytes=CAPS["word vectors"], what="word-vector file")
    except FileNotFoundError:
        raise ConfigError(f"text.path: no file {shown_path}; expected a word-vector file") from None
    with file:
        dim = None
        for number, line in _lines(file, shown_path):
            if dim is None:
                dim, is_header = _dimension(line, number, shown_path)
                sums = np.zeros((count, dim))
                if is_header:
                    continue
            if not wanted:
                break
            spaces = line.count(b" ")
            if spaces != dim:
                head = line.rsplit(b" ", dim)[0]
                if spaces < dim or _is_number(head.rpartition(b" ")[2]):
                    raise ConfigError(
                        f"word-vector file {shown_path}: line {number} ({_word(line.split(b' ')[0])}) has "
                        f"{spaces} values; expected {dim}, as the lines before it"
                    )
                continue  # a word holding spaces (GloVe 840B has a few): never a word of a class name
            key = line[: line.index(b" ")]
            word = wanted.pop(key, None)
            if word is not None:
                vector = _vector(line[len(key) + 1 :], number, key, shown_path)
                with np.errstate(over="ignore"):  # a sum past float64's range: refused by class_embeddings
                    for row in rows[word]:  # twice to a row listed twice
                        sums[row] += vector
    return sums, list(wanted.values())


def _lines(file: IO[bytes], shown_path: str) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of ``file`` with their numbers (from 1), trailing white space removed, each read
    :data:`MAX_LINE_BYTES` at most."""
    number = 0
    while raw := file.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise ConfigError(
                f"word-vector file {shown_path}: line {number} is over {MAX_LINE_BYTES // MiB} MiB; expected "
                "one word and its vector a line"
            )
        line = raw.rstrip(b" \t\r\n")
        if line:
            yield number, line


def _dimension(line: bytes, number: int, shown_path: str) -> tuple[int, bool]:
    """The vector width the first line sets, and whether that line is a fastText header ``<count> <dim>``."""
    fields = line.split(b" ")
    is_header = number == 1 and len(fields) == 2 and all(field.isdigit() for field in fields)
    dim = int(fields[1]) if is_header else len(fields) - 1
    if not 1 <= dim <= MAX_DIM:
        raise ConfigError(
            f"word-vector file {shown_path}: line {number} gives vectors of {dim} values; expected a word "
            f"and 1 to {MAX_DIM} values a line (GloVe), after a '<count> <dim>' header line (fastText)"
        )
    return dim, is_header


def _vector(values: bytes, number: int, word: bytes, shown_path: str) -> np.ndarray:
    """The float64 vector of a line's ``values`` field, each a finite number."""
    try:
        vector = np.array([float(value) for value in values.split(b" ")])
    except ValueError:
        bad = next(value for value in values.split(b" ") if not _is_number(value))
        raise ConfigError(
            f"word-vector file {shown_path}: line {number} ({_word(word)}) holds {_word(bad)}; expected "
            "numbers"
        ) from None
    if not np.isfinite(vector).all():
        bad = values.split(b" ")[int(np.flatnonzero(~np.isfinite(vector))[0])]
        raise ConfigError(
            f"word-vector file {shown_path}: line {number} ({_word(word)}) holds {_word(bad)}; expected "
            "finite numbers"
        )
    return vector


def _is_number(field: bytes) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def _word(field: bytes) -> str:
    """A field of the file for an error message: decoded, quoted with ``repr`` (control characters escaped),
    cut short."""
    return shown(field.decode("utf-8", errors="backslashreplace"))
