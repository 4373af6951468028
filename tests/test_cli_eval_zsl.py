"""mlcls-eval with dataset.unseen_classes on a checkpoint whose head has no text queries: one line."""

from __future__ import annotations

import sys

import pytest
from inference_fixtures import trained_run

from mlcls.cli import eval as eval_cli


@pytest.mark.slow
def test_a_checkpoint_without_text_queries_is_refused_in_one_line(tmp_path_factory, monkeypatch, capsys):
    checkpoint = trained_run(tmp_path_factory) / "checkpoints" / "last.pt"
    argv = ["mlcls-eval", f"checkpoint={checkpoint}", "dataset.unseen_classes=[red_circle]", "device=cpu"]
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()  # what training the shared run printed (the first test to ask for it trains it)
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "model/head='linear', without text queries" in err and "mldecoder_zsl or cosine" in err


def test_zero_shot_of_a_model_trained_on_every_class_reports_the_named_columns() -> None:
    """A model trained on all classes (the reference of a zero-shot run): the ZSL figures of the named
    columns, its own class embeddings kept (nothing to switch)."""
    import torch
    from torch import nn

    from mlcls.engine.evaluate import ZeroShot, evaluate

    class Loader(list):
        """Batches with the ``dataset`` an evaluation counts its samples by."""

        dataset = range(8)

    zero_shot = ZeroShot.of(["a", "b", "c"], ["a", "b", "c"], None, ["c", "a"])
    assert zero_shot.unseen.tolist() == [True, False, True] and zero_shot.embeddings is None
    assert zero_shot.trained.tolist() == [0, 1, 2]
    # no text head needed: the model's own classes are evaluated, the ZSL figures of the named columns
    model = nn.Linear(2, 3)
    images, labels = torch.randn(8, 2), torch.tensor([[1, 0, 1], [0, 1, 0]] * 4)
    loader = Loader([(images, labels)])
    evaluation = evaluate(model, loader, torch.device("cpu"), ["a", "b", "c"], zero_shot=zero_shot)
    assert evaluation.metrics["zsl"]["classes"] == 2 and evaluation.metrics["gzsl"]["classes"] == 3
    assert ZeroShot.of(["a", "b"], ["a", "b"], None) is None
    with pytest.raises(ValueError, match="lacks 1 trained class"):
        ZeroShot.of(["a", "z"], ["a", "b"], {"_target_": "x"})


def test_a_stored_text_config_names_an_mlcls_text_encoder_or_nothing_is_called(tmp_path) -> None:
    """Without trust_checkpoint the unseen classes are embedded by the checkpoint's text record as
    :func:`mlcls.text.encoder_from_stored` checks it (old: any ``_target_`` of the stored config was called:
    ``os.makedirs`` made its folder, then the result was refused as no encoder)."""
    from types import SimpleNamespace

    from mlcls.errors import ConfigError

    made = tmp_path / "made_by_the_checkpoint"
    crafted = {"_target_": "os.makedirs", "name": str(made)}
    inference = SimpleNamespace(
        config={"text": crafted},
        classes=["a"],
        checkpoint="crafted.pt",
        text={"source": "x", "config": crafted},
    )
    with pytest.raises(
        ConfigError, match=r"^the text config's _target_ is 'os.makedirs'; expected a text enc"
    ):
        eval_cli.unseen_text_source(inference, trust=False)
    inference.text = None
    with pytest.raises(ConfigError, match=r"^crafted.pt holds no text source \('text'\) to embed the unseen"):
        eval_cli.unseen_text_source(inference, trust=False)
    assert not made.exists()
