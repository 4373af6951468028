"""mlcls.cli.overrides: a key override the config does not have stops the command with one line."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from mlcls.cli import overrides as overrides_module
from mlcls.cli.overrides import (
    check_command_line,
    check_overrides,
    compose_config,
    run_command,
)
from mlcls.errors import ConfigError
from mlcls.losses.spec import loss_name
from mlcls.models import create_model


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.epoch=3"], "unknown option trainer.epoch: did you mean trainer.epochs?"),
        (["loss.tpp=4"], "unknown option loss.tpp: did you mean loss.tp?"),
        (["+trainer.epoch=3"], "unknown option +trainer.epoch: did you mean trainer.epochs? (nothing reads"),
        (["sched.warmup=5"], "unknown option sched.warmup: did you mean sched.warmup_epochs?"),
        (["trainer.foo=1"], "trainer has amp, batch_size, "),
        (
            ["foo=1"],
            "unknown option foo: the config has data, dataset, logger, loss, metrics, model, optim, sched, "
            "text, thresholds, trainer",
        ),
        (["foo.bar=1"], "unknown option foo.bar: run with --cfg job to list the options"),
        (["optim=adamw", "optim.betas.2=0.9"], "unknown option optim.betas.2: optim.betas has 0, 1"),
        # dataset.year is a COCO key: unknown to the default (synthetic) dataset
        (["dataset.year=2017"], "unknown option dataset.year"),
        # a key of the loss the preset does not choose (the softmax loss has no tn)
        (["experiment=paper_softmax", "loss.tn=2"], "unknown option loss.tn"),
    ],
)
def test_unknown_keys_are_refused_with_the_closest_options(overrides, message):
    with pytest.raises(ConfigError) as info:
        check_overrides("train", overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["trainer.epochs=3", "loss.tp=2", "optim.lr_head=0.1"],
        ["optim=adamw", "optim.betas.1=0.99"],  # an item of a list
        ["dataset=coco", "dataset.year=2017", "dataset.root=/data/coco"],
        ["experiment=paper_twoway", "protocol.bucket_size=64", "loss.tn=2"],
        ["++trainer.epoch=3", "~trainer.ema_decay"],  # explicit add; deletion
        ["hydra.run.dir=somewhere", "hydra.job.chdir=true"],
        # sweeps: a key known to one of the swept presets passes (Hydra checks each job)
        ["experiment=paper_softmax,paper_twoway", "loss.tn=1,2"],
        ["loss.tp=1,2,4", "trainer.seed=range(3)"],
        # what Hydra itself reports better: an unknown config group option, unparsable text
        ["loss=nope", "trainer.epoch=3"],
        ["trainer.epochs=[1"],
    ],
)
def test_known_keys_groups_and_hydra_settings_pass(overrides):
    """Accepted as they are; and with the same group choices an unknown key is still refused, so the check
    ran on the configs those choices compose (not skipped). What Hydra reports itself is left to it."""
    check_overrides("train", overrides)
    if "loss=nope" in overrides or "trainer.epochs=[1" in overrides:
        return
    with pytest.raises(ConfigError, match="unknown option trainer.epochz"):
        check_overrides("train", [*overrides, "trainer.epochz=3"])


def test_other_commands_are_checked_against_their_own_config():
    check_overrides("eval", ["checkpoint=run/best.pt", "dataset.root=/data", "batch_size=8"])
    with pytest.raises(ConfigError, match="did you mean dataset.root"):
        check_overrides("eval", ["checkpoint=run/best.pt", "dataset.rot=/data"])
    with pytest.raises(ConfigError, match="unknown option trainer.epochs"):
        check_overrides("predict", ["trainer.epochs=3"])


def test_command_line_overrides_skips_flags_and_other_configs():
    argv = ["-m", "--cfg", "job", "trainer.epochs=3", "~trainer.ema_decay", "hydra.verbose=true"]
    assert check_command_line("train", argv) == ["trainer.epochs=3", "hydra.verbose=true"]
    assert check_command_line("train", ["--config-name", "mine", "trainer.epoch=3"]) is None
    assert check_command_line("train", ["-cd=/somewhere", "trainer.epoch=3"]) is None


def test_check_command_line_exits_2_with_one_line(capsys, monkeypatch):
    from mlcls.cli.train import _hydra_main

    monkeypatch.setattr(sys, "argv", ["mlcls-train", "trainer.bacth_size=8"])
    with pytest.raises(SystemExit) as info:
        run_command("train", _hydra_main)
    assert info.value.code == 2
    assert (
        capsys.readouterr().err
        == "mlcls: error: unknown option trainer.bacth_size: did you mean trainer.batch_size?\n"
    )


def test_the_commands_register_the_resolvers_their_configs_use(monkeypatch):
    """``${shards_source:...}`` of configs/dataset/shards.yaml resolves in a config that ``compose_config``
    composed, and under ``run_command``, whatever was imported before: they register it themselves (no
    module registers one as a side effect of its import)."""
    OmegaConf.clear_resolver("shards_source")
    cfg = compose_config("train", ["dataset=shards", "dataset.root=/nowhere"])
    assert cfg.dataset.image_size == 224 and cfg.dataset.transform == "paper"  # no manifest: the fallbacks
    OmegaConf.clear_resolver("shards_source")
    monkeypatch.setattr(sys, "argv", ["mlcls-train"])
    run_command("train", lambda: None)
    assert OmegaConf.has_resolver("shards_source")


def test_compose_config_checks_then_composes():
    cfg = compose_config("train", ["trainer.epochs=3", "loss=bce"])
    assert cfg.trainer.epochs == 3 and loss_name(cfg.loss) == "bce"
    with pytest.raises(ConfigError, match="did you mean trainer.epochs"):
        compose_config("train", ["trainer.epoch=3"])


def test_model_head_selects_the_head_config_group():
    assert check_command_line("train", ["model/head=csra"]) == ["model/head=csra"]
    cfg = compose_config("train", ["model/head=csra", "model.head.num_heads=2"])
    assert dict(cfg.model.head) == {"name": "csra", "num_heads": 2, "lam": 0.1, "warmup_epochs": 0}


@pytest.mark.parametrize("written", ["model.head=csra", "+model.head=csra"])
def test_a_nested_group_chosen_with_dots_is_one_line(written, capsys):
    # before: model.head=csra was rewritten to model/head=csra; Hydra alone sets model.head to "csra"
    with pytest.raises(SystemExit) as info:
        check_command_line("train", [written])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "mlcls: error: model.head is a config group: choose its option with model/head=csra\n"
    )
    with pytest.raises(ConfigError, match=r"^model\.head is a config group: choose its option with "):
        compose_config("train", [written])


def test_a_heads_key_on_another_head_is_refused():
    # old: model/head=linear model.num_groups=4 trained a linear head, num_groups read by nothing
    with pytest.raises(
        ConfigError,
        match=r"^unknown option model\.head\.num_groups: model\.head has drop_rate, name, warmup_epochs$",
    ):
        check_overrides("train", ["model/head=linear", "model.head.num_groups=4"])
    with pytest.raises(ConfigError, match=r"^unknown option \+model\.head\.num_groups: "):
        compose_config("train", ["model/head=csra", "+model.head.num_groups=4"])
    # ++ adds it all the same: the factory refuses an option the head does not take
    cfg = compose_config("train", ["model/head=csra", "++model.head.num_groups=4"])
    with pytest.raises(ConfigError, match=r"^model\.head\.num_groups is not an option of the csra head; "):
        create_model("resnet10t", 3, pretrained=False, head=cfg.model.head)


def test_a_sweep_composes_one_config_per_option_not_per_combination(monkeypatch):
    composed = []

    def counting(config_name, overrides):
        composed.append(list(overrides))
        return real(config_name=config_name, overrides=overrides)

    real = overrides_module.compose
    monkeypatch.setattr(overrides_module, "compose", counting)
    check_overrides("train", ["loss=bce,asl,twoway", "optim=sgd,adamw", "loss.gamma_neg=2"])
    # old: 3 x 2 = 6 compositions; now the first choices, then each other option alone: 1 + 2 + 1
    assert len(composed) == 4
