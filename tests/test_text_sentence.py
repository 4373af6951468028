"""The checks of a sentence-transformers model folder (``text=sentence``) before the library sees it: the
folder is walked with its links followed, a link leaving it or looping back refused, its depth bounded, each
file reached a regular file and no pickle. The folders here are not models: the checks read no weights, and
the library is not imported. Each is checked under a memory cap and a time limit (tests/hostile.py)."""

from __future__ import annotations

import inspect
import json
import os
import random
import sys
from pathlib import Path

import pytest
from hostile import bounded

from mlcls.errors import ConfigError
from mlcls.text import sentence
from mlcls.text.sentence import MAX_FOLDER_DEPTH, check_model_folder

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


def model_folder(folder: Path) -> Path:
    """A folder laid out as a saved model (empty weights, a tokenizer, a pooling module in 1_Pooling)."""
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "modules.json").write_text(json.dumps(MODULES))
    return folder


def checked(path: Path) -> str:
    """What the folder check says of ``path``: ``"ok"`` or its one-line error."""
    try:
        check_model_folder(path)
    except ConfigError as exc:
        return str(exc)
    return "ok"


def outside_fifo(root: Path) -> Path:
    """A folder outside the model whose config.json is a pipe (opening it blocks)."""
    (root / "elsewhere").mkdir()
    os.mkfifo(root / "elsewhere" / "config.json")
    return root / "elsewhere"


def _pooling_leaves(root: Path, folder: Path) -> str:
    os.rename(folder / "1_Pooling", root / "moved")
    (folder / "1_Pooling").symlink_to(outside_fifo(root), target_is_directory=True)
    return "'1_Pooling' links to"


def _file_leaves(root: Path, folder: Path) -> str:
    (root / "outside.json").write_text("{}")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(root / "outside.json")
    return "'tokenizer.json' links to"


def _loop(root: Path, folder: Path) -> str:
    (folder / "1_Pooling" / "up").symlink_to("..", target_is_directory=True)
    return "'1_Pooling/up' links to a folder holding it (a loop)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "change",
    [
        _pooling_leaves,
        _file_leaves,
        _loop,
    ],
)
def test_links_are_followed_and_a_link_leaving_the_folder_is_refused(tmp_path, change):
    folder = model_folder(tmp_path / "model")
    expected = change(tmp_path, folder)
    outcome = bounded(checked, folder, memory_mb=64, seconds=10)
    assert not outcome.escaped and outcome.error is None, outcome
    assert expected in outcome.value and "\n" not in outcome.value, outcome.value


def nested(folder: Path, depth: int, name: str = "d") -> Path:
    """``depth`` folders called ``name``, each in the one before, under ``folder``; the deepest."""
    path = folder.joinpath(*[name] * depth)
    path.mkdir(parents=True)
    return path


def checked_with_little_stack(path: Path, frames: int) -> str:
    """:func:`checked` with at most ``frames`` more Python frames than its caller's."""
    sys.setrecursionlimit(len(inspect.stack()) + frames)
    return checked(path)


@pytest.mark.slow
def test_a_folder_too_deep_is_one_line_not_a_recursion(tmp_path):
    """A folder 1,100 deep ended os.walk's recursion in a RecursionError traceback. Here 300 deep with 200
    frames of stack (a deep folder is slow to write), as 1,100 with Python's default 1,000: the walk stops
    at the first folder over the bound. A folder as deep as the bound passes."""
    folder = model_folder(tmp_path / "model")
    nested(folder, 300)
    outcome = bounded(checked_with_little_stack, folder, 200, memory_mb=64, seconds=10)
    assert not outcome.escaped and outcome.error is None, outcome
    assert outcome.value.endswith(
        f"'{'d/' * MAX_FOLDER_DEPTH}d' is over {MAX_FOLDER_DEPTH} folders deep; expected a model folder"
    )
    bound = model_folder(tmp_path / "bound")
    (nested(bound, MAX_FOLDER_DEPTH) / "x.json").write_text("{}")
    assert checked(bound) == "ok"


def mutate(root: Path, folder: Path, rng: random.Random) -> tuple[str, bool]:
    """One seeded change of the model ``folder`` (``root`` holds it, with room beside it): what it did and
    whether the check must refuse it."""
    harmful = ["leave", "leave file", "device", "loop", "fifo", "dangling"]
    how = rng.choice([*harmful, "deep", "entries", "inside", "inside", "file", "file"])
    subfolder = rng.choice([folder, folder / "1_Pooling"])
    name = f"x{rng.randrange(10**6)}"
    if how == "leave":
        (subfolder / name).symlink_to(outside_fifo(root) if rng.random() < 0.5 else root, True)
    elif how == "leave file":
        (subfolder / name).symlink_to(rng.choice(["/etc/hostname", "/proc/self/pagemap", "../../outside"]))
    elif how == "device":
        (subfolder / name).symlink_to(rng.choice(["/dev/zero", "/dev/null", "/dev/stdin"]))
    elif how == "loop":
        (subfolder / name).symlink_to(rng.choice([".", "..", str(folder)]), True)
        if subfolder == folder:  # "..": the link leaves
            how = "loop or leave"
    elif how == "fifo":
        os.mkfifo(subfolder / name)
    elif how == "deep":
        depth = rng.randint(1, 3 * MAX_FOLDER_DEPTH)
        nested(subfolder, depth, name)
        return f"{how} {depth}", depth + (subfolder != folder) > MAX_FOLDER_DEPTH
    elif how == "entries":
        count = rng.choice([10, sentence.MAX_FOLDER_ENTRIES])
        for index in range(count):
            (subfolder / f"{name}.{index}").write_bytes(b"")
        return f"{how} {count}", count == sentence.MAX_FOLDER_ENTRIES
    elif how == "inside":
        (subfolder / name).symlink_to(folder / "1_Pooling", True)
        return how, subfolder != folder  # inside 1_Pooling, a link to itself is a loop
    elif how == "file":
        (subfolder / f"{name}.json").write_bytes(rng.randbytes(rng.randrange(100)))
        return how, False
    else:
        (subfolder / name).symlink_to(f"{name}.absent")
    return how, True


def fuzz(root: Path, seeds: range) -> list[tuple[str, bool, str]]:
    """Each seed's mutation of a fresh model folder, whether it must be refused, and what the check says;
    the bound on a folder's entries lowered to 64 (a folder over it is then quick to write)."""
    sentence.MAX_FOLDER_ENTRIES = 64  # in the bounded child only
    results = []
    for seed in seeds:
        rng = random.Random(seed)
        case = root / str(seed)
        case.mkdir()
        folder = model_folder(case / "model")
        changes = [mutate(case, folder, rng) for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.5:  # the folder named through a link of its own
            (case / "link").symlink_to(folder, target_is_directory=True)
            folder = case / "link"
        try:
            said = checked(folder)
        except BaseException as exc:  # noqa: BLE001 - every escape is what the fuzzer reports
            said = f"escaped: {type(exc).__name__}: {exc}"
        results.append((", ".join(what for what, _ in changes), any(refuse for _, refuse in changes), said))
    return results


@pytest.mark.slow
def test_fuzzed_model_folders_pass_or_stop_with_one_line(tmp_path):
    """Seeded changes of a model folder (links leaving it to a pipe, a device or a pseudo-file, link loops,
    dangling links, pipes, deep folders, many files, links inside it, files), the folder named as it is or
    through a link: each is refused in one line if it must be, and passes otherwise, all under one memory
    cap and time limit."""
    outcome = bounded(fuzz, tmp_path, range(24), memory_mb=128, seconds=30)
    assert not outcome.escaped and outcome.error is None, outcome
    for what, refuse, said in outcome.value:
        assert said == "ok" or (said.startswith("text.path ") and "\n" not in said), (what, said)
        assert (said == "ok") == (not refuse), (what, said)
    refused = sum(refuse for _, refuse, _ in outcome.value)
    assert 0 < refused < len(outcome.value), outcome.value
