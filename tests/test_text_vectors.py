"""The text sources that read a local file or model: ``text=vectors`` (a GloVe / fastText word-vector file),
``text=sentence`` (a sentence-transformers folder) and ``text=clip`` (open_clip's text tower and a local
checkpoint).

Each gives the embeddings of an independent reference: for ``vectors`` a float64 sum of the vectors parsed
here from the file the test writes; for ``sentence`` and ``clip`` the library's own encode call on a tiny
randomly initialised model the test writes. A word-vector file is someone else's data: every bad one (missing
words, ragged dims, a huge line, a pipe, a non-finite value) is read under a memory cap and a time limit
(tests/hostile.py) and gives one line.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import shutil
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from hostile import bounded
from omegaconf import OmegaConf
from test_text_words import decimal_unit_rows

from mlcls import config_dir
from mlcls.errors import ConfigError
from mlcls.text import class_embeddings
from mlcls.text.vectors import MAX_LINE_BYTES, WordVectorsEncoder

NAMES = ["Blue_triangle", "traffic light", "t-shirt", "red_blue-cat", "light_blue_light"]
WORDS = ["blue", "triangle", "traffic", "light", "t", "shirt", "red", "cat", "dog", "Blue"]


def text_config(name: str, **options) -> dict:
    """configs/text/<name>.yaml with ``options`` set, as a plain dict."""
    cfg = OmegaConf.load(config_dir() / "text" / f"{name}.yaml")
    return OmegaConf.to_container(OmegaConf.merge(cfg, options))


def unit_rows(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


# ---------------------------------------------------------------------------------------------- vectors


def write_vectors(path: Path, dim: int = 5, header: bool = False, seed: int = 0) -> Path:
    """A word-vector file of :data:`WORDS` (``dog`` twice, ``Blue`` upper-cased after ``blue``) and a word
    holding spaces, GloVe's format or fastText's (a header, a space ending each line)."""
    rng = np.random.default_rng(seed)
    lines = [f"{len(WORDS) + 1} {dim}"] if header else []
    for word in [*WORDS[:3], ". . .", *WORDS[3:]]:
        values = " ".join(f"{value:.6f}" for value in rng.standard_normal(dim))
        lines.append(f"{word} {values}" + (" " if header else ""))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def reference_vectors(path: Path, names: list[str]) -> np.ndarray:
    """float64 (C, D): each name's lower-cased words' vectors summed, parsed here from the file (the first
    line of a word listed twice), L2-normalised."""
    table: dict[str, np.ndarray] = {}
    lines = [line.rstrip(" ").split(" ") for line in path.read_text(encoding="utf-8").splitlines()]
    if len(lines[0]) == 2:  # fastText's header
        lines = lines[1:]
    dim = len(lines[0]) - 1
    for word, *values in lines:
        if len(values) == dim:  # not the word holding spaces
            table.setdefault(word, np.array([float(value) for value in values], dtype=np.float64))
    rows = [sum(table[w] for w in re.split(r"[_\-\s]+", name.lower()) if w) for name in names]
    return unit_rows(np.stack(rows))


@pytest.mark.parametrize("header", [False, True], ids=["glove", "fasttext"])
def test_vectors_equal_a_float64_reference(tmp_path, header):
    path = write_vectors(tmp_path / "vectors.txt", header=header)
    expected = reference_vectors(path, NAMES)
    raw = WordVectorsEncoder(path).encode(NAMES)
    assert raw.dtype == torch.float64
    np.testing.assert_allclose(unit_rows(raw.numpy()), expected, rtol=0, atol=1e-12)
    embeddings = class_embeddings(text_config("vectors", path=str(path)), NAMES)
    assert embeddings.shape == (len(NAMES), 5)
    np.testing.assert_allclose(embeddings.numpy(), expected, rtol=0, atol=1e-6)


def encode_message(path: Path | str, names: list[str]) -> str:
    """What :meth:`WordVectorsEncoder.encode` says of ``path``: ``"ok"`` or its error's message."""
    try:
        WordVectorsEncoder(path).encode(names)
    except (ConfigError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def assert_one_line(path: Path | str, names: list[str], *expected: str, memory_mb: int = 128) -> str:
    """The read of ``path`` under a memory cap and a time limit is one line holding each of ``expected``."""
    outcome = bounded(encode_message, path, names, memory_mb=memory_mb, seconds=10)
    assert not outcome.escaped and outcome.error is None, outcome
    message = outcome.value
    assert message != "ok" and "\n" not in message and "\x1b" not in message, message
    for part in expected:
        assert part in message, message
    return message


@pytest.mark.slow
def test_missing_words_are_one_line_naming_them_all(tmp_path):
    path = write_vectors(tmp_path / "vectors.txt")
    assert_one_line(
        path, ["blue_zebra", "okapi-cat", "zebra"], "has no vector for 2 words", "'zebra', 'okapi'", str(path)
    )
    many = [f"word{i}" for i in range(25)]
    message = assert_one_line(path, many, "has no vector for 25 words", "'word19' and 5 more")
    assert "'word20'" not in message


@pytest.mark.slow
def test_a_word_vector_file_of_control_characters_is_quoted_escaped(tmp_path):
    path = tmp_path / "vectors.txt"
    path.write_text("blue 1 2 3\nred\x1b[2J\x07 1 2\n", encoding="utf-8")
    assert_one_line(path, ["red"], "line 2 ('red\\x1b[2J\\x07') has 2 values; expected 3")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("blue 1 2 3\nred 1 2\n", "line 2 ('red') has 2 values; expected 3"),
        ("blue 1 2 3\nred 1 2 3 4\n", "line 2 ('red') has 4 values; expected 3"),
        ("2 4\nblue 1 2 3 4 \nred 1 2 3 \n", "line 3 ('red') has 3 values; expected 4"),
        ("blue 1 2 3\nred 1 nan 3\n", "line 2 ('red') holds 'nan'; expected finite numbers"),
        ("blue 1 2 3\nred 1 -inf 3\n", "expected finite numbers"),
        ("blue 1 2 3\nred 1 2 3x\n", "holds '3x'; expected numbers"),
        ("blue\n", "expected a word and 1 to 4096 values a line"),
    ],
    ids=["short", "long", "header", "nan", "inf", "not-a-number", "no-values"],
)
def test_a_malformed_word_vector_file_is_one_line(tmp_path, content, expected):
    path = tmp_path / "vectors.txt"
    path.write_text(content, encoding="utf-8")
    assert_one_line(path, ["blue", "red"], expected)


@pytest.mark.slow
@pytest.mark.parametrize("line", [1, 2])
def test_a_huge_line_is_refused_without_reading_it_whole(tmp_path, line):
    """A line of 64 MiB without a newline, under a 32 MiB memory cap."""
    path = tmp_path / "vectors.txt"
    with path.open("wb") as file:
        if line == 2:
            file.write(b"blue 1 2 3\n")
        file.truncate(file.tell() + 64 * MAX_LINE_BYTES)  # zero bytes, sparse: cheap to write
    assert_one_line(path, ["red"], f"line {line} is over 1 MiB", memory_mb=32)


@pytest.mark.slow
def test_a_pipe_a_device_a_missing_or_oversized_file_are_one_line(tmp_path):
    fifo = tmp_path / "vectors.txt"
    os.mkfifo(fifo)
    assert_one_line(fifo, ["blue"], "is a pipe (FIFO); expected a regular file")
    assert_one_line("/dev/zero", ["blue"], "is a character device; expected a regular file")
    assert_one_line(tmp_path / "absent.txt", ["blue"], "no file", "absent.txt")
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as file:
        file.truncate(9 * 2**30)  # sparse
    assert_one_line(huge, ["blue"], "a word-vector file of at most 8192.0 MiB expected")


@pytest.mark.slow
def test_memory_is_bounded_by_the_class_list_not_the_file(tmp_path):
    """A 40 MB file of 200,000 words, the one word asked for last, read under a 16 MiB memory cap."""
    values = " ".join(["0.123456"] * 24)
    path = tmp_path / "vectors.txt"
    lines = [f"w{i} {values}" for i in range(200_000)] + [f"cat {' '.join(['1.5'] * 24)}"]
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size > 40 * 10**6
    outcome = bounded(lambda: WordVectorsEncoder(path).encode(["cat"]).tolist(), memory_mb=16, seconds=10)
    assert not outcome.escaped and outcome.error is None, outcome
    assert outcome.value == [[1.5 * 1] * 24]


@pytest.mark.slow
def test_vectors_of_1e300_keep_their_direction(tmp_path):
    """A finite word vector whose squares overflow float64: its class's embedding is the vector divided by
    its norm computed in 50-digit decimals (the code before this gave a row of zeros)."""
    path = tmp_path / "vectors.txt"
    path.write_text("blue 1e300 -2e300 3e299\nred 1e-310 0 -3e-310\n")
    cfg = text_config("vectors", path=str(path))
    outcome = bounded(lambda: class_embeddings(cfg, ["blue", "red"]).tolist(), memory_mb=64, seconds=10)
    assert not outcome.escaped and outcome.error is None, outcome
    expected = decimal_unit_rows([[1e300, -2e300, 3e299], [1e-310, 0.0, -3e-310]])
    np.testing.assert_allclose(outcome.value, expected.numpy(), rtol=0, atol=1e-7)


@pytest.mark.slow
def test_vectors_of_distinct_words_cost_no_memory_of_their_own(tmp_path):
    """2,000 distinct words of 8 names, 512 values each (a 2 MB file): 8 MB as a vector per word (the code
    before this held one), the 8 rows that sum them as they are read; under a 4 MB cap."""
    words = ["".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=3)][:2000]
    names = ["_".join(words[start : start + 250]) for start in range(0, 2000, 250)]
    path = tmp_path / "vectors.txt"
    path.write_text("".join(f"{word} {' '.join(['1'] * 511)} {index}\n" for index, word in enumerate(words)))
    outcome = bounded(lambda: WordVectorsEncoder(path).encode(names).numpy(), memory_mb=4, seconds=20)
    assert not outcome.escaped and outcome.error is None, outcome
    expected = np.array([[250.0] * 511 + [sum(range(start, start + 250))] for start in range(0, 2000, 250)])
    np.testing.assert_array_equal(outcome.value, expected)


# --------------------------------------------------------------------------------------------- sentence

VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "blue", "triangle", "traffic", "light", "t", "-"]


@pytest.fixture(scope="module")
def sentence_folder(tmp_path_factory) -> Path:
    """A tiny randomly initialised BERT (1 layer, width 16) with a WordPiece tokenizer and mean pooling,
    saved as a sentence-transformers folder (safetensors weights)."""
    library = pytest.importorskip("sentence_transformers", reason="text=sentence needs mlcls[sentence]")
    transformers = pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("bert")
    (base / "vocab.txt").write_text("\n".join(VOCABULARY) + "\n")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCABULARY),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    transformers.BertModel(config).save_pretrained(base)
    transformers.BertTokenizerFast(vocab_file=str(base / "vocab.txt")).save_pretrained(base)
    modules = library.sentence_transformer.modules
    word = modules.Transformer(str(base))
    model = library.SentenceTransformer(
        modules=[word, modules.Pooling(word.get_embedding_dimension(), "mean")]
    )
    folder = tmp_path_factory.mktemp("sentence") / "model"
    model.save(str(folder))
    return folder


@pytest.mark.slow  # over 2 s of the fast run's time
def test_sentence_equals_the_library_s_own_encode(sentence_folder, monkeypatch):
    library = pytest.importorskip("sentence_transformers")
    reference = library.SentenceTransformer(str(sentence_folder), device="cpu").encode(
        ["Blue triangle", "traffic light", "t-shirt"], convert_to_numpy=True
    )
    expected = unit_rows(reference.astype(np.float64))

    def no_network(*args, **kwargs):
        raise AssertionError("a text source reached the network")

    monkeypatch.setattr("socket.socket.connect", no_network)
    embeddings = class_embeddings(text_config("sentence", path=str(sentence_folder)), NAMES[:3])
    assert embeddings.shape == (3, 16)
    np.testing.assert_allclose(embeddings.numpy(), expected, rtol=0, atol=1e-6)


def sentence_message(path: Path | str) -> str:
    """What ``text=sentence`` says of the folder ``path``: ``"ok"`` or its error's message."""
    from mlcls.text.sentence import SentenceEncoder

    try:
        SentenceEncoder(path).encode(["blue"])
    except ConfigError as exc:
        return str(exc)
    return "ok"


@pytest.mark.slow
def test_sentence_refuses_a_hub_name_pickles_foreign_code_and_pipes(tmp_path):
    """Each refused before the library is imported: one line, under a memory cap and a time limit."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    cases = [
        ("sentence-transformers/all-MiniLM-L6-v2", None, "is not a local folder"),
        (folder, ("pytorch_model.bin", b"\x80\x04."), "holds the pickle file 'pytorch_model.bin'"),
        (
            folder,
            ("modules.json", b'[{"path": "", "type": "evil.Module"}]'),
            "names the module 'evil.Module'",
        ),
        (folder, ("modules.json", b'[{"path": "../x", "type": "sentence_transformers.X"}]'), "'../x'"),
        (folder, ("tokenizer.json", None), "'tokenizer.json' is not a regular file"),
    ]
    for path, extra, expected in cases:
        if extra is not None:
            for stale in folder.iterdir():
                if stale.name != "model.safetensors":
                    stale.unlink()
            if extra[1] is None:
                os.mkfifo(folder / extra[0])
            else:
                (folder / extra[0]).write_bytes(extra[1])
        outcome = bounded(sentence_message, path, memory_mb=256, seconds=10)
        assert not outcome.escaped and outcome.error is None, outcome
        assert expected in outcome.value and "\n" not in outcome.value, outcome.value
    (folder / "model.safetensors").unlink()
    (folder / "tokenizer.json").unlink()
    assert "holds no .safetensors file" in sentence_message(folder)


@pytest.mark.slow
def test_modules_json_names_only_the_library_s_module_classes(sentence_folder, tmp_path):
    """A name under sentence_transformers.* that is no module class of the library (the code before this
    passed it: import_from_string, a function, ended in an AttributeError traceback) is one line; the
    library's classes by their names of before 6.0 still load."""
    folder = tmp_path / "model"
    shutil.copytree(sentence_folder, folder)
    modules = json.loads((folder / "modules.json").read_text())
    cases = [
        ("sentence_transformers.util.misc.import_from_string", "names 'sentence_transformers.util.misc.im"),
        ("sentence_transformers.SentenceTransformer", "not a module class of sentence-transformers"),
        ("sentence_transformers.no_such_module.Pooling", "not a module class of sentence-transformers"),
        ("sentence_transformers.models.Pooling", "ok"),
    ]
    for kind, expected in cases:
        modules[1]["type"] = kind
        (folder / "modules.json").write_text(json.dumps(modules))
        outcome = bounded(sentence_message, folder, memory_mb=1024, seconds=30)
        assert not outcome.escaped and outcome.error is None, (kind, outcome)
        assert expected in outcome.value and "\n" not in outcome.value, (kind, outcome.value)


# ------------------------------------------------------------------------------------------------- clip

TINY_CLIP = "mlcls-tiny-clip"


@pytest.fixture(scope="module")
def clip_model(tmp_path_factory):
    """A tiny randomly initialised open_clip CLIP (text tower: 1 layer, width 16, 16 tokens; embeddings 8
    wide), registered under :data:`TINY_CLIP`; the model and its tokenizer."""
    open_clip = pytest.importorskip("open_clip", reason="text=clip needs mlcls[clip]")
    configs = tmp_path_factory.mktemp("clip_configs")
    config = {
        "embed_dim": 8,
        "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
    }
    (configs / f"{TINY_CLIP}.json").write_text(json.dumps(config))
    open_clip.add_model_config(configs / f"{TINY_CLIP}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_CLIP, pretrained=None).eval()
    return model, open_clip.get_tokenizer(TINY_CLIP)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_clip_equals_the_library_s_own_encode_text(clip_model, tmp_path, suffix, monkeypatch):
    model, tokenizer = clip_model
    path = tmp_path / f"open_clip_model{suffix}"
    if suffix == ".pt":  # as open_clip's training saves it: wrapped, DistributedDataParallel's prefix
        torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)
    else:
        from safetensors.torch import save_file

        save_file(model.state_dict(), path)
    prompts = ["a photo of a Blue triangle", "a photo of a traffic light", "a photo of a t-shirt"]
    with torch.no_grad():
        expected = unit_rows(model.encode_text(tokenizer(prompts)).double().numpy())

    def no_network(*args, **kwargs):
        raise AssertionError("a text source reached the network")

    monkeypatch.setattr("socket.socket.connect", no_network)
    cfg = text_config("clip", path=str(path), model=TINY_CLIP)
    embeddings = class_embeddings(cfg, NAMES[:3])
    assert embeddings.shape == (3, 8)
    np.testing.assert_allclose(embeddings.numpy(), expected, rtol=0, atol=1e-6)


def clip_message(path: Path, model: str) -> str:
    """What ``text=clip`` says of the checkpoint ``path`` for ``model``: ``"ok"`` or its error's message."""
    from mlcls.text.clip import ClipEncoder

    try:
        ClipEncoder(path, model).encode(["blue"])
    except (ConfigError, OSError, ValueError) as exc:
        return str(exc)
    return "ok"


@pytest.mark.slow
def test_clip_refuses_a_foreign_checkpoint_a_pickle_and_a_remote_name_in_one_line(clip_model, tmp_path):
    from mlcls.text.clip import ClipEncoder

    model, _ = clip_model
    text_only = {k: v for k, v in model.state_dict().items() if k != "ln_final.weight"}
    torch.save({**text_only, "extra.weight": torch.zeros(1)}, tmp_path / "foreign.pt")
    (tmp_path / "pickled.pt").write_bytes(pickle.dumps({"w": 1}))
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 64)
    cases = [
        ("foreign.pt", TINY_CLIP, "lacks 'ln_final.weight'"),
        ("pickled.pt", TINY_CLIP, "not a zip archive"),
        ("list.pt", TINY_CLIP, "holds no state dict"),
        ("bad.safetensors", TINY_CLIP, "cannot be read as weights"),
        ("absent.pt", TINY_CLIP, "no file"),
        ("foreign.pt", "no-such-model", "is not an open_clip model"),
    ]
    for name, model_name, expected in cases:
        outcome = bounded(clip_message, tmp_path / name, model_name, memory_mb=512, seconds=20)
        assert not outcome.escaped and outcome.error is None, outcome
        assert expected in outcome.value and "\n" not in outcome.value, outcome.value
    with pytest.raises(ConfigError, match="hf-hub: and local-dir: names are not read"):
        ClipEncoder("x.pt", "hf-hub:timm/ViT-B-32")


# ------------------------------------------------------------------------------------------------ local


def test_a_missing_extra_is_one_line_naming_it():
    from mlcls.text import require

    with pytest.raises(ConfigError, match=r"pip install 'mlcls\[clip\]'") as caught:
        require("mlcls_no_such_package", "clip", "clip")
    assert "\n" not in str(caught.value)


def test_offline_holds_the_hub_offline_then_restores_it(monkeypatch):
    from mlcls.text import OFFLINE_VARIABLES, offline

    for name in OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    constants = pytest.importorskip("huggingface_hub.constants")
    before = constants.HF_HUB_OFFLINE
    with offline():
        assert all(os.environ[name] == "1" for name in OFFLINE_VARIABLES)
        assert constants.HF_HUB_OFFLINE is True
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "TRANSFORMERS_OFFLINE" not in os.environ
    assert constants.HF_HUB_OFFLINE is before
