"""mlcls-eval with dataset.unseen_classes on a checkpoint whose head has no text queries: one line."""

from __future__ import annotations

import sys

import pytest
from test_inference_support import trained_run

from mlcls.cli import eval as eval_cli


@pytest.mark.slow
def test_a_checkpoint_without_text_queries_is_refused_in_one_line(tmp_path_factory, monkeypatch, capsys):
    checkpoint = trained_run(tmp_path_factory) / "checkpoints" / "last.pt"
    argv = ["mlcls-eval", f"checkpoint={checkpoint}", "dataset.unseen_classes=[red_circle]", "device=cpu"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "model.head='linear', without text queries" in err and "mldecoder_zsl or cosine" in err
