"""Each head's default warm-up (configs/model/head/*.yaml, ``warmup_epochs``): what the composed config
shows, the schedule it gives over the first iterations, a user's own setting winning, and each head at least
the linear head's mAP@class on a reduced demo."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import compose_config, run_main
from omegaconf import OmegaConf
from test_engine_optim import paper_cosine_lr

from mlcls.cli.overrides import compose_config as compose_config_checked
from mlcls.cli.train import main as train_main
from mlcls.engine.build import build_optimization
from mlcls.engine.config_checks import check_config
from mlcls.engine.optim import group_lrs
from mlcls.engine.trainer import Trainer
from mlcls.errors import ConfigError
from mlcls.models import create_model

# docs/models.md: ML-Decoder collapses when AdamW 2e-3 starts at the first step; a warm-up epoch fixes it.
HEAD_WARMUP_EPOCHS = {"linear": 0, "mldecoder": 1, "csra": 0}
DEMO_LR = 2.0e-3  # configs/experiment/demo.yaml
DEMO_ITERS_PER_EPOCH = 31  # 2,000 images in batches of 64, the last partial batch dropped
DEMO_EPOCHS = 5


@pytest.mark.parametrize(("head", "epochs"), HEAD_WARMUP_EPOCHS.items())
def test_the_composed_config_takes_each_heads_warmup_from_the_heads_config(head, epochs):
    cfg = compose_config([f"model/head={head}"])
    assert OmegaConf.to_container(cfg.sched) == {  # the one warm-up key, null: the head's default
        "_target_": "mlcls.engine.optim.cosine_schedule",
        "_partial_": True,
        "warmup_epochs": None,
        "min_lr_ratio": 0.0,
        "decay_start": 0.0,
    }
    assert (cfg.model.head.name, cfg.model.head.warmup_epochs) == (head, epochs)
    check_config(cfg, world_size=1)


def test_cfg_job_shows_the_heads_warmup(tmp_path, monkeypatch, capsys):
    """mlcls-train's --cfg job, in this process (test_cli_train.py runs the installed console script)."""
    monkeypatch.chdir(tmp_path)
    argv = ["mlcls-train", "model/head=mldecoder", "--cfg", "job", "--resolve"]
    code, err, out = run_main(train_main, argv, monkeypatch, capsys)
    assert code == 0, err
    cfg = OmegaConf.create(out)
    assert (cfg.sched.warmup_epochs, cfg.model.head.name, cfg.model.head.warmup_epochs) == (
        None,
        "mldecoder",
        1,
    )


def head_lrs(overrides: list[str], iterations: int) -> list[float]:
    """The head group's lr over the first ``iterations`` of the demo's schedule under ``overrides``."""
    cfg = compose_config(overrides)
    torch.manual_seed(0)
    model = create_model("resnet10t", 12, pretrained=False)  # the schedule is the config's, whatever the head
    optimizer, scheduler = build_optimization(cfg, model, DEMO_ITERS_PER_EPOCH)
    lrs = []
    for _ in range(iterations):
        lrs.append(group_lrs(optimizer)["head"])
        optimizer.step()
        scheduler.step()
    return lrs


def expected_lrs(warmup_iters: int, iterations: int) -> list[float]:
    total = DEMO_EPOCHS * DEMO_ITERS_PER_EPOCH
    return [paper_cosine_lr(DEMO_LR, i, total, warmup_iters, 0.0) for i in range(iterations)]


@pytest.mark.parametrize("head", HEAD_WARMUP_EPOCHS)
def test_the_schedule_warms_up_mldecoder_for_one_epoch_and_the_others_not(head):
    lrs = head_lrs([f"model/head={head}"], 40)
    assert lrs == pytest.approx(expected_lrs(HEAD_WARMUP_EPOCHS[head] * DEMO_ITERS_PER_EPOCH, 40), rel=1e-12)
    if head == "mldecoder":
        assert math.isclose(lrs[0], DEMO_LR / 31) and math.isclose(lrs[30], DEMO_LR)
    else:
        assert math.isclose(lrs[0], DEMO_LR)  # linear and CSRA start at the full lr, as before


@pytest.mark.parametrize(
    ("overrides", "warmup_iters"),
    [
        (["model/head=mldecoder", "sched.warmup_epochs=0"], 0),
        (["model/head=mldecoder", "sched.warmup_epochs=0.17"], 5),  # 5.27 iterations, over the head's epoch
        (["model/head=linear", "sched.warmup_epochs=2"], 62),
        (["model/head=csra", "model.head.warmup_epochs=0.5"], 16),  # 15.5 iterations, rounded
        # the paper preset's explicit warmup_epochs: 0 holds for every head
        (
            [
                "experiment=paper",
                "dataset=synthetic",
                "model/head=mldecoder",
                "optim.lr_head=2e-3",
                "trainer.epochs=5",
            ],
            0,
        ),
    ],
)
def test_what_the_user_sets_wins_over_the_heads_default(overrides, warmup_iters):
    assert head_lrs(overrides, 70) == pytest.approx(expected_lrs(warmup_iters, 70), rel=1e-12)


def test_onecycle_warms_up_every_head_by_its_own_rise():
    cfg = compose_config(["sched=onecycle", "model/head=mldecoder"])
    assert "warmup_epochs" not in cfg.sched
    check_config(cfg, world_size=1)
    lrs = head_lrs(["sched=onecycle", "model/head=mldecoder"], 3)
    assert math.isclose(lrs[0], DEMO_LR / 25) and lrs[0] < lrs[1] < lrs[2]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sched.warmup_epochs=-1"], "sched.warmup_epochs=-1; expected a number >= 0"),
        (["sched.warmup_epochs=true"], "sched.warmup_epochs=True; expected a number >= 0"),
        (["model.head.warmup_epochs=-2"], "sched.warmup_epochs=-2; expected a number >= 0"),
    ],
)
def test_a_bad_warmup_setting_is_refused_in_one_line(overrides, message):
    cfg = compose_config(overrides)
    model = create_model("resnet10t", 12, pretrained=False)
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_optimization(cfg, model, DEMO_ITERS_PER_EPOCH)


def test_an_unknown_head_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^Could not find 'model/head/mldecodr'\. Available options in "):
        compose_config_checked("train", ["model/head=mldecodr"])


# The demo on 640 training and 200 validation images: 4 epochs of 10 steps, a quarter of its cost, the
# same ordering of the heads (docs/models.md, "On the demo").
REDUCED_DEMO = [
    "dataset.train_size=640",
    "dataset.val_size=200",
    "trainer.epochs=4",
    "trainer.workers=0",
    "trainer.log_every=1000",
]


@pytest.mark.slow
@pytest.mark.long  # three trainings of 640 images x 4 epochs: at 384 x 3 or 320 x 4 the order does not hold
def test_each_head_reaches_the_linear_heads_map_on_a_reduced_demo(tmp_path):
    """With nothing but ``model.head`` changed, ML-Decoder and CSRA reach at least the linear head's
    mAP@class. Measured on the development CPU: linear 53.36, CSRA 62.02, ML-Decoder 60.92 with its warm-up
    and 37.51 without (sched.warmup_epochs=0); at 32 px the order does not hold: the feature map is 1 x 1,
    and CSRA's spatial attention has nothing to attend to."""
    maps = {}
    for head in HEAD_WARMUP_EPOCHS:
        overrides = [f"model/head={head}", *REDUCED_DEMO]
        maps[head] = Trainer(compose_config(overrides), run_dir=tmp_path / head).fit()["metrics"]["mAP_class"]
    assert maps["mldecoder"] >= maps["linear"] and maps["csra"] >= maps["linear"], maps
