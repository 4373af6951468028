"""The ``text`` group: ``words`` embeddings against a float64 reference written here, the cache, and the
class names a user gives (a class list file, a comma list) refused in one line when over a bound."""

from __future__ import annotations

import decimal
import hashlib
import itertools
import math
import os
import re
import string

import numpy as np
import pytest
import torch
from conftest import compose_config
from hostile import bounded

import mlcls.text as text
from mlcls.errors import ConfigError
from mlcls.text import MAX_CLASSES, class_embeddings, parse_classes, read_class_list
from mlcls.text.words import MAX_WORDS

WORDS = {"_target_": "mlcls.text.words.WordsEncoder", "dim": 16, "seed": 3}


def reference_word(word: str, dim: int, seed: int) -> list[float]:
    """The vector of ``word`` as configs/text/words.yaml documents it, in float64 Python floats."""
    digest = hashlib.sha256(f"{seed}:{word.lower()}".encode()).digest()
    return [
        float(x) for x in np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(dim)
    ]


def reference_embedding(name: str, dim: int, seed: int) -> list[float]:
    total = [0.0] * dim
    for word in re.split(r"[_\- ]+", name):
        if word:
            total = [a + b for a, b in zip(total, reference_word(word, dim, seed), strict=True)]
    norm = math.sqrt(sum(x * x for x in total))
    return [x / norm for x in total]


def test_words_equal_a_float64_reference_of_summed_seeded_word_vectors():
    names = ["blue_triangle", "Red-Square", "green circle", "blue", "red_red square"]  # red counted twice
    got = class_embeddings(WORDS, names)
    expected = torch.tensor([reference_embedding(name, 16, 3) for name in names], dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == (5, 16)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    # the words alone matter: case and separators do not
    torch.testing.assert_close(class_embeddings(WORDS, ["Blue Triangle"]), got[:1], rtol=0, atol=0)


def test_the_words_source_names_its_dim_and_seed_and_the_default_config_composes():
    cfg = compose_config(["model/head=cosine"])
    assert cfg.text._target_ == "mlcls.text.words.WordsEncoder"
    assert text.build_encoder(cfg.text).source == f"words(dim={cfg.text.dim}, seed={cfg.text.seed})"
    other = class_embeddings({**WORDS, "seed": 4}, ["blue"])
    assert not torch.allclose(other, class_embeddings(WORDS, ["blue"]))


def test_embeddings_are_cached_by_source_and_names_and_copies_are_returned(monkeypatch):
    calls = []

    class Counting:
        source = "counting"

        def encode(self, names):
            calls.append(list(names))
            return torch.ones(len(names), 3) * torch.arange(1, len(names) + 1)[:, None]

    encoder = Counting()
    first = class_embeddings(encoder, ["a", "b"])
    first += 5  # a caller's change does not reach the cache
    again = class_embeddings(encoder, ["a", "b"])
    class_embeddings(encoder, ["b", "a"])  # another order, another list
    assert calls == [["a", "b"], ["b", "a"]]
    torch.testing.assert_close(again, torch.full((2, 3), 1 / math.sqrt(3)))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (torch.zeros(2, 3), "all-zero embedding"),
        (torch.tensor([[1.0, float("nan")], [1.0, 0.0]]), "non-finite"),
        (torch.ones(3, 3), r"shape \(3, 3\) for 2 classes"),
    ],
)
def test_a_bad_encoder_output_is_one_line(rows, message):
    class Bad:
        source = f"bad{rows.shape}{message}"

        def encode(self, names):
            return rows

    with pytest.raises(ConfigError, match=message) as info:
        class_embeddings(Bad(), ["x", "y"])
    assert "\n" not in str(info.value)


def decimal_unit_rows(rows: list[list[float]]) -> torch.Tensor:
    """float64 ``rows``, each value divided by its row's L2 norm, computed in 50-digit decimals (whose
    exponents reach far past float64's: no square overflows or underflows)."""
    with decimal.localcontext(prec=50):
        norms = [sum(decimal.Decimal(x) ** 2 for x in row).sqrt() for row in rows]
        units = [
            [float(decimal.Decimal(x) / norm) for x in row] for row, norm in zip(rows, norms, strict=True)
        ]
    return torch.tensor(units, dtype=torch.float64)


def test_finite_rows_of_any_magnitude_keep_their_direction():
    """Rows of 1e300 (their squares overflow float64) and of 1e-310 (their squares underflow to 0) are unit
    rows, each value divided by the row's norm computed in 50-digit decimals, not zeros nor refused."""
    rows = [[1e300, -2e300, 3e299], [1e-310, 0.0, -3e-310], [3.0, 4.0, 0.0], [-1.7e308, 1.7e308, 1.0]]

    class Extreme:
        source = "extreme rows"

        def encode(self, names):
            return torch.tensor(rows, dtype=torch.float64)

    got = class_embeddings(Extreme(), ["a", "b", "c", "d"])
    torch.testing.assert_close(got.double(), decimal_unit_rows(rows), rtol=0, atol=1e-7)


def many_words(count: int) -> list[str]:
    """Class names of ``count`` three-letter words in all (17,576 distinct, then again), 250 words (999
    characters) a name."""
    letters = itertools.cycle(itertools.product(string.ascii_lowercase, repeat=3))
    words = ["".join(next(letters)) for _ in range(count)]
    return ["_".join(words[start : start + 250]) for start in range(0, count, 250)]


def words_rows(names: list[str], dim: int) -> list[list[float]]:
    return class_embeddings({**WORDS, "dim": dim}, names)[[0, -1]].tolist()


@pytest.mark.slow
def test_distinct_words_cost_no_memory_of_their_own():
    """4,000 distinct words of 16 names at dim 4096: 128 MB as a vector per word (the code before this
    held one), a few MB as the 16 rows that sum them; under a 48 MB cap, and equal to the reference."""
    names = many_words(4000)
    outcome = bounded(words_rows, names, 4096, memory_mb=48, seconds=20)
    assert not outcome.escaped and outcome.error is None, outcome
    expected = [reference_embedding(name, 4096, 3) for name in (names[0], names[-1])]
    torch.testing.assert_close(torch.tensor(outcome.value), torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_class_names_over_the_word_limit_are_one_line_before_any_vector():
    names = many_words(MAX_WORDS + 1)  # 17,576 distinct words, most of them repeated
    outcome = bounded(words_rows, names, 300, memory_mb=64, seconds=10)
    assert not outcome.escaped and outcome.error == "ConfigError", outcome
    assert outcome.message == (
        f"the {len(names):,} class names hold {MAX_WORDS + 1:,} words; expected at most {MAX_WORDS:,} in "
        "all (a few words a class)"
    )


def test_a_class_list_file_is_read_one_name_a_line(tmp_path):
    path = tmp_path / "classes.txt"
    path.write_text("red_circle\r\n\n  blue square \ngreen-star\n")
    assert read_class_list(path) == ["red_circle", "blue square", "green-star"]
    assert parse_classes(str(path)) == ["red_circle", "blue square", "green-star"]
    assert parse_classes("a, b,c") == ["a", "b", "c"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("cat\ndog\x1b[31m\n", r"#2 'dog\\x1b\[31m' holds a control character"),
        ("cat\ncat\n", "named twice"),
        ("\n\n", "names no class"),
        ("x" * 1001 + "\n", "1 to 1000 characters"),
    ],
)
def test_a_bad_class_list_is_one_line_with_its_control_characters_escaped(tmp_path, content, message):
    path = tmp_path / "classes.txt"
    path.write_text(content)
    outcome = bounded(read_class_list, path, memory_mb=256, seconds=10)
    assert not outcome.escaped and outcome.error == "ConfigError", outcome.trace
    assert re.search(message, outcome.message) and "\n" not in outcome.message
    assert "\x1b" not in outcome.message


@pytest.mark.slow
def test_a_class_list_over_the_limit_stops_at_the_first_name_over(tmp_path):
    path = tmp_path / "many.txt"
    path.write_text("".join(f"c{i}\n" for i in range(MAX_CLASSES + 1)))
    outcome = bounded(read_class_list, path, memory_mb=256, seconds=10)
    assert not outcome.escaped and outcome.error == "ConfigError", outcome.trace
    assert outcome.message.endswith(f"names more than {MAX_CLASSES:,} classes; expected at most that")


@pytest.mark.slow
def test_a_class_list_that_is_a_pipe_is_refused_before_reading(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    outcome = bounded(read_class_list, fifo, memory_mb=256, seconds=10)
    assert not outcome.escaped and outcome.error == "ConfigError"
    assert "a pipe (FIFO); expected a regular file" in outcome.message
