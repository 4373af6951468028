"""Checkpoints are data, not code: plain contents loaded with weights_only=True, pickles and ``_target_``s
from files refused with one line, old files re-saved or trusted explicitly."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, compose_config
from PIL import Image

from mlcls.cli.errors import error_line
from mlcls.cli.eval import evaluate_checkpoint
from mlcls.cli.predict import run as predict_run
from mlcls.cli.train import run as train_run
from mlcls.engine.checkpoint import UntrustedCheckpointError, load_checkpoint, resave_plain, save_checkpoint
from mlcls.engine.rundir import LOCK_NAME
from mlcls.engine.state import rng_state, set_rng_state
from mlcls.engine.trainer import Trainer
from mlcls.engine.validate import ConfigError
from mlcls.inference.errors import InferenceError
from mlcls.inference.export import export_checkpoint
from mlcls.inference.predictor import load_inference_model

# 64 training images in batches of 32, one epoch: a checkpoint in a few seconds.
QUICK = ["dataset.train_size=64", "dataset.val_size=20", "trainer.epochs=1"]


def write_marker(path: str, **ignored) -> None:
    """What a hostile ``_target_`` would do: write a file."""
    Path(path).write_text("ran")


class _OpensMarker:
    """Unpickled, creates the file ``marker`` (``open(marker, "w")``): a pickle that runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The run directory of a one-epoch training run (last.pt, best.pt), shared by the tests here."""
    run_dir = tmp_path_factory.mktemp("trained")
    train_run(compose_config([*TINY, *QUICK, "trainer.ema_decay=0.9", f"trainer.output_dir={run_dir}"]))
    return run_dir


def test_training_checkpoints_hold_plain_data_only(trained):
    for name in ("last.pt", "best.pt"):
        state = torch.load(trained / "checkpoints" / name, weights_only=True)  # raises on any pickled object
        assert state["classes"][0] == "red_circle"
    rng = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)["rng"][0]
    assert rng["numpy"][0] == "MT19937" and rng["numpy"][1].dtype == torch.int64


def test_rng_state_round_trips_through_a_plain_checkpoint(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    save_checkpoint({"model": {}, "rng": rng_state()}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.random(4), torch.rand(4))
    set_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    assert random.random() == expected[0]
    assert np.array_equal(np.random.random(4), expected[1])
    assert torch.equal(torch.rand(4), expected[2])


def _evil_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"model": {}, "classes": ["a"], "payload": _OpensMarker(marker)}, path)
    return path


def test_a_pickle_that_runs_code_is_refused_everywhere_with_one_line(tmp_path, trained):
    marker = tmp_path / "marker"
    evil = _evil_checkpoint(tmp_path / "evil.pt", marker)
    with pytest.raises(UntrustedCheckpointError) as caught:
        load_checkpoint(evil)
    line = error_line(caught.value)
    assert "\n" not in str(caught.value) and line == str(caught.value)
    assert "open object" in line and "trust_checkpoint=true" in line and "mlcls.cli.resave" in line
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.jpg")
    predict_cfg = compose_config([f"checkpoint={evil}", f"images={tmp_path}"], config_name="predict")
    eval_cfg = compose_config([f"checkpoint={evil}", "device=cpu"], config_name="eval")
    for attempt in (
        lambda: predict_run(predict_cfg),
        lambda: evaluate_checkpoint(eval_cfg),
        lambda: export_checkpoint(evil, "torchscript", tmp_path / "out.pt"),
    ):
        with pytest.raises(UntrustedCheckpointError, match="evil.pt holds a"):
            attempt()
    assert not marker.exists()

    # resume=auto finds it as last.pt of the run directory: refused, not skipped for an older one
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    _evil_checkpoint(run_dir / "checkpoints" / "last.pt", marker)
    with pytest.raises(UntrustedCheckpointError, match="last.pt holds a"):
        Trainer(compose_config([*TINY, *QUICK, f"trainer.output_dir={run_dir}", "trainer.resume=auto"]))
    assert not marker.exists()
    # the failed start releases the run directory and keeps its checkpoint
    assert not (run_dir / LOCK_NAME).exists() and (run_dir / "checkpoints" / "last.pt").is_file()

    load_checkpoint(evil, trust=True)  # trusting a file unpickles it as it is
    assert marker.exists()


def _checkpoint_with_config(path: Path, trained: Path, section: str, value: dict) -> Path:
    state = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)
    state["config"][section] = value
    torch.save(state, path)
    return path


def test_a_model_target_from_a_file_is_never_called(tmp_path, trained):
    marker = tmp_path / "marker"
    hostile = {"_target_": "test_checkpoint_trust.write_marker", "path": str(marker)}
    path = _checkpoint_with_config(tmp_path / "target.pt", trained, "model", hostile)
    with pytest.raises(InferenceError, match="model._target_ is 'test_checkpoint_trust.write_marker'"):
        load_inference_model(path, device="cpu")
    assert not marker.exists()

    fields = {"_target_": "mlcls.models.create_model", "name": "resnet10t", "pretrained": True, "path": "x"}
    path = _checkpoint_with_config(tmp_path / "fields.pt", trained, "model", fields)
    with pytest.raises(InferenceError, match=r"has path, which mlcls.models.create_model does not take"):
        load_inference_model(path, device="cpu")

    # the run's own fields build the model with create_model, pretrained or not: nothing downloaded
    fields.pop("path")
    path = _checkpoint_with_config(tmp_path / "good.pt", trained, "model", fields)
    inference = load_inference_model(path, device="cpu")
    expected = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)["model"]
    assert all(torch.equal(v, expected[k]) for k, v in inference.model.state_dict().items())


def test_a_dataset_target_from_a_file_is_not_called_by_eval(tmp_path, trained):
    marker = tmp_path / "marker"
    stored = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)["config"]["dataset"]
    hostile = {**stored, "_target_": "test_checkpoint_trust.write_marker", "path": str(marker)}
    path = _checkpoint_with_config(tmp_path / "target.pt", trained, "dataset", hostile)
    cfg = compose_config([f"checkpoint={path}", "device=cpu"], config_name="eval")
    with pytest.raises(ConfigError, match="dataset._target_='test_checkpoint_trust.write_marker'"):
        evaluate_checkpoint(cfg)
    assert not marker.exists()

    nested = {**stored, "transform": {"_target_": "test_checkpoint_trust.write_marker", "path": str(marker)}}
    path = _checkpoint_with_config(tmp_path / "nested.pt", trained, "dataset", nested)
    cfg = compose_config([f"checkpoint={path}", "device=cpu"], config_name="eval")
    with pytest.raises(ConfigError, match="dataset.transform holds a _target_"):
        evaluate_checkpoint(cfg)
    assert not marker.exists()


def test_an_old_checkpoint_is_refused_then_resaved_as_plain_data(tmp_path, trained):
    # what mlcls wrote before: NumPy's random state as it comes, with an ndarray inside
    state = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    state["rng"] = [{**state["rng"][0], "numpy": np.random.get_state()}]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    with pytest.raises(UntrustedCheckpointError, match=r"holds a numpy\.[\w.]+ object.*mlcls.cli.resave"):
        load_checkpoint(old)
    assert load_checkpoint(old, trust=True)["rng"][0]["numpy"][1].dtype == np.uint32

    resave_plain(old)
    resaved = torch.load(old, weights_only=True)
    assert torch.equal(
        resaved["rng"][0]["numpy"][1], torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    )
    assert all(torch.equal(v, state["model"][k]) for k, v in resaved["model"].items())
