"""mlcls.reporting.runs: a run's departures from the paper's protocol, read from its resolved config."""

from __future__ import annotations

import copy

import pytest
from conftest import compose_config
from omegaconf import OmegaConf

from mlcls.reporting.runs import built_name, protocol_deviations

# Table 6 sizes (train, test), typed from the paper, so that the run follows the protocol exactly.
COCO_SIZES = {"train_size": 82081, "val_size": 40137}


@pytest.fixture(scope="module")
def twoway_coco() -> dict:
    """The resolved config of ``experiment=paper_twoway dataset=coco`` (composed once)."""
    return OmegaConf.to_container(compose_config(["experiment=paper_twoway", "dataset=coco"]), resolve=True)


def with_groups(config: dict, optim_target: str, sched_target: str) -> dict:
    """``config`` with optimizer and schedule as ``_partial_`` configs (``_target_``, no ``name`` key)."""
    config = copy.deepcopy(config)
    for group, target in (("optim", optim_target), ("sched", sched_target)):
        config[group].pop("name")
        config[group].update({"_target_": target, "_partial_": True})
    return config


def deviations(config: dict) -> list[str]:
    return protocol_deviations(config, {"epochs_completed": 40, "dataset": COCO_SIZES})


@pytest.mark.parametrize(
    ("optim_target", "sched_target", "expected"),
    [
        ("torch.optim.SGD", "torch.optim.lr_scheduler.CosineAnnealingLR", []),
        ("torch.optim.SGD", "mlcls.engine.schedule.warmup_cosine", []),
        ("torch.optim.AdamW", "mlcls.engine.schedule.cosine", ["optim=adamw (paper sgd)"]),
        ("torch.optim.ASGD", "mlcls.engine.schedule.cosine", ["optim=asgd (paper sgd)"]),
        ("torch.optim.SGD", "torch.optim.lr_scheduler.StepLR", ["sched=steplr (paper cosine)"]),
    ],
)
def test_optimizer_and_schedule_are_named_by_their_target(twoway_coco, optim_target, sched_target, expected):
    assert deviations(with_groups(twoway_coco, optim_target, sched_target)) == expected


def test_old_runs_name_their_optimizer_with_a_name_key(twoway_coco):
    assert deviations(twoway_coco) == []  # the paper presets of this version: optim.name, sched.name
    adamw = copy.deepcopy(twoway_coco)
    adamw["optim"]["name"] = "adamw"
    assert deviations(adamw) == ["optim=adamw (paper sgd)"]
    assert built_name({"name": "sgd", "_target_": "torch.optim.AdamW"}) == "sgd"
    assert built_name({}) is None
