"""mlcls.cli.overrides: a key override the config does not have stops the command with one line."""

from __future__ import annotations

import sys

import pytest

from mlcls.cli.overrides import check_overrides, command_line_overrides, compose_config, run_command
from mlcls.engine.validate import ConfigError
from mlcls.losses.spec import loss_name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.epoch=3"], "unknown option trainer.epoch: did you mean trainer.epochs?"),
        (["loss.tpp=4"], "unknown option loss.tpp: did you mean loss.tp?"),
        (["+trainer.epoch=3"], "unknown option +trainer.epoch: did you mean trainer.epochs? (nothing reads"),
        (["sched.warmup=5"], "did you mean sched.warmup_iters or sched.warmup_epochs?"),
        (["trainer.foo=1"], "trainer has amp, batch_size, "),
        (
            ["foo=1"],
            "unknown option foo: the config has data, dataset, logger, loss, model, optim, sched, trainer",
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
    check_overrides("train", overrides)


def test_other_commands_are_checked_against_their_own_config():
    check_overrides("eval", ["checkpoint=run/best.pt", "dataset.root=/data", "batch_size=8"])
    with pytest.raises(ConfigError, match="did you mean dataset.root"):
        check_overrides("eval", ["checkpoint=run/best.pt", "dataset.rot=/data"])
    with pytest.raises(ConfigError, match="unknown option trainer.epochs"):
        check_overrides("predict", ["trainer.epochs=3"])


def test_command_line_overrides_skips_flags_and_other_configs():
    argv = ["-m", "--cfg", "job", "trainer.epochs=3", "~trainer.ema_decay", "hydra.verbose=true"]
    assert command_line_overrides(argv) == ["trainer.epochs=3", "hydra.verbose=true"]
    assert command_line_overrides(["--config-name", "mine", "trainer.epoch=3"]) is None
    assert command_line_overrides(["-cd=/somewhere", "trainer.epoch=3"]) is None


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


def test_compose_config_checks_then_composes():
    cfg = compose_config("train", ["trainer.epochs=3", "loss=bce"])
    assert cfg.trainer.epochs == 3 and loss_name(cfg.loss) == "bce"
    with pytest.raises(ConfigError, match="did you mean trainer.epochs"):
        compose_config("train", ["trainer.epoch=3"])
