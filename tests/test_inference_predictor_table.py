"""The predict table shows class names and file names from others with their control characters escaped;
the JSON lines keep them exact."""

from __future__ import annotations

import json
import math
import sys
import unicodedata

import pytest
import torch
from inference_fixtures import trained_run, write_images

from mlcls.cli import predict as predict_cli
from mlcls.inference.predictor import Prediction, format_table, printable

# Names that drive a terminal or forge rows: an OSC title sequence ended by BEL, an ANSI colour (ESC [),
# the C1 CSI (U+009B), a newline starting a fake row, a carriage return, a right-to-left override and a
# line separator; and, as the control, printable non-ASCII names.
HOSTILE = {
    "\x1b]0;PWNED\x07cat": r"\x1b]0;PWNED\x07cat",
    "\x1b[31mred": r"\x1b[31mred",
    "\x9b2Jwipe": r"\x9b2Jwipe",
    "dog\nfake.png  cat 0.999": r"dog\nfake.png  cat 0.999",
    "over\rwrite": r"over\rwrite",
    "txt.\u202egnp": r"txt.\u202egnp",
    "line\u2028break": r"line\u2028break",
    "chat_été": "chat_été",
    "猫": "猫",
}


def terminal_controls(text: str) -> list[str]:
    """The characters of ``text`` outside Unicode's printable ones, newlines included."""
    return [char for char in text if unicodedata.category(char)[0] in "CZ" and char != " "]


def test_printable_escapes_exactly_the_characters_that_are_not_printable():
    for name, shown in HOSTILE.items():
        assert printable(name) == shown


def test_the_table_escapes_class_and_file_names():
    names = list(HOSTILE)
    predictions = [
        Prediction("photos/a\x1b[2Jb.jpg", [(name, 0.5) for name in names]),
        Prediction("photos/plain.jpg", []),
    ]
    lines = format_table(predictions).split("\n")
    assert len(lines) == 3
    assert all(terminal_controls(line) == [] for line in lines)
    assert lines[1] == r"photos/a\x1b[2Jb.jpg  " + "  ".join(f"{HOSTILE[name]} 0.500" for name in names)
    assert lines[2] == "photos/plain.jpg      -"


@pytest.mark.slow
def test_mlcls_predict_table_is_escaped_and_its_json_lines_exact(
    tmp_path, tmp_path_factory, monkeypatch, capsys
):
    run_dir = trained_run(tmp_path_factory)
    state = torch.load(run_dir / "calibrated.pt", weights_only=False)
    classes = list(HOSTILE)[:7] + state["classes"][7:]
    thresholds = torch.full((len(classes),), -math.inf, dtype=torch.float64)  # every class: always
    checkpoint = tmp_path / "hostile.pt"
    torch.save({**state, "classes": classes, "thresholds": thresholds}, checkpoint)
    image = write_images(tmp_path / "photos", count=1)[0]
    out = tmp_path / "predictions.jsonl"
    monkeypatch.chdir(tmp_path)
    argv = ["mlcls-predict", f"checkpoint={checkpoint}", f"images={image}", f"out={out}"]
    monkeypatch.setattr(sys, "argv", argv)
    predict_cli.main()
    table, err = capsys.readouterr()
    assert terminal_controls(table.replace("\n", "")) == [] and terminal_controls(err.replace("\n", "")) == []
    rows = table.strip("\n").split("\n")
    assert len(rows) == 2
    for name in classes[:7]:
        assert f"  {HOSTILE[name]} " in rows[1]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(label["label"] for label in record["labels"]) == sorted(classes)


@pytest.mark.parametrize("name", ["\x00", "\x7f", "\x85", "\u200b", "\ufeff"])
def test_other_invisible_characters_are_escaped(name):
    assert printable(name) == name.encode("unicode_escape").decode("ascii")
    assert printable(name).isascii() and printable(name).isprintable()
