"""The ``text`` group: ``words`` embeddings against a float64 reference written here, the cache, and the
class names a user gives (a class list file, a comma list) refused in one line when over a bound."""

from __future__ import annotations

import hashlib
import math
import os
import re

import numpy as np
import pytest
import torch
from conftest import compose_config
from hostile import bounded

import mlcls.text as text
from mlcls.errors import ConfigError
from mlcls.text import MAX_CLASSES, class_embeddings, parse_classes, read_class_list

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
    names = ["blue_triangle", "Red-Square", "green circle", "blue"]
    got = class_embeddings(WORDS, names)
    expected = torch.tensor([reference_embedding(name, 16, 3) for name in names], dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == (4, 16)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    # the words alone matter: case and separators do not
    torch.testing.assert_close(class_embeddings(WORDS, ["Blue Triangle"]), got[:1], rtol=0, atol=0)


def test_the_words_source_names_its_dim_and_seed_and_the_default_config_composes():
    cfg = compose_config(["model.head=cosine"])
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
