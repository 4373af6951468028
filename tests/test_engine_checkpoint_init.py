"""model.init_from: fine-tuning starts from an mlcls checkpoint; where its classes differ, the head starts
afresh and the rest of the network is the file's."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import TINY, compose_config

from mlcls.engine.checkpoint import init_from_checkpoint, save_checkpoint
from mlcls.engine.config_checks import check_config
from mlcls.errors import ConfigError
from mlcls.inference.predictor import load_inference_model
from mlcls.models import create_model


def write_checkpoint(path, classes: list[str], name: str = "resnet10t", head: str = "linear") -> dict:
    """An mlcls checkpoint of ``name`` with a ``head`` head over ``classes``, random weights."""
    torch.manual_seed(123)
    model = create_model(
        name, len(classes), pretrained=False, head=head, **({"num_groups": 4} if head == "mldecoder" else {})
    )
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    config = {"model": {"name": name, "head": head, "num_groups": 4}}
    save_checkpoint({"model": weights, "classes": classes, "config": config}, path)
    return weights


@pytest.mark.parametrize("head", ["linear", "mldecoder"])
def test_same_classes_load_every_weight_other_classes_reinitialise_the_head(tmp_path, caplog, head):
    path = tmp_path / "start.pt"
    stored = write_checkpoint(path, ["cat", "dog", "bird"], head=head)
    torch.manual_seed(0)
    model = create_model(
        "resnet10t", 3, pretrained=False, head=head, **({"num_groups": 4} if head == "mldecoder" else {})
    )
    init_from_checkpoint(model, str(path), ["cat", "dog", "bird"])
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, stored[key], atol=0, rtol=0, msg=key)

    head_prefix = "fc." if head == "linear" else "head."
    for classes in (["a", "b"], ["dog", "cat", "bird"]):  # another count; the same count in another order
        torch.manual_seed(0)
        model = create_model(
            "resnet10t",
            len(classes),
            pretrained=False,
            head=head,
            **({"num_groups": 4} if head == "mldecoder" else {}),
        )
        fresh = {key: value.clone() for key, value in model.state_dict().items()}
        with caplog.at_level(logging.INFO, logger="mlcls"):
            init_from_checkpoint(model, str(path), classes)
        assert "the head is re-initialised" in caplog.text
        assert len([r for r in caplog.records if "re-initialised" in r.message]) == 1
        caplog.clear()
        for key, value in model.state_dict().items():
            expected = fresh[key] if key.startswith(head_prefix) else stored[key]
            torch.testing.assert_close(value, expected, atol=0, rtol=0, msg=key)


def test_a_checkpoint_of_another_network_is_refused_naming_the_weight(tmp_path):
    path = tmp_path / "start.pt"
    write_checkpoint(path, ["a", "b"], name="resnet10t")
    model = create_model("resnet18", 2, pretrained=False)
    with pytest.raises(
        ConfigError,
        match=r"model.init_from=.*: conv1.weight \(64, 3, 7, 7\) of this run's model "
        r"is not in the file; the file holds resnet10t with a linear head",
    ):
        init_from_checkpoint(model, str(path), ["a", "b"])


def test_check_config_refuses_a_missing_file():
    cfg = compose_config([*TINY, "model.init_from=/no/such/file.pt"])
    with pytest.raises(ConfigError, match="model.init_from='/no/such/file.pt': no such checkpoint file"):
        check_config(cfg, world_size=1)


@pytest.mark.slow
def test_training_starts_from_an_imported_checkpoint_and_its_checkpoint_predicts(tmp_path):
    """mlcls-train model.init_from=...: the synthetic dataset's classes are not the file's, so the head
    starts afresh; the run's checkpoint (whose config names init_from) loads for prediction."""
    from mlcls.cli.train import run

    start = tmp_path / "start.pt"
    stored = write_checkpoint(start, ["x", "y", "z"])
    overrides = [*TINY, "trainer.epochs=1", "optim.lr_backbone=0.0", "optim.weight_decay=0.0"]
    overrides += ["dataset.train_size=64", "dataset.val_size=32", "model.name=resnet10t"]  # the file's
    run(compose_config([*overrides, f"model.init_from={start}"]), run_dir=tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    inference = load_inference_model(checkpoint, "cpu")
    assert inference.config["model"]["init_from"] == str(start)
    # the backbone did not move (learning rate 0, no decay): it is the file's; BatchNorm statistics aside
    for key, value in inference.model.state_dict().items():
        if not key.startswith("fc.") and "running_" not in key and "num_batches" not in key:
            torch.testing.assert_close(value, stored[key], atol=0, rtol=0, msg=key)
