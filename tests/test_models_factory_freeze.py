"""model.freeze_backbone: the head trains alone on the backbone's features (linear probing)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from conftest import TINY, compose_config

from mlcls.engine.config_checks import check_config
from mlcls.engine.trainer import Trainer
from mlcls.errors import ConfigError
from mlcls.inference.predictor import load_inference_model
from mlcls.models.factory import backbone_in_eval


def head_names(model: torch.nn.Module) -> set[str]:
    """Names, in ``model.state_dict()``, of the parameters and buffers of timm's ``get_classifier()``."""
    head = model.get_classifier()
    inside = {id(t) for t in [*head.parameters(), *head.buffers()]}
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name for name, tensor in named if id(tensor) in inside}


@pytest.mark.parametrize("head", ["linear", "csra"])
@pytest.mark.slow
def test_the_backbone_stays_bit_for_bit_and_the_head_learns(tmp_path, head: str) -> None:
    cfg = compose_config([*TINY, f"model/head={head}", "model.freeze_backbone=true"])
    trainer = Trainer(cfg, run_dir=tmp_path)
    model = trainer.model
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    heads = head_names(model)
    assert optimized == {id(p) for p in model.get_classifier().parameters()}
    assert all(g["name"].startswith("head") for g in trainer.optimizer.param_groups)
    results = trainer.fit()
    after = model.state_dict()
    backbone = [name for name in before if name not in heads]
    # every backbone weight and batch-norm statistic (running mean, var, count) as it was
    assert any("running_mean" in name for name in backbone)
    assert all(torch.equal(before[name], after[name]) for name in backbone)
    assert all(not torch.equal(before[name], after[name]) for name in heads if "weight" in name)
    assert all(p.grad is None for name, p in model.named_parameters() if name not in heads)
    assert results["metrics"]["mAP_class"] > 0
    # the checkpoint is the network's, with the key in its config: predict builds it as any other
    inference = load_inference_model(tmp_path / "checkpoints" / "best.pt", device="cpu")
    assert inference.config["model"]["freeze_backbone"] is True
    assert torch.equal(inference.model.state_dict()[backbone[0]], before[backbone[0]])


@pytest.mark.slow
def test_backbone_in_eval_leaves_the_head_and_the_root_training() -> None:
    cfg = compose_config([*TINY, "model/head=mldecoder", "model.freeze_backbone=true"])
    model = Trainer(cfg).model.train()
    backbone_in_eval(model)
    head = {id(m) for m in model.get_classifier().modules()}
    assert model.training and all(m.training for m in model.get_classifier().modules())
    assert not any(m.training for m in model.modules() if m is not model and id(m) not in head)


@pytest.mark.slow
def test_without_it_every_parameter_trains(tmp_path) -> None:
    trainer = Trainer(compose_config([*TINY]), run_dir=tmp_path)
    optimized = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
    assert optimized == sum(p.numel() for p in trainer.model.parameters())


@pytest.mark.parametrize(("value", "shown"), [("yes", "'yes'"), ("1", "1")])
def test_a_bad_value_is_one_line(value: str, shown: str) -> None:
    message = f"model.freeze_backbone={shown}; expected true (train the head alone) or false"
    cfg = compose_config([*TINY, f"model.freeze_backbone={value}"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(cfg, world_size=1)


ROLE = [
    *TINY,
    "trainer.epochs=1",
    "loss=role",
    "loss.expected_positives=2",
    "dataset.observed=single_positive",
]


@pytest.mark.slow
def test_linear_init_carries_the_classifier_and_the_label_estimates(tmp_path, caplog) -> None:
    """Cole et al.'s LinearInit in two runs: the head alone on a frozen backbone, then end to end from its
    best.pt, ROLE's label estimates (and which samples were seen) continuing from that epoch's."""
    Trainer(compose_config([*ROLE, "model.freeze_backbone=true"]), run_dir=tmp_path / "linear").fit()
    best = torch.load(tmp_path / "linear" / "checkpoints" / "best.pt", weights_only=True)
    assert set(best["loss"]) == {"label_logits", "seen"} and best["loss"]["seen"].all()
    start = [*ROLE, f"model.init_from={tmp_path / 'linear' / 'checkpoints' / 'best.pt'}"]
    with caplog.at_level(logging.INFO, logger="mlcls"):
        trainer = Trainer(compose_config([*start]), run_dir=tmp_path / "end_to_end")
    state = trainer.criterion.state_dict()
    assert all(torch.equal(state[key], best["loss"][key]) for key in best["loss"])
    assert torch.equal(trainer.model.state_dict()["fc.weight"], best["model"]["fc.weight"])
    assert "the loss's state (label_logits, seen) continues from the file" in caplog.text
    assert all(p.requires_grad for p in trainer.model.parameters())

    # another training set (its rows are other samples): the estimates start afresh, said in one line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlcls"):
        other = Trainer(compose_config([*start, "dataset.train_size=160"]), run_dir=tmp_path / "o")
    assert not other.criterion.state_dict()["seen"].any()
    assert "the loss's state starts afresh" in caplog.text
