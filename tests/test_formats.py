"""The one layout number of checkpoints and packs (mlcls/formats.py): what a reader accepts, upgrades and
refuses, each refusal in one line."""

from __future__ import annotations

import re

import pytest
import torch

from mlcls.data.datasets.base import DatasetFormatError
from mlcls.engine.checkpoint import load_checkpoint, save_checkpoint
from mlcls.engine.state import CheckpointError
from mlcls.formats import FORMAT, upgrade


def written(tmp_path, **state):
    """A checkpoint file holding ``state`` as torch.save writes it, without save_checkpoint's format."""
    path = tmp_path / "last.pt"
    torch.save({"model": {"w": torch.zeros(2)}, **state}, path)
    return path


def test_a_checkpoint_written_now_holds_the_current_format(tmp_path):
    save_checkpoint({"model": {}}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["format"] == FORMAT == 2


def test_a_format_1_checkpoint_is_read_with_its_config_keys_renamed(tmp_path):
    old = {"dataset": {"name": "csv", "holdout": "stratified"}, "sched": {"warmup_iters": 5}}
    state = load_checkpoint(written(tmp_path, config=old))  # no "format" key: the layout of 1
    assert state["format"] == 2
    assert state["config"]["dataset"] == {"name": "csv", "val_by": "stratified"}
    assert "warmup_iters" not in state["config"]["sched"]


@pytest.mark.parametrize("stored", [3, "2", True, 0, 2.0, None])
def test_a_checkpoint_of_another_format_is_one_line(tmp_path, stored):
    path = written(tmp_path, format=stored)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert message == (
        f"checkpoint {path} is of checkpoint format {stored!r}; this mlcls reads formats 1 to 2 "
        "(a newer mlcls wrote it: upgrade mlcls)"
    )


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ({}, "m.json is of pack format 1, this mlcls reads format 2; pack the dataset again"),
        ({"format": 1}, "m.json is of pack format 1, this mlcls reads format 2; pack the dataset again"),
        ({"format": 7}, "m.json is of pack format 7; this mlcls reads formats 1 to 2 (a newer mlcls"),
    ],
)
def test_a_pack_manifest_of_another_format_is_one_line(manifest, message):
    with pytest.raises(DatasetFormatError, match=f"^{re.escape(message)}"):
        upgrade(manifest, "pack", "m.json", DatasetFormatError)


def test_a_current_pack_manifest_comes_back_unchanged():
    manifest = {"format": 2, "train": {"samples": 3}}
    assert upgrade(dict(manifest), "pack", "m.json", DatasetFormatError) == manifest
