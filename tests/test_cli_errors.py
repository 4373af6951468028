"""Every mistake on a mlcls-* command line is one line on stderr and exit status 2 (mlcls.cli.overrides,
mlcls.cli.errors), and the check costs no config composition when the command line is right."""

from __future__ import annotations

import os
from importlib.metadata import distribution
from pathlib import Path

import pytest
import tomllib
from conftest import run_main
from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from mlcls import config_dir
from mlcls.cli import bench as bench_cli
from mlcls.cli import data as data_cli
from mlcls.cli import eval as eval_cli
from mlcls.cli import export as export_cli
from mlcls.cli import import_ as import_cli
from mlcls.cli import overrides
from mlcls.cli import predict as predict_cli
from mlcls.cli import report as report_cli
from mlcls.cli import reproduce as reproduce_cli
from mlcls.cli import tables as tables_cli
from mlcls.cli import train as train_cli
from mlcls.cli.errors import error_line, require_keys
from mlcls.errors import ConfigError, plural

LOSSES = ", ".join(sorted(path.stem for path in (config_dir() / "loss").glob("*.yaml")))  # Hydra's listing


def test_each_console_script_runs_the_main_the_tests_call():
    """The installed console scripts are pyproject's, and each runs ``sys.exit(main())`` of the ``main`` that
    the tests call in-process (:func:`conftest.run_main`): a test of a command needs no subprocess."""
    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    installed = {e.name: e for e in distribution("mlcls").entry_points if e.group == "console_scripts"}
    assert {name: entry.value for name, entry in installed.items()} == declared
    assert {name: entry.load() for name, entry in installed.items()} == {
        "mlcls-train": train_cli.main,
        "mlcls-eval": eval_cli.main,
        "mlcls-data": data_cli.main,
        "mlcls-predict": predict_cli.main,
        "mlcls-export": export_cli.main,
        "mlcls-tables": tables_cli.main,
        "mlcls-reproduce": reproduce_cli.main,
        "mlcls-bench": bench_cli.main,
        "mlcls-import": import_cli.main,
        "mlcls-report": report_cli.main,
    }


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        # 15.1: a required key not given
        (eval_cli.main, ["mlcls-eval"], "mlcls: error: missing checkpoint=… (required); usage: mlcls-eval "),
        (
            export_cli.main,
            ["mlcls-export"],
            "mlcls: error: missing checkpoint=… (required); usage: mlcls-export",
        ),
        (
            predict_cli.main,
            ["mlcls-predict", "images=photos/"],
            "mlcls: error: missing checkpoint=… (required); usage: mlcls-predict checkpoint=",
        ),
        (
            predict_cli.main,
            ["mlcls-predict"],
            "mlcls: error: missing checkpoint=… and images=… (required); usage: mlcls-predict",
        ),
        # 15.9: an unknown config group option, with the options
        (
            train_cli._hydra_main,
            ["mlcls-train", "loss=nope"],
            f"mlcls: error: Could not find 'loss/nope'. Available options in 'loss': {LOSSES}",
        ),
        (
            train_cli._hydra_main,
            ["mlcls-train", "-m", "loss=bce,nope"],
            f"mlcls: error: Could not find 'loss/nope'. Available options in 'loss': {LOSSES}",
        ),
        # a training group given to a command whose config has none
        (
            predict_cli.main,
            ["mlcls-predict", "checkpoint=a.pt", "loss=bce"],
            "mlcls: error: unknown option loss: the config has checkpoint, images, out, threshold, top_k, "
            "batch_size, workers, device, quiet",
        ),
        # a positional argument
        (
            predict_cli.main,
            ["mlcls-predict", "ckpt.pt", "photos/"],
            "mlcls: error: unexpected argument 'ckpt.pt': mlcls-predict takes key=value overrides; "
            "mlcls-predict --help lists the keys",
        ),
        # an override Hydra cannot parse
        (
            export_cli.main,
            ["mlcls-export", "checkpoint=a.pt", "opset=[1"],
            "mlcls: error: cannot parse 'opset=[1' (no viable alternative at input '[1'): expected key=value",
        ),
        # an unknown key of another command
        (eval_cli.main, ["mlcls-eval", "checkpoint=a.pt", "batch=8"], "mlcls: error: unknown option batch: "),
    ],
)
def test_mistakes_are_one_line_with_status_2(main, argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # as the subprocess tests set it: Hydra's report is not asked
    if main is train_cli._hydra_main:
        main = lambda: overrides.run_command("train", train_cli._hydra_main)  # noqa: E731 -- train.py's main
    code, err, _ = run_main(main, argv, monkeypatch, capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith(message), err
    assert os.environ["HYDRA_FULL_ERROR"] == "0"


@pytest.mark.parametrize("main", [predict_cli.main, eval_cli.main, export_cli.main])
def test_help_lists_the_command_keys_not_the_training_groups(main, monkeypatch, capsys):
    code, _, out = run_main(main, ["mlcls-x", "--help"], monkeypatch, capsys)
    assert code == 0
    assert "checkpoint: ???" in out and "Usage: mlcls-" in out
    assert "Configuration groups" not in out and "loss:" not in out and "experiment" not in out


def test_a_right_command_line_composes_no_config(monkeypatch):
    def no_composition(*args, **kwargs):
        raise AssertionError("composed a config")

    monkeypatch.setattr(overrides, "compose", no_composition)
    argv = ["-m", "trainer.epochs=1,2", "loss=bce", "loss.pos_weight=2", "++x.y=1", "~trainer.ema_decay"]
    assert overrides.check_command_line("train", argv) == [arg for arg in argv if "=" in arg]
    # a single + adds a key Hydra accepts and nothing reads: then the config is composed to check it
    with pytest.raises(AssertionError, match="composed"):
        overrides.check_command_line("train", ["+trainer.epoch=3"])


def test_error_line_unwraps_instantiation_and_omegaconf_errors():
    wrapped = InstantiationException("Error in call to target 'mlcls.models.create_model':\nConfigError(...)")
    wrapped.__cause__ = ConfigError("model.pretrained=true: cannot fetch the weights")
    assert error_line(wrapped) == "model.pretrained=true: cannot fetch the weights"
    cfg = OmegaConf.create({"checkpoint": "???"})
    with pytest.raises(Exception) as info:
        _ = cfg.checkpoint
    assert error_line(info.value) == "Missing mandatory value: checkpoint"


def test_require_keys_and_plural():
    require_keys(OmegaConf.create({"checkpoint": "a.pt", "out": None}), "usage")
    with pytest.raises(ConfigError, match=r"^missing checkpoint=… \(required\); usage: mlcls-x a=1$"):
        require_keys(OmegaConf.create({"checkpoint": "???", "out": None}), "mlcls-x a=1")
    assert [plural(n, "image") for n in (0, 1, 2)] == ["0 images", "1 image", "2 images"]


@pytest.mark.parametrize(
    ("count", "noun", "expected"),
    [
        (1, "class", "1 class"),
        (12, "class", "12 classes"),
        (0, "image", "0 images"),
        (2, "box", "2 boxes"),
        (3, "batch", "3 batches"),
        (2, "epoch", "2 epochs"),
        (2, "head", "2 heads"),
    ],
)
def test_plural_writes_english_plurals(count, noun, expected):
    """Old: "12 classs" in mlcls-import's summary and the report's "The other N classs"."""
    assert plural(count, noun) == expected


def test_oversized_and_unsafe_files_are_one_line_user_errors(tmp_path, capsys):
    from mlcls.cli.errors import user_errors
    from mlcls.io import read_yaml

    bomb = tmp_path / "config.yaml"
    bomb.write_text("a: &a [x, x]\nb: [*a, *a]\n")
    for path, kwargs in ((bomb, {}), (bomb, {"max_bytes": 4})):
        with pytest.raises(SystemExit) as exit_info, user_errors():
            read_yaml(path, **kwargs)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("mlcls: error: ") and str(path) in err
